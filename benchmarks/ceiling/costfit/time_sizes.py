"""Raw forward times per size (redraft.pricing.measure.time_forwards), median ratios to the 1-token size.
Usage: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ceiling/costfit/time_sizes.py REPEATS OUT.json"""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
import numpy as np

from redraft.io.loading import load_model
from redraft.pricing.measure import time_forwards
from redraft.runtimes.transformers.target import HFTarget

m = HFTarget(load_model().model)
sizes=[1,2,3,4,5,9,17,33,49,65,129,257,513]
rng=np.random.default_rng(0)
pre=rng.integers(0,49152,128).tolist()
t0=time.time()
s=time_forwards(m, sizes, prefix_ids=pre, repeats=int(sys.argv[1]))["chain"]
print("took", time.time()-t0)
t1=statistics.median(s[1])
for k in sizes:
    print(k-1, round(statistics.median(s[k])/t1,2), [round(x*1000) for x in s[k]])
json.dump({str(k):v for k,v in s.items()}, open(sys.argv[2],"w"))
