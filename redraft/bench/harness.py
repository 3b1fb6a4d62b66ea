"""`redraft bench run` and `redraft bench cost`: redraft side by side with the engines a user would pick instead.

``bench run``:

1. answers the replay questions with plain greedy decoding and freezes prompt + answer into a corpus;
2. builds the workloads (see :mod:`redraft.bench.workloads`) against that corpus;
3. runs every method on every question, interleaved per question (all methods on question 1, then all on
   question 2, ..., the starting method rotated per question) so machine noise hits all methods alike;
4. reports tok/s, speedup over plain greedy (ratio of the medians of per-question tok/s from this same run),
   tokens/forward, acceptance per draft source, forwards, peak RSS and whether the output ids equal plain greedy's;
5. times, per question right after its methods, the replay ceiling: one forward over the prompt and plain greedy's
   answer (:mod:`redraft.bench.ceiling`), and reports each method's generation time against it (``of_ceiling``).
6. with ``rounds`` > 1, does 3 and 5 that many times with freshly built methods and merges the rounds per question
   (:mod:`redraft.bench.rounds`: median seconds, fastest ceiling, decisions and outputs checked against round 1's).

Everything raw goes to results.json (schema ``redraft-bench/1``); results.md and PNG plots are derived from it.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from redraft.bench.ceiling import CeilingTimer
from redraft.bench.methods import ALL_METHODS, Method, MethodConfig, build_methods
from redraft.bench.report import BASELINE, differing, markdown, summarize, write_plots
from redraft.bench.rounds import first_diff, merge_rounds, rounds_differing
from redraft.bench.workloads import Encoder, Workload, build_workloads, item_for, replay_questions
from redraft.corpus import Corpus
from redraft.decoding.runstats import RunSummary
from redraft.io.atomic import write_json, write_text
from redraft.io.progress import Progress

SCHEMA = "redraft-bench/1"


# ---- memory ------------------------------------------------------------------------------------------------------
def rss_mb() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:
        return None


def max_rss_mb() -> float:
    """Peak resident set of this process so far (ru_maxrss; KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a thread while the block runs; ``peak`` in MiB."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        v = rss_mb()
        if v is not None and (self.peak is None or v > self.peak):
            self.peak = v

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        if self.interval > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


# ---- the run ----------------------------------------------------------------------------------------------------
def run_methods(workloads: Sequence[Workload], methods: Sequence[Method], ngen: int, *, progress: bool = True,
                rss_interval: float = 0.02, warmup: bool = True,
                ceiling: Callable[[list[int], list[int]], float | None] | None = None, desc: str = "bench",
                rotate: int = 0) -> dict:
    """Run every method on every item, interleaved per item; returns {workload: {"description", "questions", "runs"}}.

    ``methods[0]`` must be plain greedy (name ``plain``): every other method's output ids are compared with its
    output for the same prompt. Each run dict holds the raw figures (see the module doc of
    :mod:`redraft.bench.report` for how they are summarised).

    Args:
        ceiling: (prompt ids, plain greedy's answer ids) -> seconds of the replay ceiling
            (:class:`redraft.bench.ceiling.CeilingTimer`), timed after the methods of each item; each run then
            holds ``ceiling_seconds`` and ``of_ceiling`` = ceiling seconds / its generation seconds. None = not timed.
        desc: the progress bar's label.
        rotate: added to each item's start rotation (a round number: each round starts the methods elsewhere).
    """
    if not methods or methods[0].name != BASELINE:
        raise ValueError(f"the first method must be {BASELINE!r} (the reference for speedup and identical output)")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    items = [it for w in workloads for it in w.items]
    if warmup and items:  # first-call allocations and lazy imports must not land on question 1
        ids = items[0].prompt_ids
        for m in methods:
            m.generate(ids, min(8, ngen))
        if ceiling is not None:
            ceiling(ids, list(ids[:min(8, ngen)]))
    bar = Progress(total=len(items) * len(methods), desc=desc, unit="run", enabled=progress, dynamic_ncols=True)
    out: dict[str, dict] = {}
    qn = 0
    for w in workloads:
        runs: list[dict] = []
        for item in w.items:
            r0 = (qn + rotate) % len(methods)
            order = list(methods[r0:]) + list(methods[:r0])
            qn += 1
            got: dict[str, tuple] = {}
            for pos, m in enumerate(order):
                bar.set_postfix_str(f"{w.name} q{item.qid} {m.name}", refresh=False)
                with RssSampler(rss_interval) as rs:
                    rec = m.generate(item.prompt_ids, ngen)
                got[m.name] = (rec, pos, rs.peak)
                bar.update()
            ref = got[BASELINE][0].output_ids
            ceil_s = ceiling(item.prompt_ids, list(ref)) if ceiling is not None else None
            for m in methods:
                rec, pos, peak = got[m.name]
                fd = first_diff(rec.output_ids, ref)
                stats = RunSummary.of([rec])
                row = {
                    "question_id": item.qid, "category": item.category, "turn": item.turn, "method": m.name,
                    "order": pos, "prompt_tokens": len(item.prompt_ids), "tokens": stats.tokens,
                    "seconds": rec.seconds, "tok_s": stats.tokens_per_second,
                    "forwards": rec.forwards,
                    "tokens_per_forward": stats.tokens_per_forward if rec.forwards else None,
                    "accepted_per_forward": rec.accepted_per_forward,
                    "draft_depth_per_forward": rec.draft_depth_per_forward,
                    "sources": rec.sources, "stop_reason": rec.stop_reason, "rss_peak_mb": peak,
                    "identical": fd is None, "first_diff": fd,
                }
                if ceil_s is not None:
                    row["ceiling_seconds"] = ceil_s
                    row["of_ceiling"] = ceil_s / rec.seconds if rec.seconds > 0 else None
                if m.name == BASELINE or fd is not None:
                    row["output_ids"] = list(rec.output_ids)
                runs.append(row)
        out[w.name] = {"description": w.description,
                       "questions": [{"question_id": it.qid, "category": it.category, "turn": it.turn,
                                      "prompt_tokens": len(it.prompt_ids)} for it in w.items],
                       "runs": runs}
    bar.close()
    return out


def freeze_answers(model, eos_token_ids, encoder: Encoder, questions: Sequence[dict], ngen: int, *,
                   max_prompt_tokens: int | None = None, progress: bool = True):
    """Plain greedy answers to ``questions``; returns ([(question, answer ids)], corpus spans prompt + answer)."""
    from redraft.compose import plain_engine  # torch-bound at build: the CLI imports this module for its flags

    plain = plain_engine(model, eos_token_ids=list(eos_token_ids))
    frozen, spans = [], []
    for q in Progress(questions, desc="freeze (plain greedy)", unit="q", noun="question", enabled=progress):
        ids = item_for(q, encoder, max_prompt_tokens).prompt_ids
        res = plain.generate(ids, ngen)
        frozen.append((q, list(res.output_ids)))
        spans.append(ids + list(res.output_ids))
    return frozen, spans


def bench(model, eos_token_ids: Sequence[int], encoder: Encoder, questions: Sequence[dict], *,
          counts: dict[str, int], ngen: int, methods: Sequence[str] = ALL_METHODS, cfg: MethodConfig | None = None,
          freeze: int | None = None, max_prompt_tokens: int | None = None, extra_methods: Sequence[Method] = (),
          vocab_size: int | None = None, progress: bool = True, rss_interval: float = 0.02,
          warmup: bool = True, ceiling: bool = True, rounds: int = 1) -> dict:
    """Freeze, build workloads, run the methods ``rounds`` times; returns the full results dict (without writing
    anything).

    Args:
        model: the target model (transformers causal LM).
        encoder: tokenizer wrapper (:class:`~redraft.bench.workloads.ChatEncoder` or ``ByteEncoder``).
        questions: Spec-Bench questions.
        counts: workload name -> question count.
        freeze: how many questions to freeze (default: the replay count, else the largest count).
        extra_methods: more :class:`Method` objects run after the named ones (tests inject broken ones here); the
            same objects run in every round.
        ceiling: time the replay ceiling of every question (:class:`redraft.bench.ceiling.CeilingTimer`).
        rounds: how many times every method runs on every question. The corpus is frozen once; each round builds the
            named methods afresh (the policy method learns across the questions of a round and starts over in the
            next, deciding with the cost curve of round 1), and the rounds are merged per question by
            :func:`redraft.bench.rounds.merge_rounds` (median seconds, fastest ceiling).
    Raises:
        ValueError: rounds < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    cfg = cfg or MethodConfig()
    n_freeze = freeze if freeze is not None else counts.get("replay", max(counts.values()))
    t0 = time.perf_counter()
    frozen, spans = freeze_answers(model, eos_token_ids, encoder, replay_questions(questions, n_freeze), ngen,
                                   max_prompt_tokens=max_prompt_tokens, progress=progress)
    corpus = Corpus.from_spans(spans, vocab_size=vocab_size) if spans else None
    t_freeze = time.perf_counter() - t0
    workloads = build_workloads(questions, counts, encoder, frozen, max_prompt_tokens=max_prompt_tokens)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    per_round: list[dict] = []
    curves: dict[str, dict] = {}
    try:
        timer = CeilingTimer(model) if ceiling else None
        for n in range(rounds):
            built, skipped = build_methods(methods, model, eos_token_ids, corpus, cfg)
            ms = built + list(extra_methods)
            if n == 0:  # the cost curve each policy-driven method decides with (measured in round 1, or injected)
                policies = {m.name: m.engine.policy for m in ms
                            if getattr(getattr(m, "engine", None), "policy", None) is not None}
                curves = {name: p.curve.to_dict() for name, p in policies.items()}
                if cfg.curve is None and "policy" in policies:  # later rounds reuse it: no second measurement
                    cfg = replace(cfg, curve=policies["policy"].curve)
            try:
                per_round.append(run_methods(workloads, ms, ngen, progress=progress, rss_interval=rss_interval,
                                             warmup=warmup, ceiling=timer, rotate=n,
                                             desc=f"bench round {n + 1}/{rounds}" if rounds > 1 else "bench"))
            finally:
                for m in built:
                    m.close()
    finally:
        for m in extra_methods:
            m.close()
    runs = merge_rounds(per_round)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None
    exact = {m.name: m.exact_expected for m in ms}
    for w in runs.values():
        w["summary"] = summarize(w["runs"], [m.name for m in ms], exact)
    results = {
        "schema": SCHEMA,
        "command": "",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(load0, load1),
        "model": {},
        "config": {"ngen": ngen, "workloads": counts, "methods": [m.name for m in ms], "k": cfg.k,
                   "minacc": cfg.minacc, "tree_branches": cfg.tree_branches, "tree_budget": cfg.tree_budget,
                   "pld_tokens": cfg.pld_tokens, "max_prompt_tokens": max_prompt_tokens, "rounds": rounds,
                   "interleave": "per question, all methods, start rotated by one each question"
                                 + (f"; {rounds} rounds, seconds the median per question" if rounds > 1 else "")},
        "corpus": {"question_ids": [q["question_id"] for q, _ in frozen], "spans": len(spans),
                   "ids": int(corpus.n_tokens) if corpus is not None else 0, "freeze_seconds": t_freeze},
        "methods": {m.name: {"description": m.description, "exact_expected": m.exact_expected} for m in ms},
        "skipped_methods": skipped,
        "cost_curves": curves,
        "workloads": runs,
        "process": {"peak_rss_mb": max_rss_mb()},
    }
    results["differing"] = differing(results)
    results["rounds_differing"] = rounds_differing(runs)
    return results


def machine_info(load0=None, load1=None) -> dict:
    import numpy
    import torch
    import transformers

    cpus = os.cpu_count()
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": cpus,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "numpy": numpy.__version__,
            "loadavg_start": list(load0) if load0 else None, "loadavg_end": list(load1) if load1 else None}
    load = f", load average {load0[0]:.2f} at start / {load1[0]:.2f} at end" if load0 and load1 else ""
    info["summary"] = (f"{cpus} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
                       f"thread{'s' if torch.get_num_threads() != 1 else ''}), "
                       f"transformers {transformers.__version__}{load}")
    return info


def write_outputs(results: dict, out: Path | None, json_path: str | None) -> list[Path]:
    written = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", results, indent=1)
        write_text(out / "results.md", markdown(results) + "\n")
        written += [out / "results.json", out / "results.md"] + write_plots(results, out)
    if json_path:
        write_json(json_path, results, indent=1)
        written.append(Path(json_path))
    return written
