#!/usr/bin/env python3
"""One answer's closest near-tie, row by row: plain decoding's row, the verify row, and the draft-free row (the
token before it fed alone on the cache the verify forward wrote), their top-2 gaps and distance from plain's row.

Usage: PYTHONPATH=$PWD python benchmarks/noise/tie_rows.py [QUESTION_ID] [NGEN] [DEPTH]   (defaults 95, 128, 48; float32)
"""
import sys

import torch

from redraft.compose import plain_engine
from redraft.io.loading import load_model
from redraft.io.prompts import encode_prompt
from redraft.io.questions import load_questions
from redraft.runtimes.transformers.target import HFTarget

torch.set_num_threads(1)
qid = int(sys.argv[1]) if len(sys.argv) > 1 else 95
ngen = int(sys.argv[2]) if len(sys.argv) > 2 else 128
depth = int(sys.argv[3]) if len(sys.argv) > 3 else 48
m = load_model(quiet=True)
q = next(q for q in load_questions() if q["question_id"] == qid)
prompt = encode_prompt(m.tokenizer, q["turns"][0])
res = plain_engine(m.model, eos_token_ids=m.eos_token_ids).generate(prompt, ngen, record_margins=True)
out, j = res.output_ids, min(range(len(res.margins)), key=lambda i: res.margins[i])
assert j >= 2, "the closest tie is in the first two tokens: no draft-free row on a drafted cache to compare"
t = HFTarget(m.model)


def show(label, row, plain=None):
    v, i = row.topk(2)
    far = "" if plain is None else f", {((row - plain).abs().max() / plain.abs().max()).item():.2e} x |logit| from plain"
    print(f"{label:<28} top-2 {i.tolist()} gap {(v[0] - v[1]).item():.4e}, max|logit| {row.abs().max().item():.2f}{far}")


t.reset()
rows = [t.forward(prompt, n_logits=1)[0].float()] + [t.forward([out[i]], n_logits=1)[0].float() for i in range(j)]
print(f"q{qid}: {len(out)} tokens, closest top-2 gap at output token {j + 1}")
show("plain", rows[j])
t.reset()
show(f"verify (prompt + {depth} drafts)", t.forward(prompt + out[:depth], n_logits=depth + 1)[j].float(), rows[j])
t.crop(len(prompt) + j - 1)
show("draft-free on that cache", t.forward([out[j - 1]], n_logits=1)[0].float(), rows[j])
