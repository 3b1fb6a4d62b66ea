"""``redraft oracle``: measure how often drafting changes the output, and where.

Verify rows and single-token forwards differ by ~1e-4 in their logits (different matrix shapes round
differently), so a near-tie between the top two tokens could flip. The oracle runs N prompts with plain decoding
(recording each token's top-2 gap), freezes those answers so every draft is right (the hardest case for
verification: the deepest rows), and replays them with each draft configuration, printing
``Matching tokens: a/b`` plus the first divergent position and the plain top-2 gap there.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from redraft.atomic import write_json
from redraft.cli.common import (add_model_args, add_sampling_args, announce_generation_config, check_model_or_exit,
                                load_model_or_exit, nonneg, output_file, positive, questions_or_exit,
                                sampling_from_args)
from redraft.corpus import Corpus
from redraft.defaults import MAX_DRAFT_DEPTH, TREE_BUDGET
from redraft.drafters import build_drafters
from redraft.prompts import encode_prompt
from redraft.runstats import RunSummary


def common_prefix(ref: list[int], got: list[int]) -> int:
    """Length of the common prefix (tokens after a divergence follow a different context and do not count)."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n


def draft_depths(text: str) -> list[int]:
    """argparse type: comma-separated draft depths in 1..48, e.g. ``1,2,5,8`` -> sorted unique list."""
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,5,8")
    if not ks or ks[0] < 1 or ks[-1] > MAX_DRAFT_DEPTH:
        raise argparse.ArgumentTypeError(f"{text!r}: draft depths must be in 1..{MAX_DRAFT_DEPTH}")
    return ks


def run_oracle(args) -> int:
    qs = questions_or_exit(args.offset, args.questions, "oracle")
    ks = args.k
    if args.tree_budget is not None and not args.tree:
        raise SystemExit("redraft oracle: error: --tree-budget: only used with --tree B > 0")
    if args.compare_exact and not args.exact:
        raise SystemExit("redraft oracle: error: --no-exact: no effect with --compare-exact (which runs both)")
    check_model_or_exit(args.model)

    from redraft.engine import Engine  # torch-bound: imported once the arguments are checked

    sampling = sampling_from_args(args)
    loaded = load_model_or_exit(args.model)
    announce_generation_config(loaded, args)
    use_gc = not args.no_generation_config
    prompts = [encode_prompt(loaded.tokenizer, q["turns"][0], chat=False if args.no_chat else None) for q in qs]
    plain = Engine(loaded.model, [], eos_token_ids=loaded.eos_token_ids, generation_config=use_gc)
    refs = [plain.generate(p, args.ngen, sampling=sampling, record_margins=True)
            for p in tqdm(prompts, desc="plain", unit="q", file=sys.stderr)]
    corpus = Corpus.from_spans([r.prompt_ids + r.output_ids for r in refs], vocab_size=loaded.vocab_size)

    configs = [(f"chain K={k}", dict(k=k, tree=0)) for k in ks]
    budget = args.tree_budget or TREE_BUDGET
    if args.tree:
        configs.append((f"tree B={args.tree} K={max(ks)} budget={budget}", dict(k=max(ks), tree=args.tree)))
    exact_modes = [True, False] if args.compare_exact else [args.exact]
    plain_run = RunSummary.of(refs)
    report = {"questions": len(qs), "ngen": args.ngen, "plain_tokens": plain_run.tokens,
              "plain_seconds": plain_run.seconds, "configs": []}
    total_plain = report["plain_tokens"]
    for name, cfg in configs:
        for exact in exact_modes:
            engine = Engine(loaded.model,
                            build_drafters(corpus, k=cfg["k"], ngram=True, tree_branches=cfg["tree"]),
                            eos_token_ids=loaded.eos_token_ids, max_depth=cfg["k"], merge=cfg["tree"] > 0,
                            # a chain is never cut by the tree budget: K alone sets its depth
                            tree_budget=budget if cfg["tree"] else max(budget, cfg["k"]), exact=exact,
                            generation_config=use_gc)
            match, first, run = 0, None, RunSummary()
            for q, p, ref in tqdm(list(zip(qs, prompts, refs)), desc=f"{name} exact={exact}", unit="q",
                                  file=sys.stderr):
                res = engine.generate(p, args.ngen, sampling=sampling)
                m = common_prefix(ref.output_ids, res.output_ids)
                same = m == len(ref.output_ids) == len(res.output_ids)
                match += m if not same else len(ref.output_ids)
                run.add(res)
                if not same and first is None:
                    gap = ref.margins[m] if m < len(ref.margins) else float("nan")
                    first = {"question_id": q["question_id"], "position": m, "plain_top2_gap": gap}
            row = {"config": name, "exact": exact, "matching": match, "total": total_plain,
                   "first_divergence": first, "tokens_per_forward": run.tokens_per_forward,
                   "tok_s": run.tokens_per_second}
            report["configs"].append(row)
            where = ("none" if first is None else
                     f"question {first['question_id']} token {first['position']} "
                     f"(plain top-2 gap {first['plain_top2_gap']:.2e})")
            print(f"{name:<28} exact={'on ' if exact else 'off'} Matching tokens: {match}/{total_plain}  "
                  f"first divergence: {where}  {row['tokens_per_forward']:.2f} tok/fwd  {row['tok_s']:.1f} tok/s",
                  flush=True)
    gaps = sorted(g for r in refs for g in r.margins)
    report["smallest_plain_gaps"] = gaps[:5]
    print(f"plain: {total_plain} tokens, smallest top-2 gaps {', '.join(f'{g:.2e}' for g in gaps[:3])}")
    if args.json:
        write_json(args.json, report)
    diverged = any(r["matching"] != r["total"] for r in report["configs"] if r["exact"])
    return 1 if diverged else 0


def register(sub) -> None:
    """Add ``oracle`` to the top-level sub-parsers."""
    p = sub.add_parser("oracle", help="measure output divergence between plain and drafted decoding",
                       description="Run Spec-Bench questions plain, freeze the answers, replay them with chain drafts "
                                   "at each K (and tree drafts), and print 'Matching tokens: a/b' per configuration "
                                   "with the first divergent position and the plain top-2 logit gap there. Exit 1 "
                                   "if an exact-mode configuration diverged.")
    add_model_args(p)
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
    p.add_argument("--json", default=None, metavar="PATH", type=output_file, help="write every figure as JSON")
    p.set_defaults(func=run_oracle)
