"""The price of a draft as the decode loop itself pays it: the measured curve corrected by the loop's own step times.

A :class:`~redraft.pricing.curve.CostCurve` times bare forwards. The loop pays more for a draft than that: the
verify forward, the Python that plans, chooses and keeps its rows, and on llama.cpp the one-row step after a wider
forward (its graph is built again: +0.2 steps, decaying over about three steps). Timed in the policy's own loop on
the bundled Q4_1 model with ggml's AMX kernels (2 threads, Xeon with AMX), a step with 4 draft tokens cost 2.59
plain steps with the next step's extra against the curve's 2.17, and the Python between forwards grew from 0.33 ms
after a one-row step to 0.87 ms after a draft; the curve itself moves 15-20% between processes (docs/llama-cpp.md).
A policy pricing drafts on the bare curve then drafts where it loses: on novel text its forwards cost what they
saved. What the loop adds is part fixed per draft step (the graph rebuilt, the draft's own Python: ~0.1 steps
there) and part proportional to the curve's price (+25%: 0.33 steps over the curve at 2 draft tokens, 1.0 at 16).

:class:`LoopPrices` learns both from the loop's steps, so that a draft of n >= 1 tokens costs

    c_loop(n) = 1 + a + s (c(n) - 1)

plain steps of the loop, c_loop(0) = 1. A step lasts from one plan to the next (its draft's planning, its forward,
choosing and keeping its rows); T1 is the median of a draft-free step after a draft-free step, P the median extra of
a draft-free step right after a draft step (what a draft adds to the next step), and each step with n draft tokens
lasting D gives a point (x, y) = (c(n) - 1, (D + P) / T1 - 1). Per draft size the median point counts, weighted by
its steps; a and s are their least-squares line when the sizes span at least ``MIN_SPREAD`` of x, else a = 0 and s
the median ratio y / x; a within ``OFFSET_BOUNDS``, s within ``SCALE_BOUNDS``. The shape of the curve (how cost
grows with n) stays the measured one: the loop sees only the few sizes the policy drafts. Acceptance is learned
online already (:mod:`redraft.policy.acceptance`); this learns the other half of the rule, the price, the same way.

numpy only; the policy owns one (:meth:`redraft.policy.speculation.SpeculationPolicy.observe_step`) and the draft
planner feeds it each step's draft size and seconds (:class:`redraft.decoding.planner.DraftPlanner`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

SCALE_BOUNDS = (1.0, 4.0)  # s stays within these multiples of the curve's draft part: the loop adds to a bare
# forward's time (its Python, the next step's rebuild), so a scale under 1 is noise, and would make probes cheap
OFFSET_BOUNDS = (0.0, 1.0)  # a, plain steps a draft step costs beyond its share of the curve
MIN_PLAIN = 8  # draft-free steps after draft-free steps before T1 is trusted
MIN_SAMPLES = 6  # draft steps before the prices move off the curve
MIN_SPREAD = 0.5  # the draft sizes seen must span this much of c(n) - 1 for a line; else a scale alone
WINDOW = 48  # the most recent steps of each kind kept
MIN_DRAFT_PART = 0.05  # a draft whose curve price c(n) - 1 is below this (a flat curve) gives no sample
QUANTUM = 1 / 32  # a and s are kept in these steps
REFIT_EVERY = 4  # draft steps and steps right after one taken in between two fits (a fit, ~100 us right after a
# decode, on every draft step cost about 1% of the steps of novel text on llama.cpp)
REPRICE = 0.03  # new prices are published when a draft of 1..16 tokens changes price by this share (a new table
# costs the policy its per-table prices again: the chain floor, the probe intervals, ~1 ms right after a decode)


class LoopPrices:
    """What a draft costs in the loop's own steps (module docstring).

    Args:
        table: the curve's cost table, float64 [N + 1] with table[0] = 1 (``CostCurve.table``): c(n) per draft size.
    Attributes:
        scale, offset: s and a of ``c_loop(n) = 1 + a + s (c(n) - 1)``; 1 and 0 (the curve itself) until enough
            steps were seen, then multiples of ``QUANTUM`` within ``SCALE_BOUNDS`` and ``OFFSET_BOUNDS``, fitted
            every ``REFIT_EVERY`` draft steps and steps after one, changed only when a draft of 1..16 tokens changes
            price by ``REPRICE`` or more.
    """

    def __init__(self, table: np.ndarray) -> None:
        self.table = np.asarray(table, dtype=np.float64)
        self.scale, self.offset = 1.0, 0.0
        self._plain: deque[float] = deque(maxlen=WINDOW)  # draft-free steps after draft-free steps, seconds
        self._after: deque[float] = deque(maxlen=WINDOW)  # draft-free steps right after a draft step, seconds
        self._drafts: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (draft tokens, seconds) of draft steps
        self._last_draft = -1  # draft tokens of the previous observed step (-1: none observed, or not told apart)
        self._plains = 0  # plain steps after plain steps seen
        self._t1: float | None = None  # the median of _plain when last taken
        self._unfitted = 0  # draft and after-draft steps taken since the last fit

    def observe(self, draft: int, seconds: float, *, follows: bool = True) -> bool:
        """Take one step of a single sequence into the prices.

        Args:
            draft: draft tokens its forward verified (0 = a plain step), beyond the one pending token.
            seconds: wall seconds from its plan to the next step's plan (> 0).
            follows: False when the step before it was not observed (the first step after a prompt's prefill, or a
                step after a gap): its time is then not told apart from what the step before it left.
        Returns:
            whether the prices (:meth:`prices`) changed.
        """
        draft = int(draft)
        if not seconds > 0 or not math.isfinite(seconds) or draft >= len(self.table):
            self._last_draft = -1
            return False
        prev, self._last_draft = (self._last_draft if follows else -1), draft
        if draft == 0:
            if prev == 0:
                self._plain.append(seconds)  # priced at the next draft: a plain step costs one append
                self._plains += 1
                if self._plains % MIN_PLAIN == 0:  # T1 for the asking budget, read every step: taken every few
                    self._t1 = statistics.median(self._plain)
            elif prev > 0:
                self._after.append(seconds)
                return self._taken()
            return False
        self._drafts.append((draft, seconds))
        return self._taken()

    def _taken(self) -> bool:
        """A draft step or the step after one was taken: fitted at each until ``MIN_SAMPLES`` draft steps were seen
        (the first prices as soon as they can be had), then every ``REFIT_EVERY`` of them."""
        self._unfitted += 1
        if self._unfitted < REFIT_EVERY and len(self._drafts) > MIN_SAMPLES:
            return False
        self._unfitted = 0
        return self._refit()

    @property
    def plain_seconds(self) -> float | None:
        """T1: the median draft-free step after a draft-free step, seconds (None until ``MIN_PLAIN`` were seen),
        taken every ``MIN_PLAIN`` such steps."""
        return self._t1

    def prices(self) -> np.ndarray:
        """float64 [N + 1]: c_loop(n) = 1 + offset + scale (c(n) - 1) for n >= 1, c_loop(0) = 1 (the table the
        policy plans with)."""
        out = 1.0 + self.offset + self.scale * (self.table - 1.0)
        out[0] = 1.0
        return out

    def _refit(self) -> bool:
        if len(self._plain) < MIN_PLAIN:
            return False
        t1 = statistics.median(self._plain)
        extra = max(0.0, statistics.median(self._after) - t1) if self._after else 0.0
        by_size: dict[int, list[float]] = {}
        for n, sec in self._drafts:
            if float(self.table[n]) - 1.0 >= MIN_DRAFT_PART:
                by_size.setdefault(n, []).append((sec + extra) / t1 - 1.0)
        if sum(len(v) for v in by_size.values()) < MIN_SAMPLES:
            return False
        x = np.array([float(self.table[n]) - 1.0 for n in by_size])
        y = np.array([statistics.median(v) for v in by_size.values()])
        w = np.array([len(v) for v in by_size.values()], dtype=np.float64)
        if x.max() - x.min() >= MIN_SPREAD:
            xm, ym = np.average(x, weights=w), np.average(y, weights=w)
            scale = float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2))
            scale = min(SCALE_BOUNDS[1], max(SCALE_BOUNDS[0], scale))
            offset = min(OFFSET_BOUNDS[1], max(OFFSET_BOUNDS[0], ym - scale * xm))
        else:
            scale, offset = float(np.average(y / x, weights=w)), 0.0
            scale = min(SCALE_BOUNDS[1], max(SCALE_BOUNDS[0], scale))
        scale, offset = round(scale / QUANTUM) * QUANTUM, round(offset / QUANTUM) * QUANTUM
        part = self.table[1:17] - 1.0
        old, new = self.offset + self.scale * part, offset + scale * part
        if not np.any(np.abs(new - old) >= REPRICE * (1.0 + old)):
            return False
        self.scale, self.offset = scale, offset
        return True
