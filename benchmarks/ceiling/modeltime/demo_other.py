"""Model-time analysis of the demo: replay 20 frozen questions (policy learns), then 10 other questions; no plain.
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/modeltime/demo_other.py CURVE.json 20 OUT.json
(needs the demo's corpus, <cache>/demo/corpus.txt, from `redraft demo`)."""
import json
import math
import sys

import torch

torch.set_num_threads(1)
from redraft.bench.modeltime import model_time
from redraft.cli.common import open_corpus_or_exit, questions_or_exit
from redraft.compose import SpeculationConfig, build_engine, build_policy
from redraft.io.loading import cache_dir, load_model
from redraft.io.prompts import encode_prompt
from redraft.pricing import CostCurve

curve_file, nreplay = sys.argv[1], int(sys.argv[2])
d = json.load(open(curve_file))
curve = CostCurve(tuple(d["sizes"]), tuple(d.get("fitted") or d["costs"]))
loaded = load_model()
qs = questions_or_exit(0, 30, "demo")
replay_q, other_q = qs[:20][:nreplay], qs[20:]
cfg = SpeculationConfig(policy=True)
corpus = open_corpus_or_exit(str(cache_dir() / "demo" / "corpus.txt"), loaded)
policy = build_policy(curve=curve, max_nodes=cfg.policy_nodes)
log = []
orig = policy.plan
def plan(parents, sources, priors=None, **kw):
    sel = orig(parents, sources, priors, **kw)
    if True:
        cond = policy.conditionals(parents, sources, priors)
        log.append({"fed": kw.get("fed", 1), "n": len(parents), "keys": sorted(set(sources)), "kept_keys": sorted(set(sources[i] for i in sel.nodes)), "probes": sel.probes, "kept": len(sel.nodes),
                    "prior": [None if (p is None or (isinstance(p, float) and math.isnan(p))) else round(p, 3) for p in (priors or [])[:4]],
                    "cond": [round(float(c), 3) for c in cond[:4]], "E": round(sel.expected_tokens, 2), "cost": round(sel.cost, 2)})
    return sel
policy.plan = plan
def eng():
    return build_engine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, corpus=corpus, policy=policy)
enc = lambda q: encode_prompt(loaded.tokenizer, q["turns"][0], chat=None)
for q in replay_q:
    r = eng().generate(enc(q), 128)
    print("replay", q["question_id"], len(r.output_ids), r.draft_depth_per_forward, file=sys.stderr)
log.clear()
rows = []
for q in other_q:
    ids = enc(q)
    log.clear()
    r = eng().generate(ids, 128)
    mt = model_time(curve, len(ids), len(r.output_ids), r.draft_depth_per_forward, r.accepted_per_forward)
    rows.append({"q": q["question_id"], "P": len(ids), "T": len(r.output_ids), "fwd": len(r.draft_depth_per_forward),
                 "speedup": round(mt.speedup, 3), "losses": mt.losses, "depths": r.draft_depth_per_forward,
                 "acc": r.accepted_per_forward, "first_plan": log[0] if log else None, "plans": list(log)})
    print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("depths", "acc", "plans", "first_plan")}))
json.dump(rows, open(sys.argv[3], "w"))
