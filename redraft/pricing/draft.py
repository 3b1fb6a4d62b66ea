"""What a draft costs in plain steps, from a cost table: the formulas the policy and the draft-model gate price with.

A cost table (``costs``, float [n_max + 1]) holds c(n), the verify forward with n draft tokens in plain 1-token
steps (:meth:`~redraft.pricing.curve.CostCurve.table`, or the step's c_B at its load, :mod:`redraft.pricing.load`).
On it:

- a draft behind ``fed`` tokens the forward carries anyway (a prompt's chunk, tokens pending from the last step)
  costs its marginal price, 1 + c(fed - 1 + n) - c(fed - 1) (:func:`marginal_costs`);
- a draft model's proposal adds its own time, ``draft_cost`` plain steps, to every depth (:func:`drafted_costs`);
- a probe is priced at its worst, nothing accepted: c(L) - 1 beyond the plain step, plus any draft cost
  (:func:`probe_cost`);
- a chain's nodes from depth k on cannot pay once the chance of reaching depth k is at most the least price per
  node of going on from k - 1 nodes (:func:`chain_floor`).

:class:`DraftCostMeter` measures ``draft_cost`` as a draft model runs. numpy only.
"""

from __future__ import annotations

import math

import numpy as np

from redraft.pricing.curve import CostCurve


def marginal_costs(curve: CostCurve, fed: int, n_max: int) -> np.ndarray:
    """float64 [n_max + 1]: the cost in plain steps of n = 0..n_max draft tokens in a forward that carries ``fed``
    tokens before them (fed >= 2): 1 + c(fed - 1 + n) - c(fed - 1), the draft's marginal cost over the forward the
    pending tokens need anyway, counted against a plain step's 1. (fed <= 1 is the curve's own table.)"""
    after = curve.at(int(fed) - 1 + np.arange(int(n_max) + 1))
    return 1.0 + after - after[0]


def drafted_costs(costs: np.ndarray, depth: int, draft_cost: float) -> np.ndarray:
    """float64 [depth]: the cost in plain steps of a drafted chain of 1..``depth`` tokens, verify plus the draft
    model's own ``draft_cost`` (plain steps per proposal): c(d) + draft_cost."""
    return costs[1:depth + 1] + draft_cost


def probe_cost(costs: np.ndarray, length: int, draft_cost: float = 0.0) -> float:
    """A probe of ``length`` tokens priced should nothing be accepted: max(0, c(length) - 1) + ``draft_cost`` plain
    steps beyond the plain step it replaces (the worst case: an idle source's estimate never falls below its prior's
    share, so the expected cost would undercount what a useless source's probes cost)."""
    return max(0.0, float(costs[length]) - 1.0) + draft_cost


def chain_floor(costs: np.ndarray) -> np.ndarray:
    """float64 [K + 1] for a cost table of K draft tokens: at depth k = 1..K, the least price per node of verifying
    nodes k..j instead of stopping at k - 1, min over j >= k of (c(j) - c(k - 1)) / (j - k + 1); index 0 is inf.

    Why: along a chain the chance P(j) of reaching node j never grows, so nodes k..j add at most (j - k + 1) P(k)
    expected tokens for c(j) - c(k - 1) more verify time. When P(k) <= floor[k] that is at most one token per
    plain step, and the rate E / c of any deeper cut is a mediant of the rate at k - 1 and at most 1: no depth
    from k on beats both a plain step and the cut at k - 1, so the policy need not look past k - 1. On a flat
    curve (a GPU) the floor is near 0 and nothing is left out; on a steep one (llama.cpp on a CPU, where a row
    costs most of a step) a chance draft's 48-token chain is judged on its first few nodes."""
    c = np.asarray(costs, dtype=np.float64).tolist()
    k_max = len(c) - 1
    floor = [math.inf] * (k_max + 1)
    # floor[k] is the least slope from the point (k - 1, c(k - 1)) to a point (j, c(j)) right of it, attained on
    # the lower convex hull of those points: built right to left (hull[-1] its leftmost vertex, the slopes from a
    # point left of it first fall, then rise along it), so O(K log K) where the K x K table took ~2 ms at K = 512
    hull: list[int] = []
    for k in range(k_max, 0, -1):
        while len(hull) >= 2 and (c[hull[-1]] - c[k]) * (hull[-2] - k) >= (c[hull[-2]] - c[k]) * (hull[-1] - k):
            hull.pop()  # k's edge to the vertex after the leftmost is no steeper: the leftmost is not on the hull
        hull.append(k)
        x0, y0 = k - 1, c[k - 1]
        lo, hi = 0, len(hull) - 1  # positions from the leftmost vertex: hull[-1 - m]
        while lo < hi:  # the first position whose slope is not above the next one's
            m = (lo + hi) // 2
            a, b = hull[-1 - m], hull[-2 - m]
            if (c[a] - y0) * (b - x0) <= (c[b] - y0) * (a - x0):
                hi = m
            else:
                lo = m + 1
        j = hull[-1 - lo]
        floor[k] = (c[j] - y0) / (j - x0)
    return np.array(floor, dtype=np.float64)


class DraftCostMeter:
    """A draft model's cost per proposal in plain steps, measured as it runs: the time of its proposals over the
    time of the rest of a step (from the end of one proposal to the next request, i.e. the verify forward and
    bookkeeping; an upper bound on a plain step while drafts are cut), each smoothed exponentially.

    Args:
        start: the cost until the first measurement (plain steps).
        fixed: keep ``start`` whatever is measured.
        smoothing: weight of the newest timing (0..1].
    Attributes:
        cost: the cost now (plain steps per proposal).
    """

    def __init__(self, start: float, *, fixed: bool = False, smoothing: float = 0.2) -> None:
        self.cost, self.fixed, self.smoothing = float(start), fixed, smoothing
        self._draft_s: float | None = None  # smoothed seconds per proposal
        self._rest_s: float | None = None  # smoothed seconds from the end of a proposal to the next request
        self._ended: float | None = None

    def restart(self) -> None:
        """A new generation: the time before its first request is not a step's rest."""
        self._ended = None

    def asked(self, now: float) -> None:
        """A request arrived at ``now`` (seconds): the time since the last proposal ended is a step's rest."""
        if self._ended is not None:
            self._rest_s = self._smooth(self._rest_s, now - self._ended)
        self._ended = None

    def drafted(self, start: float, end: float) -> None:
        """A proposal ran from ``start`` to ``end`` (seconds)."""
        self._draft_s = self._smooth(self._draft_s, end - start)
        if not self.fixed and self._rest_s:
            self.cost = self._draft_s / self._rest_s
        self._ended = end

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
