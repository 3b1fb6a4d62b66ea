"""The default cost curve measurement with its fit statistics (medians, quartiles, fitted).
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/costfit/fit.py OUT.json"""
import json
import sys
import time

import torch

torch.set_num_threads(1)
from redraft.io.loading import load_model
from redraft.pricing.measure import measure_cost_fit
from redraft.runtimes.transformers.target import HFTarget

m = HFTarget(load_model().model)
t0=time.time()
fit = measure_cost_fit(m)
d = fit.to_dict(); d["seconds"] = time.time()-t0
print(json.dumps(d))
json.dump(d, open(sys.argv[1],"w"))
