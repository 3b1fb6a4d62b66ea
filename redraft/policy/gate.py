"""A drafter whose own drafting costs time (a GliDe draft model), asked to draft only while its drafts pay.

The policy (:class:`~redraft.policy.speculation.SpeculationPolicy`) weighs every proposal against its verify cost
and cuts one that does not pay to zero depth, probing it now and then. For a lookup source (corpus, n-gram) that
is the whole cost, since proposing is a table lookup. A draft model also spends its own forwards on every proposal
(GliDe: gamma small-model steps with a full-vocabulary head, ~0.3-0.7 of a plain step on the 2-core CPU), so a cut
draft would still slow every step down. :class:`PolicyGate` wraps such a drafter:

- it asks the drafter to draft only when the source's learned acceptance, as the policy estimates it per level,
  makes some depth d pay for its verify cost and its draft cost: ``E(d) / (c(d) + draft_cost) > 1 + min_gain``
  (E(d) = 1 + expected accepted tokens, c the measured cost curve, both in plain steps);
- a source never judged yet is probed at once (:meth:`SpeculationPolicy.probe_soon`): one draft tells more than
  the prior, and a draft that pays starts paying from the first steps;
- otherwise it returns no proposal without running the draft model, and counts the step as idle for the source
  (:meth:`SpeculationPolicy.skip`), so the policy's probing goes on: once the idle steps reach
  ``(c(L) - 1 + draft_cost) / probe_overhead`` (L = the probe length) the drafter drafts again and the policy
  probes it. A useless draft model then costs about ``probe_overhead`` of a plain step on average, like a useless
  lookup source.

``draft_cost`` is measured as the drafter runs (:class:`~redraft.pricing.draft.DraftCostMeter`: the time of its
proposals over the time of the rest of a step, smoothed), :data:`redraft.defaults.GLIDE_DRAFT_COST` until the first
measurement; the prices above are :func:`~redraft.pricing.draft.drafted_costs` and
:func:`~redraft.pricing.draft.probe_cost`. Ours; GliDe (arXiv 2402.02082) always drafts, and on a GPU a draft step is a small share of a verify.
"""

from __future__ import annotations

import math
import time

import numpy as np

from redraft.defaults import GLIDE_DRAFT_COST
from redraft.policy.speculation import SpeculationPolicy
from redraft.pricing.draft import DraftCostMeter, drafted_costs, probe_cost


class PolicyGate:
    """Wraps a drafter (the :class:`~redraft.drafters.base.Drafter` protocol) so the policy decides whether it
    drafts at all this step (see the module doc). Same ``name`` and ``guard`` as the wrapped drafter.

    Args:
        drafter: the wrapped drafter (e.g. :class:`~redraft.drafters.glide.GlideDrafter`).
        policy: the engine's policy (the same object: it learns the source's acceptance from the engine).
        draft_cost: its cost per proposal in plain target steps; None = measured as it runs, starting from
            :data:`~redraft.defaults.GLIDE_DRAFT_COST`.
        smoothing: weight of the newest timing in the measured cost (0..1].
    Attributes:
        asked, drafted: propose calls received and passed on to the drafter (the draft model ran).
    Raises:
        ValueError: ``draft_cost`` < 0 or ``smoothing`` outside (0, 1].
    """

    own_budget = True  # it decides each step whether its drafter runs: the planner's asking budget leaves it be

    def __init__(self, drafter, policy: SpeculationPolicy, *, draft_cost: float | None = None,
                 smoothing: float = 0.2) -> None:
        if (draft_cost is not None and not draft_cost >= 0) or not 0 < smoothing <= 1:
            raise ValueError(f"PolicyGate needs draft_cost >= 0 and 0 < smoothing <= 1, got {draft_cost}, "
                             f"{smoothing}")
        self.drafter, self.policy = drafter, policy
        self.name, self.guard = drafter.name, getattr(drafter, "guard", None)
        self.meter = DraftCostMeter(float(draft_cost) if draft_cost is not None else GLIDE_DRAFT_COST,
                                    fixed=draft_cost is not None, smoothing=smoothing)
        self.asked = self.drafted = 0

    @property
    def cost(self) -> float:
        """The draft model's cost per proposal in plain steps, now (fixed, or as measured)."""
        return self.meter.cost

    def bind(self, target) -> None:
        self.drafter.bind(target)

    def begin(self, prompt) -> None:
        self.meter.restart()
        self.drafter.begin(prompt)

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        self.drafter.observe(proposed, accepted, emitted)

    def pays(self, depth: int) -> bool:
        """Whether a draft of up to ``depth`` levels from this source pays for its verify and draft cost on the
        policy's current acceptance estimate (see the module doc)."""
        depth = min(int(depth), len(self.policy.costs) - 1)
        if depth <= 0:
            return False
        q = self.policy.tracker.conditional(self.name, depth)  # [depth] P(level d | level d - 1)
        expected = 1.0 + np.cumsum(np.cumprod(q))  # tokens per forward for a chain of 1..depth levels
        rate = expected / drafted_costs(self.policy.costs, depth, self.cost)
        return bool(rate.max() > 1.0 + self.policy.min_gain)

    def probe_due(self, depth: int) -> bool:
        """Whether the source has been idle long enough for a probe that costs its draft too."""
        length = max(1, min(int(depth), self.policy.probe_max, len(self.policy.costs) - 1))
        worst = probe_cost(self.policy.costs, length, self.cost)
        return self.policy.idle.get(self.name, 0) >= max(1, math.ceil(worst / self.policy.probe_overhead))

    def propose(self, context, max_depth: int):
        """The wrapped drafter's proposal when it pays or a probe is due, else None (the draft model does not run;
        the step counts as idle for the source)."""
        now = time.perf_counter()
        self.meter.asked(now)
        self.asked += 1
        if max_depth <= 0:
            return None
        if not self.policy.tracker.counts(self.name)[1].any():  # never judged: probe it at once
            self.policy.probe_soon(self.name)
        elif not (self.pays(max_depth) or self.name in self.policy.probe_paid or self.probe_due(max_depth)):
            self.policy.skip(self.name)
            return None
        self.drafted += 1
        tree = self.drafter.propose(context, max_depth)
        self.meter.drafted(now, time.perf_counter())
        return tree
