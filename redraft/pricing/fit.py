"""A cost curve from repeated, noisy timings: the median per size, then the shapes physics requires where the
measurements' spread allows them.

Input: for each measured draft size n, repeated samples of the ratio T(1 + n) / T(1), each forward of 1 + n tokens
timed between two 1-token reference forwards (:func:`redraft.pricing.measure.time_forwards`), so a change of
the machine's load between one size and the next cancels out of its ratio: on a shared machine a size timed during
a burst of another job's work would otherwise come out far above its neighbours, and the policy would split its
verifies to avoid it (Measurements: docs/measurements.md#redraft-pricing-fit).

The fit, per size (sizes ascending, n = 0 fixed at c(0) = 1):

1. the median of its samples; the samples' interquartile range [q25, q75] is how far the fit may move it;
2. **non-decreasing within noise**: where a wider forward's median is below a narrower one's, both move toward
   their mean, each not past its own interquartile range (a dip that every sample shows stays: the measurements
   do not allow removing it);
3. **sub-additive within noise**: one forward of S tokens cannot cost more than two forwards of S1 + S2 = S tokens
   (the engine could always verify it in two), so c(n) <= min over a + b = n - 1 of c(a) + c(b), the right side
   taken from the fitted curve below n (linear between sizes); c(n) is lowered to that bound, but not below its q25.

The result is a :class:`~redraft.pricing.curve.CostCurve`; the pieces are returned by :func:`fit_costs` for
reports. Ours (the constraints are the physical ones above; the median and interquartile bounds are the usual
robust statistics). Beside it, :func:`fit_step_curve`: a batched runtime's step (vLLM's) as a robust line through
noisy step times. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from redraft.pricing.curve import CostCurve


@dataclass(frozen=True)
class CostFit:
    """A fitted curve with the statistics it came from (all float64 arrays aligned with ``sizes``).

    Attributes:
        sizes: draft token counts n, ascending from 0.
        median, low, high: per size, the median and the 25th / 75th percentiles of the ratio samples (1 at n = 0).
        fitted: the fitted c(n) (``curve.costs``).
        curve: the :class:`CostCurve`.
    """

    sizes: tuple[int, ...]
    median: np.ndarray
    low: np.ndarray
    high: np.ndarray
    fitted: np.ndarray
    curve: CostCurve

    def to_dict(self) -> dict:
        """JSON-ready: sizes and the four per-size lists (rounded to 4 decimals)."""
        return {"sizes": list(self.sizes), **{k: [round(float(x), 4) for x in getattr(self, k)]
                                              for k in ("median", "low", "high", "fitted")}}


def fit_costs(sizes: Sequence[int], samples: Sequence[Sequence[float]]) -> CostFit:
    """Fit c(n) from ratio samples (see the module doc).

    Args:
        sizes: draft token counts n, strictly ascending ints; 0 is added (with c(0) = 1) when missing, and samples
            given for n = 0 are ignored.
        samples: per size, the ratios T(1 + n) / T(1) measured (unitless, each finite and > 0, at least one).
    Returns:
        :class:`CostFit` (``.curve`` is the CostCurve).
    Raises:
        ValueError: lengths differ, sizes not strictly ascending non-negative ints, a size with no samples, or a
            sample not finite and > 0.
    """
    sizes = [int(s) for s in sizes]
    if len(sizes) != len(samples):
        raise ValueError(f"fit_costs: {len(sizes)} sizes but {len(samples)} sample lists")
    if not sizes or sizes[0] < 0 or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"fit_costs: sizes must be non-negative and strictly ascending, got {sizes}")
    rows = [np.asarray(s, dtype=np.float64) for s in samples]
    for n, r in zip(sizes, rows, strict=True):
        if n > 0 and (r.size == 0 or not np.all(np.isfinite(r)) or np.any(r <= 0)):
            raise ValueError(f"fit_costs: size {n} needs at least one finite ratio > 0, got {r.tolist()}")
    if sizes[0] != 0:
        sizes, rows = [0] + sizes, [np.ones(1)] + rows
    med = np.array([1.0] + [float(np.median(r)) for r in rows[1:]])
    low = np.array([1.0] + [float(np.percentile(r, 25)) for r in rows[1:]])
    high = np.array([1.0] + [float(np.percentile(r, 75)) for r in rows[1:]])
    fit = med.copy()
    for _ in range(len(sizes)):  # each pass settles at least one more violation; stop early when nothing moves
        before = fit.copy()
        pool_decreases(fit, low, high)
        bound_subadditive(sizes, fit, low)
        if np.array_equal(fit, before):
            break
    curve = CostCurve(tuple(sizes), tuple(float(c) for c in fit))
    return CostFit(tuple(sizes), med, low, high, fit, curve)


def pool_decreases(fit: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """In place: for each adjacent pair with fit[i] > fit[i + 1], lower fit[i] toward their mean (not below low[i])
    and raise fit[i + 1] to the lowered value (not above high[i + 1]), so the pair ends level where the ranges allow
    (index 0, c(0) = 1, never moves)."""
    for i in range(len(fit) - 1):
        if fit[i] <= fit[i + 1]:
            continue
        mean = 0.5 * (fit[i] + fit[i + 1])
        lowered = fit[i] if i == 0 else min(fit[i], max(low[i], mean))
        fit[i + 1] = max(fit[i + 1], min(high[i + 1], lowered))
        fit[i] = lowered


def bound_subadditive(sizes: Sequence[int], fit: np.ndarray, low: np.ndarray) -> None:
    """In place: fit[i] = min(fit[i], max(low[i], min over a + b = n_i - 1 of c(a) + c(b))), ascending, with c the
    fitted curve below n_i interpolated linearly; only splits whose parts are both within the sizes below n_i count
    (a grid that more than doubles leaves a size unbounded)."""
    for i in range(1, len(sizes)):
        n = int(sizes[i])
        top = int(sizes[i - 1])
        a = np.arange(max(0, n - 1 - top), (n - 1) // 2 + 1)  # both parts within the sizes measured below n
        if a.size == 0:
            continue
        below = CostCurve(tuple(sizes[:i]), tuple(float(c) for c in fit[:i]))
        bound = float(np.min(below.at(a) + below.at(n - 1 - a)))
        fit[i] = min(fit[i], max(low[i], bound))


def fit_step_curve(rows, seconds) -> dict:
    """The line C(T) = a + b T through (rows, seconds), a >= 0 and b >= 0, as a cost curve: {"sizes": [T - 1],
    "costs": [C(T) / C(1)], "fit": {"a_seconds", "b_seconds_per_row"}, "seconds"}; a flat curve when nothing
    positive was measured. Theil-Sen (the median of the pairwise slopes, then the median intercept): one step slowed
    by another job on the machine moves it little, where least squares follows it."""
    x, y = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    b = max(0.0, float(np.median((y[j] - y[i]) / (x[j] - x[i])))) if len(x) > 1 else 0.0
    a = max(0.0, float(np.median(y - b * x)))
    if a + b <= 0:
        a, b = 1.0, 0.0
    return {"sizes": [int(t) - 1 for t in rows], "costs": [float((a + b * t) / (a + b)) for t in rows],
            "fit": {"a_seconds": a, "b_seconds_per_row": b}, "seconds": [float(v) for v in seconds]}
