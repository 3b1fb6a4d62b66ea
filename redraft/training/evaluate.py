"""``redraft glide eval``: GliDe vs vanilla drafts, chain vs CaPE, against plain greedy, on held-out questions.

Every configuration runs the same held-out Spec-Bench questions (:data:`redraft.training.data.MEASURE_IDS`, never
used in training) through :class:`redraft.decoding.engine.Engine`, one after the other, and is compared with plain greedy
decoding (the engine with no drafters) on the same questions: acceptance rate (accepted / proposed draft tokens),
tokens per verify forward, wall-clock tokens/s and speed-up, and whether the output ids are identical.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from redraft.decoding.runstats import RunSummary
from redraft.drafters.cape import CapeBins
from redraft.io import atomic


@dataclass
class Config:
    """One measured configuration: a draft checkpoint (None = plain greedy), head size, chain or CaPE; or
    ``drafters``, a callable(HFTarget) -> list of drafters (a corpus or n-gram source) used instead of a checkpoint."""

    label: str
    path: str | None = None
    head_vocab: int = 0
    cape: CapeBins | None = None
    gamma: int = 4
    minacc: float | None = None  # acceptance guard (fraction), as `redraft run` attaches it; None = no guard
    drafters: Callable | None = None


@dataclass
class Result:
    """One configuration's figures: its :class:`RunSummary` over the questions, and how many outputs equal plain
    greedy's."""

    label: str
    run: RunSummary = field(default_factory=RunSummary)
    identical: int = 0
    outputs: list = field(default_factory=list)

    questions = property(lambda self: self.run.runs)
    tokens = property(lambda self: self.run.tokens)
    forwards = property(lambda self: self.run.forwards)
    seconds = property(lambda self: self.run.seconds)
    proposed = property(lambda self: self.run.proposed)
    accepted = property(lambda self: self.run.accepted)
    acceptance = property(lambda self: self.run.acceptance)
    tokens_per_forward = property(lambda self: self.run.tokens_per_forward)
    tokens_per_second = property(lambda self: self.run.tokens_per_second)


def measure(loaded, configs: list[Config], question_ids: list[int], ngen: int, *, tree_budget: int = 64,
            log=None) -> list[Result]:
    """Run every configuration on every question (interleaved); the first config must be plain greedy.

    Returns:
        one :class:`Result` per config; ``identical`` counts questions whose ids equal plain greedy's.
    Raises:
        ValueError: the first configuration is not plain greedy.
    """
    log = sys.stderr if log is None else log  # the stream current at the call
    from redraft.compose import SpeculationConfig, build_engine, glide_drafter
    from redraft.defaults import MAX_DRAFT_DEPTH
    from redraft.io.prompts import encode_prompt
    from redraft.io.questions import load_questions
    from redraft.runtimes.transformers.target import HFTarget

    if configs[0].path is not None or configs[0].drafters is not None:
        raise ValueError("the first configuration must be plain greedy (the reference)")
    qs = load_questions()
    prompts = [encode_prompt(loaded.tokenizer, qs[i]["turns"][0]) for i in question_ids]
    engines = []
    for c in configs:
        target = HFTarget(loaded.model)
        drafters = [] if c.drafters is None else list(c.drafters(target))
        if c.path is not None:
            drafters = [glide_drafter(c.path, loaded.model, gamma=c.gamma, cape=c.cape, head_vocab=c.head_vocab or None,
                                      target=target, minacc=c.minacc)]
        # the draft model alone, no policy (its guard, if any, is the GliDe drafter's own); depth capped at 48 only
        spec = SpeculationConfig(k=MAX_DRAFT_DEPTH, policy=False, ngram=False, tree_budget=tree_budget)
        engine = build_engine(target, spec, eos_token_ids=loaded.eos_token_ids, drafters=drafters)
        engine.generate(prompts[0][:8], 2)  # warm-up
        engines.append(engine)
    results = [Result(c.label) for c in configs]
    # interleaved per question, so that load from other processes hits every configuration alike
    for q, p in zip(question_ids, prompts, strict=True):
        for engine, res in zip(engines, results, strict=True):
            g = engine.generate(p, ngen)
            res.run.add(g)
            res.outputs.append(g.output_ids)
        print(f"  question {q} done", file=log, flush=True)
    for res in results:
        res.identical = sum(a == b for a, b in zip(res.outputs, results[0].outputs, strict=True))
        acc = f"{res.acceptance:.1%}" if res.proposed else "-"
        print(f"  {res.label}: {res.tokens_per_forward:.2f} tokens/forward, acceptance {acc}, "
              f"{res.tokens_per_second:.1f} tok/s, identical {res.identical}/{res.questions}", file=log, flush=True)
    return results


def table(results: list[Result]) -> str:
    """Markdown table of results (speed-up against the first row)."""
    base = results[0].tokens_per_second or 1.0
    lines = ["| configuration | acceptance | tokens/forward | tok/s | speed-up | identical |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        acc = f"{r.acceptance:.1%}" if r.proposed else "-"
        lines.append(f"| {r.label} | {acc} | {r.tokens_per_forward:.2f} | {r.tokens_per_second:.1f} | "
                     f"{r.tokens_per_second / base:.2f}x | {r.identical}/{r.questions} |")
    return "\n".join(lines)


def to_json(results: list[Result]) -> list[dict]:
    return [{"label": r.label, "acceptance": r.acceptance, "tokens_per_forward": r.tokens_per_forward,
             "tokens_per_second": r.tokens_per_second, "tokens": r.tokens, "forwards": r.forwards,
             "proposed": r.proposed, "accepted": r.accepted, "seconds": r.seconds, "identical": r.identical,
             "questions": r.questions} for r in results]


def write_json(path: str, results: list[Result], extra: dict | None = None) -> None:
    atomic.write_json(path, {"results": to_json(results), **(extra or {})})
