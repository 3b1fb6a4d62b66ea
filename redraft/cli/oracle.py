"""``redraft oracle``: measure how often drafting changes the output, and where, per weight dtype.

Rows computed with drafts differ from plain decoding's rows by rounding (a fraction of the largest |logit| that
grows with the dtype's machine epsilon: redraft.decoding.exactness, defaults.EXACT_ROW_NOISE; Measurements: docs/measurements.md#redraft-cli-oracle), so a near-tie
between the top two tokens could flip. The
oracle runs N prompts with plain decoding (recording each token's top-2 gap), freezes those answers so every draft
is right (the hardest case for verification: the deepest rows), and replays them with each draft configuration
(corpus chains at each K, n-gram drafts alone, a token tree), printing identical answers, ``Matching tokens: a/b``,
the first divergent position with the plain top-2 gap there, tokens per forward and exact mode's settling cost.
``--dtypes`` repeats all of it per dtype; ``--noise`` also measures the row differences themselves.
"""

from __future__ import annotations

import argparse

from redraft.cli.common import (
    add_model_args,
    add_sampling_args,
    announce_generation_config,
    check_model_or_exit,
    load_model_or_exit,
    nonneg,
    output_file,
    positive,
    questions_or_exit,
    sampling_from_args,
)
from redraft.compose import SpeculationConfig, build_engine, plain_engine
from redraft.corpus import Corpus
from redraft.decoding.runstats import RunSummary
from redraft.defaults import MAX_DRAFT_DEPTH, TREE_BUDGET
from redraft.io.atomic import write_json
from redraft.io.loading import DTYPES
from redraft.io.progress import Progress
from redraft.io.prompts import encode_prompt


def common_prefix(ref: list[int], got: list[int]) -> int:
    """Length of the common prefix (tokens after a divergence follow a different context and do not count)."""
    n = 0
    for a, b in zip(ref, got, strict=False):  # a prefix: stops at the shorter
        if a != b:
            break
        n += 1
    return n


def draft_depths(text: str) -> list[int]:
    """argparse type: comma-separated draft depths in 1..48, e.g. ``1,2,5,8`` -> sorted unique list."""
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,5,8") from None
    if not ks or ks[0] < 1 or ks[-1] > MAX_DRAFT_DEPTH:
        raise argparse.ArgumentTypeError(f"{text!r}: draft depths must be in 1..{MAX_DRAFT_DEPTH}")
    return ks


def weight_dtypes(text: str) -> list[str]:
    """argparse type: comma-separated weight dtypes from DTYPES, e.g. ``float32,bfloat16`` -> list in that order."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated dtypes from {', '.join(DTYPES)}")
    return names


def run_oracle(args) -> int:
    qs = questions_or_exit(args.offset, args.questions, "oracle")
    if args.tree_budget is not None and not args.tree:
        raise SystemExit("redraft oracle: error: --tree-budget: only used with --tree B > 0")
    if args.compare_exact and not args.exact:
        raise SystemExit("redraft oracle: error: --no-exact: no effect with --compare-exact (which runs both)")
    check_model_or_exit(args.model)
    sampling = sampling_from_args(args)
    report = {"questions": len(qs), "ngen": args.ngen, "dtypes": {}}
    bad = False
    for dtype in args.dtypes or [args.dtype]:
        rep = _run_dtype(args, dtype, qs, sampling)
        report["dtypes"][dtype] = rep
        bad |= any(r["matching"] != r["total"] for r in rep["configs"] if r["exact"])
        bad |= rep.get("noise_over_bound", False)
    if args.json:
        write_json(args.json, report)
    return 1 if bad else 0


def _run_dtype(args, dtype: str, qs: list[dict], sampling) -> dict:
    """The oracle for one weight dtype: plain references, then every draft configuration (and the row noise)."""
    ks = args.k
    loaded = load_model_or_exit(args.model, dtype=dtype)
    announce_generation_config(loaded, args)
    use_gc = not args.no_generation_config
    prompts = [encode_prompt(loaded.tokenizer, q["turns"][0], chat=False if args.no_chat else None) for q in qs]
    plain = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids, generation_config=use_gc)
    refs = [plain.generate(p, args.ngen, sampling=sampling, record_margins=True)
            for p in Progress(prompts, desc=f"{dtype} plain", unit="q", noun="question")]
    corpus = Corpus.from_spans([r.prompt_ids + r.output_ids for r in refs], vocab_size=loaded.vocab_size)

    configs = [(f"chain K={k}", dict(k=k, tree=0, corpus=True)) for k in ks]
    configs.append((f"n-gram only K={max(ks)}", dict(k=max(ks), tree=0, corpus=False)))
    budget = args.tree_budget or TREE_BUDGET
    if args.tree:
        configs.append((f"tree B={args.tree} K={max(ks)} budget={budget}",
                        dict(k=max(ks), tree=args.tree, corpus=True)))
    exact_modes = [True, False] if args.compare_exact else [args.exact]
    plain_run = RunSummary.of(refs)
    report = {"dtype": dtype, "plain_tokens": plain_run.tokens, "plain_seconds": plain_run.seconds, "configs": []}
    total_plain = report["plain_tokens"]
    for name, cfg in configs:
        for exact in exact_modes:
            # fixed depth K, no policy; a chain is never cut by the tree budget: K alone sets its depth
            spec = SpeculationConfig(k=cfg["k"], policy=False, tree=cfg["tree"],
                                     tree_budget=budget if cfg["tree"] else None, exact=exact,
                                     generation_config=use_gc)
            engine = build_engine(loaded.model, spec, eos_token_ids=loaded.eos_token_ids,
                                  corpus=corpus if cfg["corpus"] else None)
            match, identical, first, run, ties, settle = 0, 0, None, RunSummary(), 0, 0
            for q, p, ref in Progress(list(zip(qs, prompts, refs, strict=True)),
                                      desc=f"{dtype} {name} exact={exact}", unit="q", noun="question"):
                res = engine.generate(p, args.ngen, sampling=sampling)
                m = common_prefix(ref.output_ids, res.output_ids)
                same = m == len(ref.output_ids) == len(res.output_ids)
                match += m if not same else len(ref.output_ids)
                identical += same
                run.add(res)
                ties, settle = ties + res.near_ties, settle + res.settle_forwards
                if not same and first is None:
                    gap = ref.margins[m] if m < len(ref.margins) else float("nan")
                    first = {"question_id": q["question_id"], "position": m, "plain_top2_gap": gap}
            row = {"config": name, "exact": exact, "identical": identical, "questions": len(qs), "matching": match,
                   "total": total_plain, "first_divergence": first, "forwards": run.forwards,
                   "tokens_per_forward": run.tokens_per_forward, "near_ties": ties, "settle_forwards": settle,
                   "tok_s": run.tokens_per_second}
            report["configs"].append(row)
            where = ("none" if first is None else
                     f"question {first['question_id']} token {first['position']} "
                     f"(plain top-2 gap {first['plain_top2_gap']:.2e})")
            print(f"{dtype:<8} {name:<28} exact={'on ' if exact else 'off'} identical {identical}/{len(qs)}  "
                  f"Matching tokens: {match}/{total_plain}  first divergence: {where}  "
                  f"{row['tokens_per_forward']:.2f} tok/fwd ({run.forwards} forwards, {settle} settling {ties} near-ties)  "
                  f"{row['tok_s']:.1f} tok/s", flush=True)
    gaps = sorted(g for r in refs for g in r.margins)
    report["smallest_plain_gaps"] = gaps[:5]
    report["plain_exact_ties"] = sum(g == 0 for g in gaps)
    print(f"{dtype:<8} plain: {total_plain} tokens, {report['plain_exact_ties']} exact ties, smallest top-2 gaps "
          f"{', '.join(f'{g:.2e}' for g in gaps[:3])}")
    if args.noise:
        report.update(_noise(loaded, refs, dtype))
    return report


def _noise(loaded, refs, dtype: str) -> dict:
    """Row noise measured on each reference answer against the bound exact mode assumes for this dtype."""
    from redraft.decoding.exactness import measure_row_noise, row_noise
    from redraft.runtimes.transformers.target import HFTarget

    target, worst = HFTarget(loaded.model), {}
    for r in Progress(refs, desc=f"{dtype} row noise", unit="q", noun="question"):
        if len(r.output_ids) < 2:
            continue
        for kind, (rel, _) in measure_row_noise(target, r.prompt_ids + r.output_ids, len(r.prompt_ids)).items():
            worst[kind] = max(worst.get(kind, 0.0), rel)
    bound = row_noise(target.dtype)
    over = max(worst.values(), default=0.0) > bound
    print(f"{dtype:<8} row noise, max |row - plain row| / max|logit|: "
          f"{', '.join(f'{k} {v:.2e}' for k, v in worst.items())}; exact mode assumes <= {bound:.1e}"
          + ("  WARNING: over the bound, exact mode is not guaranteed" if over else ""), flush=True)
    return {"row_noise": worst, "row_noise_bound": bound, "noise_over_bound": over}


def register(sub) -> None:
    """Add ``oracle`` to the top-level sub-parsers."""
    p = sub.add_parser("oracle", help="measure output divergence between plain and drafted decoding",
                       description="Run Spec-Bench questions plain, freeze the answers, replay them with chain drafts "
                                   "at each K (and tree drafts), and print 'Matching tokens: a/b' per configuration "
                                   "with the first divergent position and the plain top-2 logit gap there. Exit 1 "
                                   "if an exact-mode configuration diverged.")
    add_model_args(p, runtime=False)
    add_sampling_args(p)
    p.add_argument("--questions", type=positive, default=80, help="questions (default 80)")
    p.add_argument("--offset", type=nonneg, default=0, help="first question index (default 0)")
    p.add_argument("--k", type=draft_depths, default=[1, 2, 5, 8, 16, 32],
                   help="comma-separated draft depths in 1..48 (default 1,2,5,8,16,32)")
    p.add_argument("--tree", type=nonneg, default=4, metavar="B",
                   help="also tree drafts with B corpus branches (default 4; 0 = no)")
    p.add_argument("--tree-budget", type=positive, default=None,
                   help=f"tree node budget of the --tree configuration (default {TREE_BUDGET})")
    p.add_argument("--no-exact", dest="exact", action="store_false", help="run without exact mode")
    p.add_argument("--compare-exact", action="store_true", help="run every configuration with and without exact mode")
    p.add_argument("--dtypes", type=weight_dtypes, default=None, metavar="LIST",
                   help=f"run the whole oracle once per weight dtype, e.g. {','.join(DTYPES)} (default: --dtype)")
    p.add_argument("--noise", action="store_true",
                   help="also measure how far rows computed with drafts are from plain decoding's rows, against the "
                        "bound exact mode assumes (exit 1 if over it)")
    p.add_argument("--json", default=None, metavar="PATH", type=output_file, help="write every figure as JSON")
    p.set_defaults(func=run_oracle)
