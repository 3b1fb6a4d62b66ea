"""The policy under batch load: a :class:`~redraft.policy.speculation.SpeculationPolicy` whose verify cost is the
step's at its load, c_B (the price, its derivation and its tables: :mod:`redraft.pricing.load`). numpy only.
"""

from __future__ import annotations

from redraft.policy.speculation import SpeculationPolicy
from redraft.pricing.load import LoadPricing


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
        self.share: float | None = None

    def at_load(self, carried: int, share: float | None = None) -> LoadAwarePolicy:
        """Price the next plan for a step already carrying ``carried`` rows (>= 1), with ``share`` the part of the
        step's fixed cost this request's accepted tokens save (:func:`~redraft.pricing.load.load_costs`; None: c_B).
        Returns self."""
        self.costs = self.pricing.costs(max(1, int(carried)), share)
        self.carried, self.share = carried, share
        return self

    def may_pay(self, depth: int) -> bool:
        """False when no draft of at most ``depth`` tokens can beat a plain step at the load set by :meth:`at_load`,
        even with every token accepted (a row costs a whole token: c(n) >= 1 + n); only a probe could draft then,
        and it would cost what it might save. The caller may skip its drafters for this step."""
        return self.pricing.fewest_paying(max(1, int(self.carried)), self.share) <= min(depth, self.pricing.n_max)
