"""One request's drafts inside vLLM: at a fixed depth (:class:`RequestDrafts`), or with the draft length chosen by
the cost-aware policy at the step's load (:class:`PlannedDrafts`).

The engine's policy rule (:mod:`redraft.policy`): each draft source's proposal is a candidate, and the policy keeps
the leading tokens whose expected accepted tokens pay for their verify cost, from acceptance learned online per
source and match length (:func:`redraft.policy.apply.policy_key`) and the source's own priors. In vLLM the verify
cost of a request's draft depends on what the step already carries for other requests, so the cost table is the
load rule's c_B (:mod:`redraft.policy.load`), B given per request by the proposer. The sources are tried in
priority order (corpus, then n-gram) and the first one whose proposal the policy keeps any of drafts, as in the
engine's priority mode; vLLM verifies chains, so a proposal is cut to its first path. Requests share the learned
acceptance (one :class:`~redraft.policy.acceptance.AcceptanceTracker` per proposer) and keep their own probe
bookkeeping. numpy only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from redraft.policy.apply import Candidates, cut
from redraft.policy.costcurve import CostCurve
from redraft.policy.load import LoadAwarePolicy


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
    """One request's draft sources (corpus first, then n-gram, each with its guard) and its last draft."""

    def __init__(self, drafters: list) -> None:
        self.drafters = drafters
        self.learned = False  # its span went into the corpus (when it sampled EOS)
        self.draft: list[int] = []
        self.source = -1  # index of the drafter that made self.draft

    def settle(self, sampled: Sequence[int]) -> tuple[int, int]:
        """Account the last draft against the ids vLLM sampled for this request (accepted drafts + bonus).

        Returns (proposed, accepted) for the last draft's source. vLLM may verify only a prefix of a draft (its
        scheduler trims drafts to the token budget and the model length); a sampled id that is not a drafted one,
        or a bonus equal to the draft id at that position, tells where verification stopped, so a cut-short draft
        counts only what was verified.
        """
        p, a = verified(self.draft, sampled)
        for j, drafter in enumerate(self.drafters):
            mine = j == self.source
            drafter.observe(p if mine else 0, a if mine else 0, len(sampled))
        self.draft, self.source = [], -1
        return p, a

    def propose(self, context: np.ndarray, depth: int) -> list[int]:
        """The first source's chain for ``context`` (int [L], prompt + output so far), at most ``depth`` ids."""
        if depth > 0:
            for j, drafter in enumerate(self.drafters):
                prop = drafter.propose(context, depth)
                if prop is not None and len(prop):
                    self.draft, self.source = [int(t) for t in list(prop.tokens)[:depth]], j
                    return self.draft
        return []


class PlannedDrafts:
    """One request's draft sources (corpus first, then n-gram) under a :class:`LoadAwarePolicy`.

    Args:
        drafters: the request's drafters in priority order (``build_drafters(..., policy=True)``).
        policy: this request's policy (sharing the proposer's acceptance tracker and load pricing).
    Attributes:
        draft: the last draft (Python ints); source: index of the drafter that made it (-1: none);
        key: the policy key it was learned under; learned: the request's span went into the corpus.
    """

    def __init__(self, drafters: list, policy: LoadAwarePolicy) -> None:
        self.drafters, self.policy = drafters, policy
        self.learned = False
        self.draft: list[int] = []
        self.source = -1
        self.key = ""
        # what lookup found since the last propose: (context length, cap, (drafter index, candidates) or None)
        self._looked: tuple[int, int, tuple[int, Candidates] | None] | None = None

    def settle(self, sampled: Sequence[int]) -> tuple[int, int]:
        """Account the last draft against the ids vLLM sampled (accepted drafts + bonus): the drafters' guards and
        the policy learn it. Returns (proposed, accepted)."""
        p, a = verified(self.draft, sampled)
        for j, drafter in enumerate(self.drafters):
            mine = j == self.source
            drafter.observe(p if mine else 0, a if mine else 0, len(sampled))
        if self.source >= 0:
            self.policy.observe(self.key, p, a)
        self.draft, self.source, self.key = [], -1, ""
        return p, a

    def lookup(self, context: np.ndarray, cap: int, carried: int) -> float:
        """P(the first token of this request's draft is accepted), before its price is known: the first source with a
        proposal for ``context`` (int [L]) and the policy's estimate q for its first node. 0.0 when no source
        proposes, or when that first token would not pay for its own row even at the best price this request can
        get in a step carrying ``carried`` rows (the whole fixed part saved: share 1), so that the other requests
        are not priced as if it drafted. The proposal is kept for the next :meth:`propose` on the same context."""
        found = self._find(context, cap, 0) if cap > 0 else None
        self._looked = (len(context), cap, found)
        if found is None:
            return 0.0
        q = self._chance(found[1])
        return q if 1.0 + q > self.policy.pricing.costs(max(1, carried), 1.0)[1] else 0.0

    def _chance(self, cand: Candidates) -> float:
        prior = cand.priors[0]
        return float(self.policy.conditionals([-1], cand.keys[:1], None if np.isnan(prior) else [prior])[0])

    def propose(self, context: np.ndarray, cap: int, carried: int, share: float | None = None, *,
                confident: tuple[float, float] | None = None) -> list[int]:
        """The draft for ``context`` (int [L], prompt + output so far): at most ``cap`` ids, as many as pay in a step
        already carrying ``carried`` rows (this request's own root row included), an accepted token saving ``share``
        of the step's fixed cost (:func:`redraft.policy.load.load_costs`; None: the row's share of the step). Empty:
        no draft pays. ``confident`` = (chance, floor): a draft whose first token's chance is at least ``chance`` is
        priced at a share of at least ``floor``."""
        looked, self._looked = self._looked, None
        same = looked is not None and looked[:2] == (len(context), cap)  # a lookup of this context ran
        found = looked[2] if same else None
        if confident is not None and share is not None and share < confident[1] and cap > 0:
            if not same:
                found, same = self._find(context, cap, 0), True
            if found is not None and self._chance(found[1]) >= confident[0]:
                share = confident[1]
        if cap <= 0 or not self.policy.at_load(carried, share).may_pay(cap):
            return []  # not even a certain draft pays here: no (further) lookup (a step's Python time counts)
        start = len(self.drafters) if same and found is None else 0  # it found nothing: no second search
        while (hit := found or self._find(context, cap, start)) is not None:
            found = None
            j, cand = hit
            tree, keys = cut(self.policy, cand, max_depth=cap, budget=cap)
            if len(tree):
                self.draft, self.source, self.key = [int(t) for t in tree.tokens[:cap]], j, keys[0]
                return self.draft
            start = j + 1
        return []

    def _find(self, context: np.ndarray, cap: int, start: int) -> tuple[int, Candidates] | None:
        """The first of the drafters from ``start`` on with a proposal: (its index, the proposal's first path as
        candidates), None when none proposes."""
        for j in range(start, len(self.drafters)):
            prop = self.drafters[j].propose(context, cap)
            if prop is not None and len(prop):
                cand = Candidates()
                cand.add(prop.first_path(), self.drafters[j].name, budget=self.policy.max_nodes, max_depth=cap)
                return j, cand
        return None


def load_step_curve(path: str | None, k: int) -> CostCurve:
    """The cost curve of vLLM's step (REDRAFT_COST_CURVE): a JSON object {"sizes": [...], "costs": [...]} (or the
    cost cache's {"key": ..., "curve": {...}}); sizes are rows beyond one, costs relative to a one-row step. None:
    a flat curve up to ``k`` (a step costs the same whatever its rows).

    Raises:
        ValueError: the file is missing, not JSON or not a valid curve (the message names the variable).
    """
    if path is None:
        return CostCurve.flat(k)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("curve"), dict):
            data = data["curve"]
        return CostCurve.from_dict(data)
    except OSError as e:
        raise ValueError(f"REDRAFT_COST_CURVE={path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError too
        raise ValueError(f'REDRAFT_COST_CURVE={path}: expected a JSON cost curve {{"sizes": [0, ...], '
                         f'"costs": [1.0, ...]}} ({e})') from None
