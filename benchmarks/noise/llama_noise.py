"""Measure how far llama.cpp's verify rows move from its plain decoding rows (exact mode's noise for the runtime).

    PYTHONPATH=<llama extra> python benchmarks/noise/llama_noise.py [--gguf F] [--questions N] [--ngen T] [--threads N]
        [--gap-depths 4,16,48] [--row-depths 4,16]

For N Spec-Bench first turns it decodes T tokens with plain greedy decoding on the llama.cpp target, then recomputes
every output row as chain verify rows (K always-right drafts per forward) and as draft-free rows on a cache verify
forwards wrote (:func:`redraft.decoding.exactness.measure_gap_noise`), and prints the largest change of the gap
between plain decoding's choice and its 8 closest rivals, relative to the row's largest |logit| and in logits, with
the top-2 gaps plain decoding's rows have (how many rows a threshold would send to settling).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the bundled model's)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--skip", type=int, default=0, help="questions to skip first (a held set)")
    ap.add_argument("--ngen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--gap-depths", default="4,16,48", help="chain depths of the gap-change measurement")
    ap.add_argument("--row-depths", default="4,16", help="chain depths of the row-change measurement")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from redraft.compose import plain_engine
    from redraft.decoding.exactness import measure_gap_noise, measure_settle_noise
    from redraft.io.loading import default_model_path, resolve_model_dir
    from redraft.io.prompts import encode_prompt
    from redraft.io.questions import load_questions
    from redraft.runtimes.llamacpp.target import LlamaCppTarget

    _, model_dir = resolve_model_dir(None, quiet=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = LlamaCppTarget(args.gguf or default_model_path(), n_threads=args.threads)
    engine = plain_engine(target, eos_token_ids=[tok.eos_token_id])
    qs = load_questions()[args.skip:args.skip + args.questions]
    gaps: dict[str, list[torch.Tensor]] = {}
    settle: dict[str, float] = {}
    settle_rel: dict[str, float] = {}
    gap_depths = tuple(int(x) for x in args.gap_depths.split(","))
    row_depths = tuple(int(x) for x in args.row_depths.split(","))
    margins: list[float] = []
    for q in qs:
        ids = encode_prompt(tok, q["turns"][0])
        res = engine.generate(ids, args.ngen, record_margins=True)
        margins += res.margins
        seq = res.prompt_ids + res.output_ids
        if len(res.output_ids) < 3:
            continue
        for kind, rows in measure_gap_noise(target, seq, len(ids), depths=gap_depths).items():
            gaps.setdefault(kind, []).append(rows)
        for kind, (rel, absolute, _) in measure_settle_noise(target, seq, len(ids), depths=row_depths).items():
            settle[kind] = max(settle.get(kind, 0.0), absolute)
            settle_rel[kind] = max(settle_rel.get(kind, 0.0), rel)
    m = torch.tensor(margins)
    out = {"rows": len(margins), "gap_change": {}, "settle_abs": settle, "settle_rel": settle_rel,
           "margin_quantiles": {}}
    print(f"{target.description}, {len(qs)} questions x {args.ngen} tokens, {len(margins)} plain rows")
    for kind, parts in gaps.items():
        rel = torch.cat(parts)
        out["gap_change"][kind] = {"max_rel": rel.max().item(), "p99_rel": rel.quantile(0.99).item()}
        print(f"  gap change {kind:>22}: max {rel.max().item():.3e}  p99 {rel.quantile(0.99).item():.3e} (relative)")
    for kind, v in settle.items():
        print(f"  row change {kind:>22}: max {v:.3f} logits, {settle_rel[kind]:.3e} of the row's largest |logit|")
    for thr in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0):
        share = (m < thr).float().mean().item()
        out["margin_quantiles"][str(thr)] = share
        print(f"  plain rows with top-2 gap < {thr}: {100 * share:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
