"""The cost of a draft in a step that other requests share: the policy's rule under batch load.

A batched runtime (vLLM's continuous batching, a server batching its requests) runs one forward over every
scheduled request's rows: each request's current token plus its draft tokens. Let C(T) be the time of a step over
T rows, in units of a one-row step; a :class:`~redraft.policy.costcurve.CostCurve` holds it as c(n) = C(1 + n)
(n draft rows beyond the one root row). When the step already carries B rows (every request's root row, this
request's own included, plus the drafts already given to other requests), adding this request's n draft rows costs
C(B + n) - C(B). In a plain batched step each of the B rows costs C(B) / B, its share. Priced in that share, the
request's draft costs

    c_B(n) = 1 + B * max(0, C(B + n) - C(B)) / C(B)

plain steps of its own, and the policy's single-stream rule (keep the draft maximising E(n) / c(n), nothing unless
that beats 1, :mod:`redraft.policy.select`) applies unchanged with c_B in place of c. For B = 1 it is c itself.
It drafts exactly when the batch's throughput grows: with the other rows yielding one token each,
(B - 1 + E(n)) / C(B + n) > B / C(B) is E(n) > c_B(n). When the step is compute-bound (C grows by one unit per row)
c_B(n) -> 1 + n and no draft whose tokens are not all certain pays; on a flat curve (a GPU far from its compute
limit) c_B = 1 and drafts pay at any load. A marginal cost below zero (a non-monotonic measured curve) is taken as
zero. The same idea, verify only what the step's survival probability pays for, is vLLM's adaptive verification on
GPUs; here the price comes from the measured curve of the host.

numpy only; used per request by the vLLM proposer (:mod:`redraft.integrations.planned`), which passes B.
"""

from __future__ import annotations

import threading

import numpy as np

from redraft.policy.costcurve import CostCurve
from redraft.policy.speculation import SpeculationPolicy


def load_costs(curve: CostCurve, carried: int, n_max: int) -> np.ndarray:
    """c_B(0..n_max) for a request adding draft rows to a step that already carries ``carried`` rows (module doc).

    Args:
        curve: the step's cost curve, c(n) = C(1 + n) (time of a step over 1 + n rows / a one-row step).
        carried: B, rows the step carries before this request's drafts, this request's root row included (>= 1).
        n_max: most draft rows considered (>= 0).
    Returns:
        float64 [n_max + 1], c_B(0) = 1, each entry >= 1 (plain steps of this request's share).
    Raises:
        ValueError: carried < 1 or n_max < 0.
    """
    if carried < 1 or n_max < 0:
        raise ValueError(f"load_costs needs carried >= 1 row and n_max >= 0, got carried={carried}, n_max={n_max}")
    base = curve.cost(carried - 1)
    total = np.array([curve.cost(carried - 1 + n) for n in range(int(n_max) + 1)], dtype=np.float64)
    return 1.0 + carried * np.maximum(0.0, total - base) / base


class LoadPricing:
    """:func:`load_costs` for one curve and one draft cap, remembered per load (a step's tables cost O(1) each).

    Args:
        curve: the step's cost curve (rows beyond one).
        n_max: most draft rows per request (the cap, e.g. vLLM's num_speculative_tokens).
        remember: most loads whose tables are kept (the oldest is dropped beyond it).
    """

    def __init__(self, curve: CostCurve, n_max: int, remember: int = 4096) -> None:
        self.curve, self.n_max, self.remember = curve, int(n_max), remember
        self._tables: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # requests decoding in several threads share one pricing

    def costs(self, carried: int) -> np.ndarray:
        """float64 [n_max + 1]: c_B for B = ``carried`` rows (read-only; shared between callers and threads)."""
        table = self._tables.get(carried)
        if table is None:
            table = load_costs(self.curve, carried, self.n_max)
            table.setflags(write=False)
            with self._lock:
                if len(self._tables) >= self.remember:
                    self._tables.pop(next(iter(self._tables)))
                table = self._tables.setdefault(carried, table)
        return table


class LoadAwarePolicy(SpeculationPolicy):
    """A :class:`SpeculationPolicy` whose verify cost is priced at the step's load (one per request).

    Requests share what is learned by sharing one :class:`~redraft.policy.acceptance.AcceptanceTracker` (pass it as
    ``tracker``); each keeps its own probe bookkeeping. Call :meth:`at_load` before each plan.

    Args:
        pricing: the shared :class:`LoadPricing`; its ``n_max`` is the policy's ``max_nodes``.
        **kwargs: as :class:`SpeculationPolicy` (``tracker``, ``probe_overhead``, ...).
    """

    def __init__(self, pricing: LoadPricing, **kwargs) -> None:
        super().__init__(pricing.curve, max_nodes=max(1, pricing.n_max), **kwargs)
        self.pricing = pricing
        self.carried = 1

    def at_load(self, carried: int) -> LoadAwarePolicy:
        """Price the next plan for a step already carrying ``carried`` rows (>= 1). Returns self."""
        self.costs = self.pricing.costs(max(1, int(carried)))
        self.carried = carried
        return self
