#!/usr/bin/env python3
"""Side by side on novel (held-out Spec-Bench) questions: plain greedy vs --draft glide under the policy, with and
without the gate. Usage: PYTHONPATH=$PWD python benchmarks/glide/glide_gate_bench.py DRAFT_DIR [N_QUESTIONS] [NGEN] (ids asserted identical)"""
import sys
import time

import torch

from redraft.compose import SpeculationConfig, build_engine, build_policy, engine_with, glide_drafter, plain_engine
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.io.questions import load_questions
from redraft.runtimes.transformers.target import HFTarget
from redraft.training.data import MEASURE_IDS

torch.set_num_threads(1)
path, nq, ngen = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4, int(sys.argv[3]) if len(sys.argv) > 3 else 64
m = load_model(quiet=True)
qs = load_questions()
prompts = [encode_prompt(m.tokenizer, qs[i]["turns"][0]) for i in MEASURE_IDS[:nq]]
cfg = SpeculationConfig(ngram=False)
def glide_engine(gated):
    t = HFTarget(m.model)
    d = glide_drafter(path, m.model, target=t)
    if gated:  # build_engine wraps a GliDe drafter in the policy's gate
        return build_engine(t, cfg, eos_token_ids=m.eos_token_ids, glide=d)
    return engine_with(t, [d], cfg, eos_token_ids=m.eos_token_ids, policy=build_policy(m.model, max_nodes=cfg.policy_nodes))
engines = {"plain": plain_engine(m.model, eos_token_ids=m.eos_token_ids), "glide+policy": glide_engine(False),
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
