"""The policy's novel-text cost on llama.cpp in model time, per ``min_gain`` (no timing: load-independent).

The bench's replay:10 then novel:10 questions (the replay answers frozen first, as ``redraft bench run`` does), run
by one policy per ``min_gain`` on a llama.cpp target: per question the model-time speedup over plain decoding
(:mod:`redraft.bench.modeltime`) with the target's cached cost curve. A speedup under 1 on novel text is time the
policy's chance drafts lost.

Usage (repository root): python benchmarks/ceiling/modeltime/novel_llama.py [--model GGUF] [--threads T]
    [--gains 0,0.1,0.2,0.3] [--ngen 128] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from redraft.bench.harness import freeze_answers
from redraft.bench.modeltime import model_time
from redraft.bench.workloads import ChatEncoder, build_workloads, replay_questions
from redraft.compose import SpeculationConfig, build_engine, build_policy, load_target
from redraft.corpus import Corpus
from redraft.io.questions import load_questions
from redraft.pricing.cache import cached_cost_curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gains", default="0,0.1,0.2,0.3")
    ap.add_argument("--ngen", type=int, default=128)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_target(args.model, runtime="llama.cpp", n_ctx=2048, threads=args.threads, quiet=True)
    target, eos = loaded.model, sorted(loaded.eos_token_ids)
    curve = cached_cost_curve(target)
    enc = ChatEncoder(loaded.tokenizer)
    qs = load_questions()
    frozen, spans = freeze_answers(target, eos, enc, replay_questions(qs, args.n), args.ngen, progress=False)
    corpus = Corpus.from_spans(spans, vocab_size=target.vocab_size)
    workloads = build_workloads(qs, {"replay": args.n, "novel": args.n}, enc, frozen)
    cfg = SpeculationConfig()
    out = {"model": target.description, "threads": args.threads, "curve": curve.to_dict(), "gains": {}}
    for g in [float(x) for x in args.gains.split(",")]:
        policy = build_policy(curve=curve, max_nodes=cfg.policy_nodes, min_gain=g)
        row = {}
        for w in workloads:
            sp = []
            for item in w.items:
                r = build_engine(target, cfg, eos_token_ids=eos, corpus=corpus, policy=policy).generate(
                    list(item.prompt_ids), args.ngen)
                sp.append(model_time(curve, len(r.prompt_ids), len(r.output_ids), r.draft_depth_per_forward,
                                     r.accepted_per_forward).speedup)
            row[w.name] = {"median": round(statistics.median(sp), 4), "min": round(min(sp), 4),
                           "per_question": [round(s, 4) for s in sp]}
        out["gains"][str(g)] = row
        print(f"min_gain {g}: " + ", ".join(f"{k} median {v['median']:.3f} min {v['min']:.3f}" for k, v in row.items()),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
