"""Freeze questions at NGEN tokens, replay them twice under the policy; draft depths and model time.
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/modeltime/replay.py CURVE.json NGEN 81,91"""
import json
import sys

import torch

torch.set_num_threads(1)
from redraft.bench.modeltime import model_time
from redraft.cli.common import questions_or_exit
from redraft.compose import SpeculationConfig, build_engine, build_policy, plain_engine
from redraft.corpus import Corpus
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.pricing import CostCurve

d = json.load(open(sys.argv[1])); ngen = int(sys.argv[2]); qids = [int(x) for x in sys.argv[3].split(",")]
curve = CostCurve(tuple(d["sizes"]), tuple(d.get("fitted") or d["costs"]))
loaded = load_model()
allq = questions_or_exit(0, 480, "x"); byid = {q["question_id"]: q for q in allq}
enc = lambda q: encode_prompt(loaded.tokenizer, q["turns"][0], chat=None)
plain = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)
base = {i: plain.generate(enc(byid[i]), ngen) for i in qids}
corpus = Corpus.from_spans([r.prompt_ids + r.output_ids for r in base.values()], vocab_size=loaded.model.config.vocab_size)
cfg = SpeculationConfig(policy=True)
policy = build_policy(curve=curve, max_nodes=cfg.policy_nodes)
for rnd in range(2):
    for i in qids:
        r = build_engine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, corpus=corpus, policy=policy).generate(enc(byid[i]), ngen)
        mt = model_time(curve, len(r.prompt_ids), len(r.output_ids), r.draft_depth_per_forward, r.accepted_per_forward)
        print(rnd, i, len(r.output_ids), r.output_ids == base[i].output_ids, r.draft_depth_per_forward, f"model-time {mt.speedup:.2f}x", flush=True)
