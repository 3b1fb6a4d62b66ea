#!/usr/bin/env python3
"""Side by side on novel (held-out Spec-Bench) questions: plain greedy vs --draft glide under the policy, with and
without the gate. Usage: PYTHONPATH=$PWD python scripts/glide-gate-bench.py DRAFT_DIR [N_QUESTIONS] [NGEN] (ids asserted identical)"""
import sys
import time

import torch

from redraft.decoding.engine import Engine
from redraft.decoding.target import HFTarget
from redraft.drafters.glide import load_glide_drafter
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.io.questions import load_questions
from redraft.policy.apply import policy_for
from redraft.policy.gate import PolicyGate
from redraft.training.data import MEASURE_IDS

torch.set_num_threads(1)
path, nq, ngen = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4, int(sys.argv[3]) if len(sys.argv) > 3 else 64
m = load_model(quiet=True)
qs = load_questions()
prompts = [encode_prompt(m.tokenizer, qs[i]["turns"][0]) for i in MEASURE_IDS[:nq]]
def glide_engine(gated):
    pol = policy_for(m.model)
    t = HFTarget(m.model)
    d = load_glide_drafter(path, m.model, target=t)
    return Engine(t, [PolicyGate(d, pol) if gated else d], eos_token_ids=m.eos_token_ids, policy=pol)
engines = {"plain": Engine(m.model, [], eos_token_ids=m.eos_token_ids), "glide+policy": glide_engine(False),
           "glide+policy+gate": glide_engine(True)}
for e in engines.values():
    e.generate(prompts[0][:8], 2)
tot = {k: [0, 0, 0.0] for k in engines}
ref = {}
for p in prompts:
    for k, e in engines.items():
        t0 = time.perf_counter(); r = e.generate(p, ngen); dt = time.perf_counter() - t0
        tot[k][0] += len(r.output_ids); tot[k][1] += r.forwards; tot[k][2] += dt
        if k == "plain": ref[len(ref)] = r.output_ids
        else: assert r.output_ids == ref[len(ref) - 1], k
base = tot["plain"][0] / tot["plain"][2]
for k, (n, f, s) in tot.items():
    print(f"| {k} | {n} | {f} | {n / s:.2f} | {n / s / base:.3f}x |")
