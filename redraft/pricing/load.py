"""The cost of a draft in a step that other requests share: the policy's rule under batch load.

A batched runtime (vLLM's continuous batching, a server batching its requests) runs one forward over every
scheduled request's rows: each request's current token plus its draft tokens. Let C(T) be the time of a step over
T rows, in units of a one-row step; a :class:`~redraft.pricing.curve.CostCurve` holds it as c(n) = C(1 + n)
(n draft rows beyond the one root row). When the step already carries B rows (every request's root row, this
request's own included, plus the drafts already given to other requests), this request's n draft rows cost, in
plain steps of its own,

    c_B(n) = 1 + B * max(0, C(B + n) - C(B)) / C(B)

(each of the B rows' share of the step is C(B) / B), and the policy's single-stream rule (:mod:`redraft.policy.select`)
applies unchanged with c_B in place of c: it drafts exactly when the batch's throughput grows. For B = 1 it is c
itself. A marginal cost below zero (a non-monotonic measured curve) is taken as zero. The idea, verify only what the
step pays for, is vLLM's adaptive verification on GPUs; here the price comes from the measured curve of the host.

A batch that is only draining (every request came in together, none waits) is done when its last request is, so
an accepted token is worth less than its row's share. With the step's fixed part F = C(B) - B (C(B) - C(B - 1)),

    c(n) = 1 + max(0, C(B + n) - C(B)) / v,   v = (C(B) - F) / B + s F,

where s is the request's share of the fixed part: 1 / B in a replaced or latency-bound batch (v = C(B) / B: c_B
above), 0 for the requests ahead of the slowest of a draining batch, and for each of the m slowest the chance that
every other one of them advances too (:func:`redraft.integrations.draining.tied_shares`). The derivation and its
cases: docs/vllm.md, "Draft length: the policy at the step's load". Measurements:
docs/measurements.md#redraft-pricing-load

numpy only; the policy prices a request's draft with it (:class:`~redraft.policy.load.LoadAwarePolicy`, per request
by the vLLM proposer, :mod:`redraft.integrations.planned`, which passes B and the share s, and per sequence in the
step batcher).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from redraft.pricing.curve import CostCurve


def load_costs(curve: CostCurve, carried: int, n_max: int, share: float | None = None) -> np.ndarray:
    """The cost in plain steps of this request's n = 0..n_max draft rows in a step already carrying ``carried`` rows.

    Args:
        curve: the step's cost curve, c(n) = C(1 + n) (time of a step over 1 + n rows / a one-row step).
        carried: B, rows the step carries before this request's drafts, this request's root row included (>= 1).
        n_max: most draft rows considered (>= 0).
        share: s, the part of the step's fixed cost an accepted token of this request saves (module doc): None, the
            row's share 1 / B (c_B: a batch whose finished requests are replaced, or a latency-bound one); 0..1 in a
            draining batch (0: ahead of the slowest; 1: the lone slowest request).
    Returns:
        float64 [n_max + 1], c(0) = 1, each entry >= 1 (plain steps of this request's share). With B = 1 it is the
        curve itself, whatever ``share`` says.
    Raises:
        ValueError: carried < 1, n_max < 0 or a share outside 0..1.
    """
    if carried < 1 or n_max < 0 or (share is not None and not 0.0 <= share <= 1.0):
        raise ValueError(f"load_costs needs carried >= 1 row, n_max >= 0 and share None or within 0..1, got "
                         f"carried={carried}, n_max={n_max}, share={share}")
    base = curve.cost(carried - 1)
    total = np.array([curve.cost(carried - 1 + n) for n in range(int(n_max) + 1)], dtype=np.float64)
    extra = np.maximum(0.0, total - base)
    if share is None or carried == 1:
        return 1.0 + carried * extra / base
    row = max(0.0, base - curve.cost(carried - 2))  # C(B) - C(B - 1), the row this request's step costs
    fixed = max(0.0, base - carried * row)
    value = (base - fixed) / carried + share * fixed
    if value <= 0.0:  # a flat curve: rows are free, and so are drafts
        return np.where(extra > 0.0, np.inf, 1.0)
    return 1.0 + extra / value


# Shares are priced on a geometric grid, SHARE_STEPS points an octave, rounded down (a table per grid point; never a
# cheaper draft than the exact share gives); shares below SHARE_FLOOR count as 0.
SHARE_STEPS = 8
SHARE_FLOOR = 2.0 ** -10


def share_grid(share: float) -> int:
    """The grid point at or below ``share`` (0..1): 0 below SHARE_FLOOR, else 1 + the whole grid steps (an octave
    is SHARE_STEPS of them) from SHARE_FLOOR up to the share; :func:`grid_share` maps it back."""
    if not share >= SHARE_FLOOR:  # NaN too
        return 0
    return 1 + math.floor(SHARE_STEPS * math.log2(min(1.0, share))) - round(SHARE_STEPS * math.log2(SHARE_FLOOR))


def grid_share(point: int) -> float:
    """The share of a :func:`share_grid` point (<= the share it came from)."""
    return 0.0 if point <= 0 else 2.0 ** ((point - 1 + round(SHARE_STEPS * math.log2(SHARE_FLOOR))) / SHARE_STEPS)


class LoadPricing:
    """:func:`load_costs` for one curve and one draft cap, remembered per load (a step's tables cost O(1) each).

    Args:
        curve: the step's cost curve (rows beyond one).
        n_max: most draft rows per request (the cap, e.g. vLLM's num_speculative_tokens).
        remember: most (load, share) tables kept (the oldest is dropped beyond it).
    """

    def __init__(self, curve: CostCurve, n_max: int, remember: int = 4096) -> None:
        self.curve, self.n_max, self.remember = curve, int(n_max), remember
        # per (load, share on its grid): the read-only table and the fewest draft rows that may pay at it
        self._tables: dict[tuple[int, int | None], tuple[np.ndarray, int]] = {}
        self._lock = threading.Lock()  # requests decoding in several threads share one pricing

    def _entry(self, carried: int, share: float | None) -> tuple[np.ndarray, int]:
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"LoadPricing needs a share None or within 0..1, got {share}")
        grid = None if share is None else share_grid(share)
        key = (carried, grid)
        entry = self._tables.get(key)
        if entry is None:
            table = load_costs(self.curve, carried, self.n_max, None if grid is None else grid_share(grid))
            table.setflags(write=False)
            n = np.arange(1, self.n_max + 1)
            below = np.flatnonzero(table[1:] < 1.0 + n - 1e-9)
            entry = (table, int(n[below[0]]) if len(below) else self.n_max + 1)
            with self._lock:
                if len(self._tables) >= self.remember:
                    self._tables.pop(next(iter(self._tables)))
                entry = self._tables.setdefault(key, entry)
        return entry

    def costs(self, carried: int, share: float | None = None) -> np.ndarray:
        """float64 [n_max + 1]: :func:`load_costs` for B = ``carried`` rows and ``share`` (rounded down to its
        :func:`share_grid` point; read-only, shared between callers and threads). Raises ValueError: a share outside
        0..1."""
        return self._entry(carried, share)[0]

    def fewest_paying(self, carried: int, share: float | None = None) -> int:
        """The fewest draft rows whose cost at this load is below one plain step per row, c(n) < 1 + n; n_max + 1
        when there is none. A draft shorter than it cannot pay even if every token is accepted (E(n) <= 1 + n)."""
        return self._entry(carried, share)[1]
