"""`redraft bench run` and `redraft bench cost`: redraft side by side with the engines a user would pick instead.

``bench run`` (issue #6):

1. answers the replay questions with plain greedy decoding and freezes prompt + answer into a corpus;
2. builds the workloads (see :mod:`redraft.bench.workloads`) against that corpus;
3. runs every method on every question, interleaved per question (all methods on question 1, then all on
   question 2, ..., the starting method rotated per question) so machine noise hits all methods alike;
4. reports tok/s, speedup over plain greedy (ratio of the medians of per-question tok/s from this same run),
   tokens/forward, acceptance per draft source, forwards, peak RSS and whether the output ids equal plain greedy's.

Everything raw goes to results.json (schema ``redraft-bench/1``); results.md and PNG plots are derived from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from redraft.bench import cost as cost_module
from redraft.bench.methods import (ALL_METHODS, Method, MethodConfig, build_methods, parse_methods)
from redraft.bench.report import BASELINE, differing, markdown, summarize, text_table, write_plots
from redraft.bench.workloads import (WORKLOADS, Encoder, Workload, build_workloads, parse_workloads,
                                     replay_questions)

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

    def __enter__(self) -> "RssSampler":
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
def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where a and b differ (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_methods(workloads: Sequence[Workload], methods: Sequence[Method], ngen: int, *, progress: bool = True,
                rss_interval: float = 0.02, warmup: bool = True) -> dict:
    """Run every method on every item, interleaved per item; returns {workload: {"description", "questions", "runs"}}.

    ``methods[0]`` must be plain greedy (name ``plain``): every other method's output ids are compared with its
    output for the same prompt. Each run dict holds the raw figures (see the module doc of
    :mod:`redraft.bench.report` for how they are summarised).
    """
    from tqdm import tqdm

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
    bar = tqdm(total=len(items) * len(methods), desc="bench", unit="run", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    out: dict[str, dict] = {}
    qn = 0
    for w in workloads:
        runs: list[dict] = []
        for item in w.items:
            r0 = qn % len(methods)
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
            for m in methods:
                rec, pos, peak = got[m.name]
                fd = first_diff(rec.output_ids, ref)
                n = len(rec.output_ids)
                row = {
                    "question_id": item.qid, "category": item.category, "turn": item.turn, "method": m.name,
                    "order": pos, "prompt_tokens": len(item.prompt_ids), "tokens": n, "seconds": rec.seconds,
                    "tok_s": n / rec.seconds if rec.seconds > 0 else 0.0,
                    "forwards": rec.forwards,
                    "tokens_per_forward": n / rec.forwards if rec.forwards else None,
                    "accepted_per_forward": rec.accepted_per_forward,
                    "draft_depth_per_forward": rec.draft_depth_per_forward,
                    "sources": rec.sources, "stop_reason": rec.stop_reason, "rss_peak_mb": peak,
                    "identical": fd is None, "first_diff": fd,
                }
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
    from tqdm import tqdm

    from redraft.bench.workloads import item_for
    from redraft.engine import Engine

    plain = Engine(model, [], eos_token_ids=list(eos_token_ids))
    frozen, spans = [], []
    for q in tqdm(questions, desc="freeze (plain greedy)", unit="q", file=sys.stderr, disable=not progress):
        ids = item_for(q, encoder, max_prompt_tokens).prompt_ids
        res = plain.generate(ids, ngen)
        frozen.append((q, list(res.output_ids)))
        spans.append(ids + list(res.output_ids))
    return frozen, spans


def bench(model, eos_token_ids: Sequence[int], encoder: Encoder, questions: Sequence[dict], *,
          counts: dict[str, int], ngen: int, methods: Sequence[str] = ALL_METHODS, cfg: MethodConfig | None = None,
          freeze: int | None = None, max_prompt_tokens: int | None = None, extra_methods: Sequence[Method] = (),
          vocab_size: int | None = None, progress: bool = True, rss_interval: float = 0.02,
          warmup: bool = True) -> dict:
    """Freeze, build workloads, run the methods; returns the full results dict (without writing anything).

    Args:
        model: the target model (transformers causal LM).
        encoder: tokenizer wrapper (:class:`~redraft.bench.workloads.ChatEncoder` or ``ByteEncoder``).
        questions: Spec-Bench questions.
        counts: workload name -> question count.
        freeze: how many questions to freeze (default: the replay count, else the largest count).
        extra_methods: more :class:`Method` objects run after the named ones (tests inject broken ones here).
    """
    from redraft.corpus import Corpus

    cfg = cfg or MethodConfig()
    n_freeze = freeze if freeze is not None else counts.get("replay", max(counts.values()))
    t0 = time.perf_counter()
    frozen, spans = freeze_answers(model, eos_token_ids, encoder, replay_questions(questions, n_freeze), ngen,
                                   max_prompt_tokens=max_prompt_tokens, progress=progress)
    corpus = Corpus.from_spans(spans, vocab_size=vocab_size) if spans else None
    t_freeze = time.perf_counter() - t0
    workloads = build_workloads(questions, counts, encoder, frozen, max_prompt_tokens=max_prompt_tokens)
    ms, skipped = build_methods(methods, model, eos_token_ids, corpus, cfg)
    ms = ms + list(extra_methods)
    # the cost curve each policy-driven method decides with (measured here, or injected)
    curves = {m.name: m.engine.policy.curve.to_dict() for m in ms
              if getattr(getattr(m, "engine", None), "policy", None) is not None}
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        runs = run_methods(workloads, ms, ngen, progress=progress, rss_interval=rss_interval, warmup=warmup)
    finally:
        for m in ms:
            m.close()
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
                   "pld_tokens": cfg.pld_tokens, "max_prompt_tokens": max_prompt_tokens,
                   "interleave": "per question, all methods, start rotated by one each question"},
        "corpus": {"question_ids": [q["question_id"] for q, _ in frozen], "spans": len(spans),
                   "ids": int(corpus.n_tokens) if corpus is not None else 0, "freeze_seconds": t_freeze},
        "methods": {m.name: {"description": m.description, "exact_expected": m.exact_expected} for m in ms},
        "skipped_methods": skipped,
        "cost_curves": curves,
        "workloads": runs,
        "process": {"peak_rss_mb": max_rss_mb()},
    }
    results["differing"] = differing(results)
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
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results) + "\n")
        written += [out / "results.json", out / "results.md"] + write_plots(results, out)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
        written.append(Path(json_path))
    return written


# ---- CLI ----------------------------------------------------------------------------------------------------------
def _command_line() -> str:
    return "redraft " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "redraft bench"


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def model_name(loaded) -> str:
    """A readable model name: the converted directory's stem for the bundled default."""
    if loaded.name == "default":
        return loaded.path.name.split("-" + loaded.path.name.rsplit("-", 1)[-1])[0] + " (default)"
    return str(loaded.name)


def cmd_bench_run(args) -> int:
    from redraft.cli import _load
    from redraft.demo import spec_bench_questions
    from redraft.bench.workloads import ChatEncoder
    from redraft.models import default_model_path

    try:
        counts = parse_workloads(args.workloads, args.questions)
        methods = parse_methods(args.methods)
    except ValueError as e:
        raise SystemExit(f"redraft bench run: error: {e}")
    gguf = None
    if args.gguf:
        gguf = args.gguf
    elif args.model is None or args.model == "default":
        try:
            gguf = str(default_model_path())
        except Exception:
            gguf = None
    elif str(args.model).endswith(".gguf"):
        gguf = args.model
    cfg = MethodConfig(k=args.k, minacc=args.minacc / 100.0, tree_branches=args.tree_branches,
                       tree_budget=args.tree_budget, pld_tokens=args.pld_tokens, gguf=gguf)
    _threads(args)
    loaded = _load(args)
    encoder = ChatEncoder(loaded.tokenizer, chat=False if args.no_chat else None)
    results = bench(loaded.model, sorted(loaded.eos_token_ids), encoder, spec_bench_questions(), counts=counts,
                    ngen=args.ngen, methods=methods, cfg=cfg, freeze=args.freeze,
                    max_prompt_tokens=args.max_prompt_tokens, vocab_size=loaded.vocab_size,
                    progress=not args.no_progress)
    results["command"] = _command_line()
    results["model"] = {"name": model_name(loaded), "path": str(loaded.path), "gguf": gguf,
                        "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
                        "vocab_size": loaded.vocab_size,
                        "attn": getattr(loaded.model.config, "_attn_implementation", None)}
    for m, why in results["skipped_methods"].items():
        print(f"redraft bench: skipped {m}: {why}", file=sys.stderr)
    print(text_table(results))
    for p in write_outputs(results, Path(args.out) if args.out else None, args.json):
        print(f"wrote {p}", file=sys.stderr)
    bad = [d for d in results["differing"] if not d["expected"]]
    for d in results["differing"]:
        note = " (expected: different runtime)" if d["expected"] else ""
        print(f"redraft bench: WARNING: {d['workload']}/{d['method']} output differs from plain greedy on "
              f"questions {', '.join(map(str, d['mismatches']))}{note}", file=sys.stderr)
    return 1 if bad else 0


def cmd_bench_cost(args) -> int:
    from redraft.bench.cost import cost_curve, cost_markdown
    from redraft.bench.report import plot_cost
    from redraft.cli import _load

    _threads(args)
    loaded = _load(args)
    prefix_ids = None
    if not args.random_prefix:
        # a real ~N-token prompt (Spec-Bench summarization text), so attention sees ordinary content
        from redraft.demo import spec_bench_questions

        q = next(q for q in spec_bench_questions() if q["category"] == "summarization")
        prefix_ids = loaded.tokenizer(q["turns"][0])["input_ids"][:args.prefix]
    cost = cost_curve(loaded.model, max_s=args.max_s, prefix=args.prefix, repeats=args.repeats,
                      tree_mask=args.tree_mask, prefix_ids=prefix_ids, progress=not args.no_progress)
    cost.update({"schema": "redraft-bench-cost/1", "command": _command_line(), "model": model_name(loaded),
                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine_info(os.getloadavg() if hasattr(os, "getloadavg") else None,
                                         os.getloadavg() if hasattr(os, "getloadavg") else None)})
    text = cost_markdown(cost)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cost.json").write_text(json.dumps(cost, indent=1))
        (out / "cost.md").write_text(text + "\n")
        plot_cost(cost, out / "cost_curve.png")
        print(f"wrote {out / 'cost.json'}, {out / 'cost.md'}, {out / 'cost_curve.png'}", file=sys.stderr)
    return 0


RUN_EPILOG = """workloads (--workloads, comma-separated; NAME:N overrides --questions for one workload; 'all'):
  replay     frozen questions (MT-Bench categories, round-robin): their plain answers are in the corpus
  novel      translation / qa / math_reasoning questions: unrelated to the corpus
  near       second turns of frozen questions (frozen answer in the conversation), alternating with other
             questions of the frozen categories
  copy       summarization and RAG prompts (answers reuse the prompt)
  specbench  round-robin sample over all 13 Spec-Bench categories, frozen questions excluded

methods (--methods, comma-separated; default all; plain always runs, it is the reference):
  plain          redraft Engine without drafters (one token per forward)
  hf             Hugging Face model.generate, greedy
  hf-pld         HF prompt lookup decoding, prompt_lookup_num_tokens=10
  ngram          redraft, n-gram drafts from the live context only
  corpus         redraft, frozen-corpus drafts only
  corpus+ngram   redraft, corpus first, n-gram fills the gaps (fixed --k, --minacc guard)
  policy         redraft, corpus first, n-gram fills the gaps, depth chosen per step by the cost-aware policy
                 (cost curve measured here once, cached)
  tree           redraft, corpus top-4 continuations + n-gram merged in one token tree (budget 32)
  llama.cpp      llama-cpp-python greedy on the same GGUF (only when llama_cpp imports)
  llama.cpp-pld  llama-cpp-python with LlamaPromptLookupDecoding(num_pred_tokens=10) (idem)

The corpus is built first from plain greedy answers to the replay questions (--freeze N of them). Methods run
interleaved per question (A B C ... on question 1, then on question 2, start rotated) so machine noise hits all
alike; speedup = median per-question tok/s / median plain tok/s of the same run. Exit status 1 when a method
that should be exact produced ids different from plain greedy (also flagged in the tables and JSON)."""


def add_bench_parsers(bsub) -> None:
    """Register `run` and `cost` on the `redraft bench` subparsers."""
    from redraft.cli import _positive, add_model_args

    p = bsub.add_parser("run", help="workloads x methods benchmark against HF generate / prompt lookup / llama.cpp",
                        description="Benchmark redraft's draft configurations side by side with Hugging Face "
                                    "generate (greedy, prompt lookup) and llama.cpp on Spec-Bench workloads. "
                                    "Prints a table; --out DIR writes results.json (every raw figure), results.md "
                                    "and PNG plots.",
                        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--workloads", default="replay,novel,near,copy",
                   help=f"comma-separated from {', '.join(WORKLOADS)} (NAME:N sets its count; 'all'); "
                        "default replay,novel,near,copy")
    p.add_argument("--questions", type=_positive, default=5, help="questions per workload (default 5)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {', '.join(ALL_METHODS)} (default all)")
    p.add_argument("--freeze", type=_positive, default=None,
                   help="questions frozen into the corpus (default: the replay count)")
    p.add_argument("--k", type=int, default=8, help="draft depth of the redraft methods (default 8)")
    p.add_argument("--minacc", type=float, default=50.0, help="acceptance guard threshold in %% (default 50)")
    p.add_argument("--tree-branches", type=_positive, default=4, help="corpus branches of the tree method (default 4)")
    p.add_argument("--tree-budget", type=_positive, default=32, help="tree method node budget (default 32)")
    p.add_argument("--pld-tokens", type=_positive, default=10,
                   help="prompt lookup tokens for hf-pld and llama.cpp-pld (default 10)")
    p.add_argument("--gguf", default=None, help="GGUF for the llama.cpp methods (default: the default model's)")
    p.add_argument("--max-prompt-tokens", type=_positive, default=None,
                   help="keep only the last N prompt ids (models with a short context)")
    p.add_argument("--out", default=None, metavar="DIR", help="write results.json, results.md and PNG plots here")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results JSON here")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_run)

    p = bsub.add_parser("cost", help="verify cost curve c(S) = time(S tokens) / time(1 token)",
                        description=cost_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: bundled SmolLM2)")
    p.add_argument("--max-s", type=_positive, default=64, help="largest S (default 64)")
    p.add_argument("--prefix", type=_positive, default=200, help="tokens in the KV cache before each forward (default 200)")
    p.add_argument("--repeats", type=_positive, default=5, help="timings per S, median reported (default 5)")
    p.add_argument("--tree-mask", action="store_true",
                   help="also time each S with the explicit 4D tree mask + position ids of tree verification")
    p.add_argument("--random-prefix", action="store_true", help="random prefix ids instead of Spec-Bench text")
    p.add_argument("--out", default=None, metavar="DIR", help="write cost.json, cost.md and cost_curve.png here")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_cost)
