#!/usr/bin/env python3
"""Draft-free rows on a drafted cache vs verify rows: how far each is from plain decoding's bit-exact row.

Usage: PYTHONPATH=$PWD python benchmarks/noise/settle_noise.py [N_QUESTIONS] [NGEN] [DTYPE] [DEPTHS]
  (defaults 12, 64, float32, 4,16,48). Questions: every (480 // N)-th Spec-Bench first turn, plus question 95.
Prints, per kind, the largest max |row - plain row| / max|logit| over all questions, in JSON on the last line.
"""
import json
import sys

import torch

from redraft.compose import plain_engine
from redraft.decoding.exactness import measure_settle_noise
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.io.questions import load_questions
from redraft.runtimes.transformers.target import HFTarget

torch.set_num_threads(1)
nq = int(sys.argv[1]) if len(sys.argv) > 1 else 12
ngen = int(sys.argv[2]) if len(sys.argv) > 2 else 64
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
depths = [int(k) for k in sys.argv[4].split(",")] if len(sys.argv) > 4 else [4, 16, 48]
m = load_model(dtype=dtype, quiet=True)
qs = load_questions()
picked = [qs[i] for i in range(0, len(qs), len(qs) // nq)][:nq] + [q for q in qs if q["question_id"] == 95]
plain = plain_engine(m.model, eos_token_ids=())  # no EOS: every answer is ngen tokens
target = HFTarget(m.model)
worst: dict[str, list] = {}
for q in picked:
    prompt = encode_prompt(m.tokenizer, q["turns"][0])
    out = plain.generate(prompt, ngen).output_ids
    got = measure_settle_noise(target, prompt + out, len(prompt), depths)
    for kind, (rel, ab, n) in got.items():
        w = worst.setdefault(kind, [0.0, 0.0, 0])
        w[0], w[1], w[2] = max(w[0], rel), max(w[1], ab), w[2] + n
    print(f"q{q['question_id']} ({len(prompt)} prompt ids): "
          + ", ".join(f"{k} {v[0]:.2e}" for k, v in got.items()), flush=True)
print(f"{len(picked)} questions x {ngen} tokens, {dtype}; max relative (absolute, rows):")
for kind, (rel, ab, n) in worst.items():
    print(f"  {kind:<18} {rel:.2e} ({ab:.2e} logits, {n} rows)")
print(json.dumps({"dtype": dtype, "questions": [q["question_id"] for q in picked], "ngen": ngen, "worst": worst}))
