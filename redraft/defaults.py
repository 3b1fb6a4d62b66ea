"""Speculation policy constants: the one place every module reads its draft depths and guard settings from, and
the one rule that checks a draft depth (:func:`check_depth`).

The measurements behind the values: docs/measurements.md#redraft-defaults (and docs/benchmarks.md); the cost-aware policy (redraft.policy,
settings at the end) replaces the fixed guard thresholds with the measured cost curve.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Draft depth (tokens along one path). Colibri's COLI_CORPUS_K default and cap.
CORPUS_K_DEFAULT = 8
MAX_DRAFT_DEPTH = 48
# Under the cost-aware policy a draft may go deeper than Colibri's cap wherever the measured cost curve says it pays:
# a replay cannot beat one forward over prompt + answer, and on a CPU a wide forward costs a few plain steps, so
# answers of a few hundred tokens replay in one or two forwards. Fixed depths (--k) keep 1..48.
# Only a corpus match reaching past the policy's suffix length (a replay's: the whole context matches) drafts past
# MAX_DRAFT_DEPTH; a chance match of a few ids stays within it, so novel text weighs no longer candidates than before.
POLICY_MAX_DEPTH = 512

# Corpus acceptance guard (Colibri's COLI_CORPUS_MINACC): pause for CORPUS_PAUSE emitted tokens when acceptance
# over the last window (three drafts' worth of tokens, at least CORPUS_WINDOW) is below CORPUS_MINACC.
CORPUS_MINACC = 0.5
CORPUS_WINDOW = 24
CORPUS_PAUSE = 256

# The n-gram source pays at a much lower acceptance than the corpus guard's 50%: a short verify forward costs
# little more than a single-token forward on a CPU (redraft bench cost), so a few accepted tokens in a draft
# already break even (docs/measurements.md#redraft-defaults).
NGRAM_MINACC = 0.2
NGRAM_PAUSE = 64
# Grammar drafts (tokens a grammar forces): a forced token is almost always accepted, but llguidance spells forced
# text in its own tokenization, which the model may split differently; below GRAMMAR_MINACC over GRAMMAR_WINDOW
# drafted tokens the source pauses for GRAMMAR_PAUSE emitted tokens.
GRAMMAR_MINACC = 0.3
GRAMMAR_WINDOW = 24
GRAMMAR_PAUSE = 64
# Tool-call text conventions `redraft serve --tool-call-parser` knows (redraft/server/toolcalls.py), default first.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

# A GliDe draft pays from a far lower acceptance per draft level than the corpus guard's (docs/glide.md,
# docs/measurements.md#redraft-defaults): its guard is capped just under its break-even.
GLIDE_MINACC = 0.25

# Token trees: most draft nodes in one verify forward.
TREE_BUDGET = 32

# Suffix lengths the lookup drafters try, longest first (Colibri's corpus lookup: 8 down to 3).
SUFFIX_MIN_N = 3
SUFFIX_MAX_N = 8
# Where the corpus matches all SUFFIX_MAX_N ids, the match is extended back up to this many context ids (the whole
# prompt of a typical request): the occurrence whose preceding context matches longest wins, so each templated
# prompt finds its own stored answer (redraft.corpus.corpus.CONTEXT_N, the corpus package's own default).
SUFFIX_CONTEXT_N = 4096

# What one GliDe draft costs before its own time is measured, in plain target steps (the gamma draft-model steps,
# each with a full-vocabulary head; docs/glide.md). Under the policy a draft-model source is asked to draft only
# while its drafts pay for this cost as well as their verify cost (redraft/policy/gate.py).
GLIDE_DRAFT_COST = 0.5

# GliDe draft depth along the greedy spine (the paper's gamma).
GLIDE_GAMMA = 4

# Exact mode (redraft.decoding.exactness): a row computed with drafts (a verify row, or one token on a cache verify forwards
# wrote) differs from plain decoding's row by at most this fraction of the row's largest |logit|, per weight dtype:
# 1.5x the largest measured (`redraft oracle --noise` checks them; docs/measurements.md#redraft-defaults).
EXACT_ROW_NOISE = {"float32": 4e-6, "float16": 7.5e-3, "bfloat16": 6.5e-2,
                   # llama.cpp: a build with llamafile's sgemm (docs/llama-cpp.md), and one whose rows equal plain
                   # decoding's bit for bit (probed at load: redraft.runtimes.llamacpp.target)
                   "llama.cpp": 1.25e-1, "llama.cpp batch-invariant": 0.0}
# A row is trusted when its top-2 gap exceeds SAFETY x the 2 x noise bound that guarantees plain decoding's choice.
# Verify rows: 4; failing it costs one draft-free forward, or a replay of the cache one token per forward where the
# row's gap is under the draft-free rows' threshold too. Draft-free rows on a cache drafting wrote: 2; failing it costs
# that replay.
# Rows that no logits processor reshapes (a repetition penalty, biases, a grammar: see sampling.py) are judged by a
# bound on the change of the gap between plain decoding's choice and its closest rivals instead: SAFETY x this fraction
# of the row's largest |logit| (redraft.decoding.exactness.gap_noise): 1.5x the largest measured (docs/measurements.md#redraft-defaults).
# Dtypes not listed use 2 x EXACT_ROW_NOISE.
EXACT_GAP_NOISE = {"float32": 2.9e-6, "llama.cpp": 5e-2, "llama.cpp batch-invariant": 0.0}
EXACT_SAFETY = 4.0
EXACT_SETTLE_SAFETY = 2.0
# While settling has cost more forwards than the accepted drafts saved (both counted over the generation so far), exact
# mode stops drafting for that many emitted tokens, at most EXACT_PAY_PAUSE (redraft.decoding.exact_mode): in bfloat16
# nearly every row is a near-tie, and the pauses grow with each one.
EXACT_PAY_PAUSE = 128

# Cost-aware speculation policy (redraft.policy). None of these describes a machine: the machine enters only through
# the measured cost curve.
# Draft sizes at which the verify cost curve is measured (every size to 4, where a CPU's curve is least regular,
# then doubling up to the policy's depth cap; linear in between), the cached prefix before each timed forward, and
# timings per size (each against the 1-token forwards around it; median, then the fit of redraft.pricing.fit).
# Measuring takes ~repeats x (sum of c(n) + 13) plain steps (docs/measurements.md#redraft-defaults), once per model, dtype, thread count and
# machine (cached). Five repeats, not three: the median and the
# interquartile range the fit stays within need more than three samples to set aside one taken during another job's
# burst of work. Sizes that do not fit a model's context are left out (the curve extends its last segment).
COST_SIZES = (0, 1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 512)
COST_PREFIX = 128
COST_REPEATS = 5
# Acceptance learned online: prior P(accept) of a new source, its weight in pseudo-outcomes, and the decay per
# outcome (the estimate follows the last ~1 / (1 - decay) = 5 verify forwards).
ACCEPT_PRIOR = 0.5
ACCEPT_PRIOR_WEIGHT = 1.0
ACCEPT_DECAY = 0.8
# The prior forgets like an outcome (its weight decays per outcome) down to this many pseudo-trials: a source that
# always fails is then estimated at ~2% of its prior instead of 15% (redraft.policy.acceptance).
ACCEPT_PRIOR_MIN_WEIGHT = 0.1
# A dropped source's probes may cost this share of a plain step on average; a probe is at most PROBE_MAX tokens.
PROBE_OVERHEAD = 0.03
PROBE_MAX = 4
# A drafter whose last ASK_FRUITLESS proposals were all dropped is asked so seldom that its asking (lookup,
# candidates, plan) costs at most ASK_OVERHEAD of a plain step (redraft.policy.asking).
ASK_OVERHEAD = 0.01
ASK_FRUITLESS = 3
# A draft carried by a streamed request's prompt forward (the prompt's uncached tokens, then the draft) delays the
# first token by every row it adds, so it must be likely right: its first token's estimated chance at least this (a
# replayed prompt's whole-context match is ~1; a chance phrase or the chat template's tail before an answer is not).
PROMPT_DRAFT_CHANCE = 0.9
# Under the policy a lookup's match length is evidence (a replay matches the whole context, a chance phrase a few
# tokens), and the policy learns acceptance per source and power-of-two match length: the corpus tries suffixes up
# to this long (one suffix-array search whatever the length), the n-gram source from 2 tokens like HF prompt lookup.
POLICY_SUFFIX_MAX_N = 64
POLICY_NGRAM_MIN_N = 2

# The GliDe draft shipped inside the package for the default target (absent until one earns its place: docs/glide.md).
SHIPPED_GLIDE_DIR = Path(__file__).resolve().parent / "data" / "glide" / "smollm2-135m-instruct"


class DepthError(ValueError):
    """A draft depth that is not an integer or lies outside its range; the message names the setting and the range."""


def check_depth(name: str | None, value, *, hi: int = MAX_DRAFT_DEPTH, note: str = "", text: bool = False,
                out_of_range: str = "raise") -> int:
    """The one rule for a draft depth (tokens along one draft path): an integer in 1..``hi`` (default 48, Colibri's
    cap). Flags, environment variables, SpeculationConfig fields and the vLLM proposer all check depths here, so the
    same value is judged, and described, the same way everywhere.

    Args:
        name: the setting as the user wrote it (``REDRAFT_CORPUS_K``, ``SpeculationConfig.k``); None where the
            caller names it itself (argparse prefixes ``argument --k:``).
        value: an int, or with ``text`` the text of one (a flag, a variable).
        note: added to the range's description, e.g. ``", at most num_speculative_tokens=8"``.
        out_of_range: "raise"; "warn" = clamp into 1..hi with one warning on stderr (Colibri's rule for a K from
            the environment, which cannot be refused before work starts); "clamp" = clamp silently (a cap).
    Raises:
        DepthError: not an integer, or outside 1..hi with ``out_of_range="raise"``.
    """
    who = f"{name}=" if name else ""
    if text and isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise DepthError(f"{who}{value!r} is not an integer (a draft depth in tokens, 1..{hi}{note})") from None
    if not isinstance(value, int):
        raise DepthError(f"{who}{value!r} is not an integer (a draft depth in tokens, 1..{hi}{note})")
    if 1 <= value <= hi:
        return value
    if out_of_range == "raise":
        raise DepthError(f"{who}{value} is outside 1..{hi} (a draft depth in tokens{note})")
    c = max(1, min(value, hi))
    if out_of_range == "warn":
        print(f"redraft: warning: {who}{value} is outside 1..{hi} (a draft depth in tokens{note}); using {c}",
              file=sys.stderr)
    return c

# Prefix reuse (redraft serve, redraft run --prefix-dir, the Python API's prefix_dir): tokens of KV entries kept in
# memory, and bytes of entries kept on disk in a corpus directory (least recently used removed first).
PREFIX_CACHE_TOKENS = 16_384
PREFIX_DISK_BYTES = 4 << 30
