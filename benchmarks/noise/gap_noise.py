#!/usr/bin/env python3
"""How much rows computed with drafts change the top-1 vs rival gaps of plain decoding's rows (exact mode's
gap-noise bound, redraft.decoding.exactness.measure_gap_noise), over Spec-Bench questions.

Usage: PYTHONPATH=$PWD python benchmarks/noise/gap_noise.py [N_QUESTIONS] [NGEN] [DTYPE] [DEPTHS] [PAIRS] [OFFSET]
  (defaults 12, 64, float32, 4,16,48, 8, 0). Questions: every (480 // N)-th Spec-Bench first turn from OFFSET,
  plus question 95. Prints per question and overall, per kind: the largest change / max|logit|, its 99.9th
  percentile, the standard deviation, how many row-rival pairs, and, on the last line, the same as JSON.
"""
import json
import sys

import torch

from redraft.compose import plain_engine
from redraft.decoding.exactness import measure_gap_noise
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.io.questions import load_questions
from redraft.runtimes.transformers.target import HFTarget

torch.set_num_threads(1)
nq = int(sys.argv[1]) if len(sys.argv) > 1 else 12
ngen = int(sys.argv[2]) if len(sys.argv) > 2 else 64
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
depths = [int(k) for k in sys.argv[4].split(",")] if len(sys.argv) > 4 else [4, 16, 48]
pairs = int(sys.argv[5]) if len(sys.argv) > 5 else 8
offset = int(sys.argv[6]) if len(sys.argv) > 6 else 0
m = load_model(dtype=dtype, quiet=True)
qs = load_questions()
picked = [qs[i] for i in range(offset, len(qs), len(qs) // nq)][:nq]
picked += [q for q in qs if q["question_id"] == 95 and q not in picked]
plain = plain_engine(m.model, eos_token_ids=())  # no EOS: every answer is ngen tokens
target = HFTarget(m.model)
every: dict[str, list[torch.Tensor]] = {}


def stats(x: torch.Tensor) -> dict:
    x = x.flatten().double()
    return {"max": x.max().item(), "p999": x.quantile(0.999).item(), "std": x.square().mean().sqrt().item(),
            "pairs": x.numel()}


for q in picked:
    prompt = encode_prompt(m.tokenizer, q["turns"][0])
    out = plain.generate(prompt, ngen).output_ids
    got = measure_gap_noise(target, prompt + out, len(prompt), depths, pairs)
    for kind, x in got.items():
        every.setdefault(kind, []).append(x)
    print(f"q{q['question_id']} ({len(prompt)} prompt ids): "
          + ", ".join(f"{k} {x.max().item():.2e}" for k, x in got.items()), flush=True)
summary = {kind: stats(torch.cat(xs)) for kind, xs in every.items()}
summary["all"] = stats(torch.cat([torch.cat(xs).flatten() for xs in every.values()]))
print(f"{len(picked)} questions x {ngen} tokens, {dtype}, {pairs} rivals per row; |gap change| / max|logit|:")
for kind, s in summary.items():
    print(f"  {kind:<22} max {s['max']:.2e}  p99.9 {s['p999']:.2e}  rms {s['std']:.2e}  "
          f"max/rms {s['max'] / s['std']:.1f}  ({s['pairs']} pairs)")
print(json.dumps({"dtype": dtype, "questions": [q["question_id"] for q in picked], "ngen": ngen, "depths": depths,
                  "pairs": pairs, "summary": summary}))
