"""Model time of the 10 novel bench questions after replaying q81, q91, q101 (no plain runs, no timing).
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/modeltime/novel_mt.py CURVE.json old,new[,w0.3]
old = the acceptance prior at a constant weight (min_weight=1.0), wX = min_weight X, new = the defaults."""
import json
import statistics
import sys

import torch

torch.set_num_threads(1)
from redraft.bench.modeltime import model_time
from redraft.cli.common import questions_or_exit
from redraft.compose import SpeculationConfig, build_engine, build_policy, plain_engine
from redraft.corpus import Corpus
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.policy import AcceptanceTracker
from redraft.pricing import CostCurve

d = json.load(open(sys.argv[1]))
curve = CostCurve(tuple(d["sizes"]), tuple(d.get("fitted") or d["costs"]))
novel = [161, 321, 401, 162, 322, 402, 163, 323, 403, 164]
loaded = load_model()
allq = questions_or_exit(0, 480, "x"); byid = {q["question_id"]: q for q in allq}
enc = lambda q: encode_prompt(loaded.tokenizer, q["turns"][0], chat=None)
plain = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)
base = [plain.generate(enc(byid[i]), 128) for i in (81, 91, 101)]
corpus = Corpus.from_spans([r.prompt_ids + r.output_ids for r in base], vocab_size=loaded.model.config.vocab_size)
cfg = SpeculationConfig(policy=True)
out = {}
for variant in sys.argv[2].split(","):
    kw = {"tracker": AcceptanceTracker(cfg.policy_nodes, min_weight=1.0 if variant == "old" else float(variant[1:]))} if variant != "new" else {}
    policy = build_policy(curve=curve, max_nodes=cfg.policy_nodes, **kw)
    eng = lambda policy=policy: build_engine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, corpus=corpus, policy=policy)
    for i in (81, 91, 101):
        r = eng().generate(enc(byid[i]), 128)
        print(variant, "replay", i, r.draft_depth_per_forward, flush=True)
    sp = []
    for i in novel:
        r = eng().generate(enc(byid[i]), 128)
        mt = model_time(curve, len(r.prompt_ids), len(r.output_ids), r.draft_depth_per_forward, r.accepted_per_forward)
        sp.append(mt.speedup)
        print(variant, i, len(r.output_ids), len(r.draft_depth_per_forward), f"{mt.speedup:.3f}", mt.losses[:6], flush=True)
    print(variant, "median", round(statistics.median(sp), 3), "worst", round(min(sp), 3), flush=True)
