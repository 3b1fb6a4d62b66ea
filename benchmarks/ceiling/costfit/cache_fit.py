"""As fit.py, and store the curve in redraft's cost-curve cache (what the CLI and bench then read).
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/costfit/cache_fit.py OUT.json"""
import json
import sys
import time

import torch

torch.set_num_threads(1)
from redraft.io.loading import load_model
from redraft.pricing.cache import curve_key, curve_path, default_directory, save_curve
from redraft.pricing.measure import measure_cost_fit
from redraft.runtimes.transformers.target import HFTarget

m = HFTarget(load_model().model)
key = curve_key(m)
t0 = time.time()
fit = measure_cost_fit(m, key["sizes"], prefix=key["prefix"], repeats=key["repeats"])
path = curve_path(key, default_directory())
save_curve(path, key, fit.curve)
d = fit.to_dict(); d["seconds"] = round(time.time() - t0, 1); d["path"] = str(path)
print(json.dumps(d)); json.dump(d, open(sys.argv[1], "w"), indent=1)
