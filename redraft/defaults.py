"""Speculation policy constants: the one place every module reads its draft depths and guard settings from.

Figures are from measurements on the 2-core development CPU (see docs/benchmarks.md); the cost-aware policy
(redraft.policy, settings at the end) replaces the fixed guard thresholds with the measured cost curve.
"""

from __future__ import annotations

from pathlib import Path

# Draft depth (tokens along one path). Colibri's COLI_CORPUS_K default and cap.
CORPUS_K_DEFAULT = 8
MAX_DRAFT_DEPTH = 48
# `redraft serve` drafts adaptively up to this depth: its learned corpus is mostly replays, where deep drafts pay
SERVE_CORPUS_K_MAX = 32

# Corpus acceptance guard (Colibri's COLI_CORPUS_MINACC): pause for CORPUS_PAUSE emitted tokens when acceptance
# over the last window (three drafts' worth of tokens, at least CORPUS_WINDOW) is below CORPUS_MINACC.
CORPUS_MINACC = 0.5
CORPUS_WINDOW = 24
CORPUS_PAUSE = 256

# The n-gram source pays at a much lower acceptance than the corpus guard's 50%: a 9-token verify forward costs
# ~1.5 single-token forwards on this CPU (redraft bench cost), so one accepted token in eight already breaks even.
# Measured on 7 novel + copy questions (ngen 96, side by side): 20% / 64 tokens gave 1.17 tokens/forward and
# 1.04x against 1.10 and 1.03x with 50% / 256, identical outputs.
NGRAM_MINACC = 0.2
NGRAM_PAUSE = 64

# A GliDe draft pays from ~26% acceptance per draft level here (docs/glide.md): its guard is capped at 25%.
GLIDE_MINACC = 0.25

# Token trees: most draft nodes in one verify forward.
TREE_BUDGET = 32

# Suffix lengths the lookup drafters try, longest first (Colibri's corpus lookup: 8 down to 3).
SUFFIX_MIN_N = 3
SUFFIX_MAX_N = 8

# What one GliDe draft costs before its own time is measured, in plain target steps (the gamma draft-model steps,
# each with a full-vocabulary head: ~20-45 ms against a ~65 ms plain step on the 2-core CPU, docs/glide.md). Under
# the policy a draft-model source is asked to draft only while its drafts pay for this cost as well as their verify
# cost (redraft/policy/gate.py).
GLIDE_DRAFT_COST = 0.5

# GliDe draft depth along the greedy spine (the paper's gamma).
GLIDE_GAMMA = 4

# Exact mode (redraft.decoding.exactness): a row computed with drafts (a verify row, or one token on a cache verify forwards
# wrote) differs from plain decoding's row by at most this fraction of the row's largest |logit|, per weight dtype.
# Measured on the default model (8 Spec-Bench questions x 32 tokens, prompts of 40-779 tokens; chains K=1..16,
# trees, single tokens after drafts): largest 2.5e-6, 5.1e-3 and 4.4e-2 (about 20, 5 and 6 machine epsilons); the
# bounds are 1.5x that (`redraft oracle --noise` checks them; docs/benchmarks.md, "Exact mode per dtype").
EXACT_ROW_NOISE = {"float32": 4e-6, "float16": 7.5e-3, "bfloat16": 6.5e-2}
# A row is trusted when its top-2 gap exceeds SAFETY x the 2 x noise bound that guarantees plain decoding's choice.
# Verify rows: 4 (float32: 1e-3 at |logit| 31, as before); failing it costs one draft-free forward. Draft-free rows on
# a cache drafting wrote: 2; failing it costs a replay of the cache one token per forward.
EXACT_SAFETY = 4.0
EXACT_SETTLE_SAFETY = 2.0
# When settling costs more forwards than the accepted drafts save (judged after EXACT_PAY_WINDOW of either), exact
# mode stops drafting for EXACT_PAY_PAUSE tokens: in bfloat16 nearly every row is a near-tie.
EXACT_PAY_WINDOW = 4
EXACT_PAY_PAUSE = 128

# Cost-aware speculation policy (redraft.policy). None of these describes a machine: the machine enters only through
# the measured cost curve.
# Draft sizes at which the verify cost curve is measured (every size to 4, where a CPU's curve is least regular,
# then doubling up to the depth cap; linear in between), the cached prefix before each timed forward, and timings
# per size (median). Measuring takes ~repeats x sum of c(n) plain steps: ~2-3 s on the 2-core development CPU, once
# per model, dtype, thread count and machine (cached).
COST_SIZES = (0, 1, 2, 3, 4, 8, 16, 32, 48)
COST_PREFIX = 128
COST_REPEATS = 3
# Acceptance learned online: prior P(accept) of a new source, its weight in pseudo-outcomes, and the decay per
# outcome (the estimate follows the last ~1 / (1 - decay) = 5 verify forwards).
ACCEPT_PRIOR = 0.5
ACCEPT_PRIOR_WEIGHT = 1.0
ACCEPT_DECAY = 0.8
# A dropped source's probes may cost this share of a plain step on average; a probe is at most PROBE_MAX tokens.
PROBE_OVERHEAD = 0.03
PROBE_MAX = 4
# Under the policy a lookup's match length is evidence (a replay matches the whole context, a chance phrase a few
# tokens), and the policy learns acceptance per source and power-of-two match length: the corpus tries suffixes up
# to this long (one suffix-array search whatever the length), the n-gram source from 2 tokens like HF prompt lookup.
POLICY_SUFFIX_MAX_N = 64
POLICY_NGRAM_MIN_N = 2

# The GliDe draft shipped inside the package for the default target (absent until one earns its place: docs/glide.md).
SHIPPED_GLIDE_DIR = Path(__file__).resolve().parent / "data" / "glide" / "smollm2-135m-instruct"
