"""The verify cost curve c(n): time of a verify forward with n draft tokens, relative to a plain 1-token step.

A verify forward with n draft tokens runs 1 + n tokens (the root plus the draft), so c(0) = 1 by definition. The
curve is measured where redraft runs (:mod:`redraft.pricing.measure`) at a grid of n and interpolated linearly in
between; it is not assumed monotonic (a wider forward can cost less than a narrower one), so interpolation never
smooths across grid points. Beyond the last grid point the last segment's slope (never negative) extends it. numpy
only. Measurements: docs/measurements.md#redraft-pricing-curve
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    """c(n) at measured draft sizes, linearly interpolated in between.

    Attributes:
        sizes: draft token counts n, strictly ascending ints, the first one 0.
        costs: c(n) at each size (unitless: time / time of a 1-token forward); costs[0] is 1.
    Raises:
        ValueError: empty or mismatched lengths, sizes not strictly ascending from 0, a cost not finite and > 0,
            or costs[0] != 1 (build from raw timings with :meth:`from_times`).
    """

    sizes: tuple[int, ...]
    costs: tuple[float, ...]

    def __post_init__(self) -> None:
        sizes, costs = tuple(int(s) for s in self.sizes), tuple(float(c) for c in self.costs)
        if not sizes or len(sizes) != len(costs):
            raise ValueError(f"cost curve needs as many costs as sizes (at least one), got {len(sizes)} sizes "
                             f"and {len(costs)} costs")
        if sizes[0] != 0 or any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"cost curve sizes must ascend strictly from 0, got {list(sizes)}")
        if any(not (math.isfinite(c) and c > 0) for c in costs):
            raise ValueError(f"cost curve costs must be finite and > 0, got {list(costs)}")
        if abs(costs[0] - 1.0) > 1e-9:
            raise ValueError(f"cost curve must have c(0) = 1 (costs are relative to a 1-token step), got {costs[0]}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "costs", costs)

    @classmethod
    def from_times(cls, sizes: Sequence[int], seconds: Sequence[float]) -> CostCurve:
        """A curve from forward times in seconds at ``sizes`` draft tokens (sizes[0] must be 0: the 1-token step)."""
        if not seconds or not seconds[0] > 0:
            raise ValueError(f"the 1-token forward time must be > 0 seconds, got {list(seconds)[:1]}")
        return cls(tuple(sizes), tuple(float(s) / float(seconds[0]) for s in seconds))

    @classmethod
    def flat(cls, up_to: int = 64) -> CostCurve:
        """c(n) = 1 for every n: a wider verify forward costs nothing more (an idealised accelerator)."""
        return cls((0, max(1, int(up_to))), (1.0, 1.0))

    def cost(self, n: float) -> float:
        """c(n) for n >= 0 draft tokens, interpolated (extrapolated past the last size with its slope, >= 0)."""
        if n <= self.sizes[-1]:
            return float(np.interp(n, self.sizes, self.costs))
        if len(self.sizes) == 1:
            return self.costs[0]
        slope = (self.costs[-1] - self.costs[-2]) / (self.sizes[-1] - self.sizes[-2])
        return self.costs[-1] + max(0.0, slope) * (n - self.sizes[-1])

    def at(self, ns) -> np.ndarray:
        """float64 array: c(n) for each n >= 0 in ``ns`` (as :meth:`cost`, vectorised)."""
        xs = np.asarray(ns, dtype=np.float64)
        out = np.interp(xs, self.sizes, self.costs)
        if len(self.sizes) > 1:
            slope = max(0.0, (self.costs[-1] - self.costs[-2]) / (self.sizes[-1] - self.sizes[-2]))
            out = np.where(xs > self.sizes[-1], self.costs[-1] + slope * (xs - self.sizes[-1]), out)
        return out

    def table(self, n_max: int) -> np.ndarray:
        """float64 [n_max + 1]: c(0), c(1), ..., c(n_max), for O(1) lookups in the per-step decision."""
        return np.array([self.cost(n) for n in range(int(n_max) + 1)], dtype=np.float64)

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "costs": list(self.costs)}

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        """Inverse of :meth:`to_dict`. Raises ValueError naming the bad field."""
        if not isinstance(data, dict) or not isinstance(data.get("sizes"), list) \
                or not isinstance(data.get("costs"), list):
            raise ValueError("cost curve: expected an object with lists 'sizes' and 'costs'")
        try:
            return cls(tuple(int(s) for s in data["sizes"]), tuple(float(c) for c in data["costs"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"cost curve: {e}") from e
