"""The price of a draft as the decode loop itself pays it: the measured curve rescaled by the loop's own step times.

A :class:`~redraft.pricing.curve.CostCurve` times bare forwards. The loop pays more for a draft than that: the
verify forward, the Python that plans, chooses and keeps its rows, and on llama.cpp the one-row step after a wider
forward (its graph is built again: +0.2 steps, decaying over about three steps). Timed in the policy's own loop on
the bundled Q4_1 model with ggml's AMX kernels (2 threads, Xeon with AMX), a forward of 1 + 4 rows cost 2.59 steps
with the next step's extra against the curve's 2.17, and the Python between forwards grew from 0.33 ms after a
one-row step to 0.87 ms after a draft; the curve itself moves 15-20% between processes (docs/llama-cpp.md). A
policy pricing drafts on the bare curve then drafts where it loses: on novel text its forwards cost what they saved.

:class:`LoopPrices` learns one number from the loop's steps, the scale a of the curve's draft part, so that a
draft of n tokens costs

    c_loop(n) = 1 + a (c(n) - 1)

plain steps of the loop, c_loop(0) = 1. A step lasts from one plan to the next (its draft's planning, its forward,
choosing and keeping its rows); T1 is the median step of a draft-free step after a draft-free step, P the median
extra of a draft-free step right after a wider one (what a draft adds to the next step), and each step with n
draft tokens gives a sample a = ((D + P) / T1 - 1) / (c(n) - 1). a is the median of the last samples, within
``SCALE_BOUNDS``. The shape of the curve (how cost grows with n) stays the measured one: the loop sees only the
few sizes the policy drafts, too few to fit a curve from. Acceptance is learned online already
(:mod:`redraft.policy.acceptance`); this learns the other half of the rule, the price, the same way.

numpy only; the policy owns one (:meth:`redraft.policy.speculation.SpeculationPolicy.observe_step`) and the draft
planner feeds it each step's rows and seconds (:class:`redraft.decoding.planner.DraftPlanner`).
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

SCALE_BOUNDS = (0.5, 4.0)  # the learned scale stays within these multiples of the curve's draft part
MIN_PLAIN = 8  # draft-free steps after draft-free steps before T1 is trusted
MIN_SAMPLES = 6  # draft steps before the scale moves off 1
WINDOW = 48  # the most recent steps of each kind kept
MIN_DRAFT_PART = 0.05  # a draft whose curve price c(n) - 1 is below this (a flat curve) gives no sample
QUANTUM = 1 / 16  # the scale is published in these steps, so the policy's per-table prices are reused


class LoopPrices:
    """The scale of the curve's draft part that the loop's own step times say (module docstring).

    Args:
        table: the curve's cost table, float64 [N + 1] with table[0] = 1 (``CostCurve.table``): c(n) per draft size.
    Attributes:
        scale: a, the multiple of the draft part to price with now (1.0 until enough steps were seen), a multiple
            of ``QUANTUM`` within ``SCALE_BOUNDS``.
    """

    def __init__(self, table: np.ndarray) -> None:
        self.table = np.asarray(table, dtype=np.float64)
        self.scale = 1.0
        self._plain: deque[float] = deque(maxlen=WINDOW)  # draft-free steps after draft-free steps, seconds
        self._after: deque[float] = deque(maxlen=WINDOW)  # draft-free steps right after a draft step, seconds
        self._drafts: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (draft tokens, seconds) of draft steps
        self._last_draft = -1  # draft tokens of the previous observed step (-1: none observed, or not told apart)

    def observe(self, draft: int, seconds: float, *, follows: bool = True) -> bool:
        """Take one step of a single sequence into the prices.

        Args:
            draft: draft tokens its forward verified (0 = a plain step), beyond the one pending token.
            seconds: wall seconds from its plan to the next step's plan (> 0).
            follows: False when the step before it was not observed (the first step after a prompt's prefill, or a
                step after a gap): its time is then not told apart from what the step before it left.
        Returns:
            whether :attr:`scale` changed.
        """
        draft = int(draft)
        if seconds <= 0 or not np.isfinite(seconds) or draft >= len(self.table):
            self._last_draft = -1
            return False
        prev, self._last_draft = (self._last_draft if follows else -1), draft
        if draft == 0:
            if prev == 0:
                self._plain.append(seconds)  # priced at the next draft: a plain step costs one append
            elif prev > 0:
                self._after.append(seconds)
                return self._refit()
            return False
        self._drafts.append((draft, seconds))
        return self._refit()

    def prices(self) -> np.ndarray:
        """float64 [N + 1]: c_loop(n) = 1 + scale (c(n) - 1) for n = 0..N (the table the policy plans with)."""
        return 1.0 + self.scale * (self.table - 1.0)

    def _refit(self) -> bool:
        if len(self._plain) < MIN_PLAIN:
            return False
        t1 = statistics.median(self._plain)
        extra = max(0.0, statistics.median(self._after) - t1) if self._after else 0.0
        samples = [((s + extra) / t1 - 1.0) / part for n, s in self._drafts
                   if (part := float(self.table[n]) - 1.0) >= MIN_DRAFT_PART]
        if len(samples) < MIN_SAMPLES:
            return False
        lo, hi = SCALE_BOUNDS
        scale = round(min(hi, max(lo, statistics.median(samples))) / QUANTUM) * QUANTUM
        changed, self.scale = scale != self.scale, scale
        return changed
