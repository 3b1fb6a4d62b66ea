"""One request's drafts inside vLLM (:class:`RequestDrafts`): the engine's own planner
(:class:`redraft.decoding.planner.DraftPlanner`), at a fixed depth or with the draft length chosen by the cost-aware
policy at the step's load, settled against the ids vLLM sampled.

The engine's policy rule (:mod:`redraft.policy`): each draft source's proposal is a candidate, and the policy keeps
the leading tokens whose expected accepted tokens pay for their verify cost, from acceptance learned online per
source and match length (:func:`redraft.policy.candidates.policy_key`) and the source's own priors. In vLLM the verify
cost of a request's draft depends on what the step already carries for other requests, so the cost table is the
load rule's c_B (:mod:`redraft.pricing.load`), B given per request by the proposer. The sources are tried in
priority order (corpus, then n-gram) and the first one whose proposal the policy keeps any of drafts, as in the
engine's priority mode; vLLM verifies chains, so a proposal is cut to its first path. Requests share the learned
acceptance (one :class:`~redraft.policy.acceptance.AcceptanceTracker` per proposer) and keep their own probe
bookkeeping. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from redraft.decoding.planner import Draft, DraftLimits, DraftPlanner
from redraft.pricing.cache import read_curve
from redraft.pricing.curve import CostCurve


def verified(draft: Sequence[int], sampled: Sequence[int]) -> tuple[int, int]:
    """(proposed, accepted): how much of ``draft`` vLLM verified and accepted, read from the ids it sampled.

    ``sampled`` is the request's accepted draft ids plus the bonus id. vLLM may verify only a prefix of a draft (its
    scheduler trims drafts to the token budget and the model length); a bonus equal to the draft id at its position
    says verification stopped there, so a cut-short draft counts only what was verified.
    """
    m = len(sampled)
    if not draft:
        return 0, 0
    a = 0
    while a < min(len(draft), m - 1) and draft[a] == sampled[a]:
        a += 1
    p = a if (a == m - 1 and a < len(draft) and sampled[a] == draft[a]) else len(draft)
    return p, a


class RequestDrafts:
    """One vLLM request's drafting: its :class:`~redraft.decoding.planner.DraftPlanner` (chains only; with the
    load-aware policy or fixed depths) and the draft it made last, to settle against what vLLM sampled.

    Attributes:
        planner: the request's planner; last: its last :class:`~redraft.decoding.planner.Draft`;
        learned: the request's span went into the corpus (when it sampled EOS).
    """

    def __init__(self, planner: DraftPlanner) -> None:
        self.planner = planner
        self.learned = False
        self.last = Draft()

    @property
    def draft(self) -> list[int]:
        """The last draft's ids (Python ints; empty: none)."""
        return [int(t) for t in self.last.tree.tokens]

    def settle(self, sampled: Sequence[int]) -> tuple[int, int]:
        """Account the last draft against the ids vLLM sampled for this request (accepted drafts + bonus): the
        planner's policy and every drafter's guard learn it (:meth:`DraftPlanner.observe`). Returns (proposed,
        accepted) as :func:`verified` reads them: a draft vLLM verified only a prefix of counts that prefix."""
        ids = self.draft
        p, a = verified(ids, sampled)
        self.planner.observe(self.last, list(range(a)), len(sampled), judged=p if p < len(ids) else None)
        self.last = Draft()
        return p, a

    def lookup(self, context: np.ndarray, cap: int, carried: int) -> float:
        """P(the first token of this request's draft for ``context`` (int [L]) is accepted), at most ``cap`` ids
        in a step carrying ``carried`` rows (:meth:`DraftPlanner.chance`; 0.0 under fixed depths)."""
        return self.planner.chance(context, DraftLimits(cap, budget=cap, carried=max(1, carried)))

    def propose(self, context: np.ndarray, cap: int, carried: int = 1, share: float | None = None, *,
                confident: tuple[float, float] | None = None) -> list[int]:
        """The draft for ``context`` (int [L], prompt + output so far): a chain of at most ``cap`` ids, as many as
        pay in a step already carrying ``carried`` rows (this request's root row included), an accepted token
        saving ``share`` of the step's fixed cost; ``confident`` as :class:`DraftLimits`. Empty: no draft."""
        self.last = self.planner.propose(context, DraftLimits(cap, budget=cap, carried=max(1, carried), share=share,
                                                              confident=confident))
        return self.draft[:cap]


def load_step_curve(path: str | None, k: int) -> CostCurve:
    """The cost curve of vLLM's step (REDRAFT_COST_CURVE), read by :func:`redraft.pricing.cache.read_curve`: a JSON
    object {"sizes": [...], "costs": [...]} (or the cost cache's {"key": ..., "curve": {...}}); sizes are rows beyond
    one, costs relative to a one-row step. None: a flat curve up to ``k`` (a step costs the same whatever its rows).

    Raises:
        ValueError: the file is missing, not JSON or not a valid curve (the message names the variable).
    """
    if path is None:
        return CostCurve.flat(k)
    try:
        return read_curve(path)
    except OSError as e:
        raise ValueError(f"REDRAFT_COST_CURVE={path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError too
        raise ValueError(f'REDRAFT_COST_CURVE={path}: expected a JSON cost curve {{"sizes": [0, ...], '
                         f'"costs": [1.0, ...]}} ({e})') from None
