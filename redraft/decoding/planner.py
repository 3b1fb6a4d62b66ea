"""The draft planner: a sequence's drafters and policy -> the token tree its next verify forward checks.

Every front end drafts through one :class:`DraftPlanner` per sequence: the engine's decode loop
(:class:`redraft.decoding.engine.Engine`, which the server's step batcher drives too) and the vLLM proposer
(:mod:`redraft.integrations.vllm_proposer`, one planner per vLLM request, chains only). The planner asks the drafters
in priority order and, with no policy, verifies the first proposal (or merges all of them into one tree within the
node budget); with the cost-aware policy (:mod:`redraft.policy`) the proposals become candidates that the policy
cuts at the step's price, and the first source whose candidates the policy keeps any of wins the step. After the
forward, :meth:`DraftPlanner.observe` feeds the outcome to the policy and to each drafter's guard.

numpy only (no torch): the vLLM proposer's hot path imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from redraft.policy.asking import AskBudget
from redraft.policy.candidates import Candidates, cut, first_prior, observe_outcomes, policy_key
from redraft.policy.speculation import SpeculationPolicy
from redraft.tree import TokenTree


@dataclass
class Draft:
    """The proposal one step verifies.

    Attributes:
        tree: the verify tree (empty = a draft-free forward).
        keys: the cost-aware policy's key per node of ``tree`` (empty without a policy).
    """

    tree: TokenTree = field(default_factory=TokenTree)
    keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DraftLimits:
    """What one step's draft may be and what it costs.

    Attributes:
        depth: most tree levels (tokens along a path); 0 = no draft. The caller keeps accepted + bonus within the
            token budget and the context window.
        budget: most tree nodes; None = the planner's ``tree_budget``.
        fed: tokens the verify forward carries before the draft (the whole prompt at a first step, else 1).
        carried: rows the step already carries, this sequence's root row included (1 alone): the policy prices
            the draft at this load (:meth:`redraft.policy.load.LoadAwarePolicy.at_load`).
        share: part of the step's fixed cost one accepted token of this sequence saves (None: the row's share;
            :func:`redraft.pricing.load.load_costs`).
        confident: (chance, floor): a draft whose first token's acceptance chance is at least ``chance`` is priced
            at a share of at least ``floor`` (the draining-batch rule, :mod:`redraft.integrations.draining`).
        first_token_awaited: a streaming client waits for this forward's first token (no output yet): the draft
            must be likely right (the policy's ``prompt_chance``).
    """

    depth: int
    budget: int | None = None
    fed: int = 1
    carried: int = 1
    share: float | None = None
    confident: tuple[float, float] | None = None
    first_token_awaited: bool = False


@dataclass
class SourceOutcome:
    """One drafter's part in one verify forward: nodes proposed (judged), nodes accepted, and whether its guard
    paused it after this forward."""

    proposed: int = 0
    accepted: int = 0
    paused: bool = False


class DraftPlanner:
    """One sequence's drafting: drafters in priority order, and optionally the cost-aware policy.

    Args:
        drafters: :class:`redraft.drafters.base.Drafter` objects, highest priority first (each with ``name``,
            ``propose(context, max_depth) -> TokenTree | None``, ``observe(proposed, accepted, emitted)`` and an
            optional ``guard``).
        policy: a :class:`~redraft.policy.SpeculationPolicy` (or its load-aware subclass), or None for fixed depths.
        merge: False = the first source with a proposal (with the policy: the first the policy keeps any of) wins
            the step; True = all proposals merge into one tree (with the policy: one candidate set, cut once).
        chain_only: verify chains only (proposals cut to their first path): sliding-window models, vLLM.
        tree_budget: most verified nodes per step when :class:`DraftLimits` gives none.
        vocab_size: drop proposed ids outside 0..vocab_size-1 (None: keep every id).
        clock: seconds (float), read at each :meth:`propose`; with a policy that learns its prices from the loop
            (``policy.loop``), each step's time from one plan to the next goes to ``policy.observe_step``.
    """

    def __init__(self, drafters: Sequence, policy: SpeculationPolicy | None = None, *, merge: bool = False,
                 chain_only: bool = False, tree_budget: int = 64, vocab_size: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.drafters = list(drafters)
        self.policy = policy
        self.merge, self.chain_only = merge, chain_only
        self.tree_budget = tree_budget
        self.vocab_size = vocab_size
        # what chance() found since the last propose: (context length, depth, (source index, name, proposal) or None)
        self._looked: tuple[int, int, tuple[int, str, TokenTree] | None] | None = None
        self.clock = clock
        # the step being timed for the policy's loop prices: (its start, draft tokens, pending tokens fed), the
        # forwards observed since, and whether the step before it was timed
        self._step: tuple[float, int, int] | None = None
        self._forwards = 0
        self._timed = False
        # with loop prices: a drafter whose drafts keep being dropped is asked within a budget (policy.asking)
        self.asks = AskBudget() if getattr(policy, "loop", None) is not None else None
        self._may_skip = False  # this step may leave a fruitless drafter unasked (not a prompt's forward)
        self._skipped = False  # a drafter was left unasked this step
        self._last_key: dict[int, str] = {}  # per drafter index, the policy key of its last proposal

    def begin(self) -> None:
        """A new sequence starts: the time since the last step belongs to no step (a prompt's prefill comes next)."""
        self._step, self._timed = None, False

    # ---- proposing -------------------------------------------------------------------------------------------

    def propose(self, context: np.ndarray, limits: DraftLimits) -> Draft:
        """The step's :class:`Draft` for ``context`` (int [L], prompt + output so far) within ``limits``; an empty
        tree when ``limits.depth`` is 0 or nothing pays. Drafters after the one that wins the step are not asked.

        With a policy that learns its prices (``policy.loop``), the step before this one is timed here: from its
        plan to this one, when it was one forward of one pending token plus its draft, alone in its step
        (``limits.carried`` 1); a prompt's forward, a step with extra forwards (exact mode's settling) or a shared
        step is not, and the step after it counts as not following a timed one. Such a planner also asks each
        drafter within its :class:`~redraft.policy.asking.AskBudget` (``asks``): one whose asks keep coming to
        nothing is skipped on most steps but a prompt's forward."""
        if getattr(self.policy, "loop", None) is None:  # no policy, or one that does not learn its prices
            return self._propose(context, limits)
        now = self.clock()
        if self._step is not None:
            start, drafted, fed = self._step
            ok = self._forwards == 1 and fed == 1
            if ok:
                self.policy.observe_step(drafted, now - start, follows=self._timed)  # type: ignore[union-attr]
            self._timed = ok
        self._forwards = 0
        self._may_skip, self._skipped = limits.fed <= 1, False
        draft = self._propose(context, limits)
        if self.asks is not None and not self._skipped and not len(draft.tree):  # asking that came to nothing
            self.asks.timed(self.clock() - now, self.policy.loop.plain_seconds)  # type: ignore[union-attr]
        self._may_skip = False
        self._step = (now, len(draft.tree), limits.fed) if limits.carried <= 1 else None
        if self._step is None:
            self._timed = False
        return draft

    def _propose(self, context: np.ndarray, limits: DraftLimits) -> Draft:
        looked, self._looked = self._looked, None
        depth = limits.depth
        if depth <= 0:
            return Draft()
        budget = self.tree_budget if limits.budget is None else limits.budget
        if self.policy is None:
            tree = TokenTree()
            for _, name, prop in self._proposals(context, depth):
                tree.merge(prop, name, budget=budget, max_depth=depth)
                if not self.merge or self.chain_only or len(tree) >= budget:
                    break
            return Draft(tree)
        same = looked is not None and looked[:2] == (len(context), depth)  # chance() looked at this context
        found = looked[2] if same and looked is not None else None
        share = limits.share
        if limits.confident is not None and share is not None and share < limits.confident[1]:
            if not same:
                found, same = self._find(context, depth, 0), True
            if found is not None and self._chance(found[1], found[2]) >= limits.confident[0]:
                share = limits.confident[1]
        policy = self.policy.at_load(limits.carried, share)
        if not policy.may_pay(depth):
            return Draft()  # not even a certain draft pays at this load: no (further) lookup
        if self.merge and not self.chain_only:
            merged = Candidates()
            for _, name, prop in self._proposals(context, depth):
                merged.add(prop, name, budget=policy.max_nodes, max_depth=depth)
                if len(merged) >= policy.max_nodes:
                    break
            return Draft(*cut(policy, merged, max_depth=depth, budget=budget, fed=limits.fed,
                              awaited=limits.first_token_awaited))
        start = len(self.drafters) if same and found is None else 0  # chance() found nothing: no second search
        while (hit := found or self._find(context, depth, start)) is not None:
            found = None
            j, name, prop = hit
            # a chance chain whose first node cannot pay is told so before it becomes candidates (as plan would)
            if limits.fed <= 1 and prop.is_chain and policy.hopeless_chain(
                    policy_key(name, prop.match_length), first_prior(prop), max_depth=depth,
                    awaited=limits.first_token_awaited):
                tree, keys = TokenTree(), []
            else:
                cand = Candidates()
                cand.add(prop, name, budget=policy.max_nodes, max_depth=depth)
                tree, keys = cut(policy, cand, max_depth=depth, budget=budget, fed=limits.fed,
                                 awaited=limits.first_token_awaited)
            if self.asks is not None:
                self.asks.outcome(j, len(tree) > 0)
            if len(tree):
                return Draft(tree, keys)
            start = j + 1
        return Draft()

    def chance(self, context: np.ndarray, limits: DraftLimits) -> float:
        """P(the first token of this step's draft is accepted), before its price is known: the first source with
        a proposal for ``context`` and the policy's estimate for its first node. 0.0 without a policy, when no
        source proposes, or when that first token would not pay for its own row even at the best price the step
        can give (the whole fixed part saved: share 1). The proposal is kept for the next :meth:`propose` on the
        same context and depth."""
        found = self._find(context, limits.depth, 0) if limits.depth > 0 and self.policy is not None else None
        self._looked = (len(context), limits.depth, found)
        if found is None or self.policy is None:
            return 0.0
        q = self._chance(found[1], found[2])
        return q if 1.0 + q > self.policy.at_load(limits.carried, 1.0).costs[1] else 0.0

    def _chance(self, name: str, proposal: TokenTree) -> float:
        assert self.policy is not None
        prior = first_prior(proposal)
        key = policy_key(name, proposal.match_length)
        return float(self.policy.conditionals([-1], [key], None if np.isnan(prior) else [prior])[0])

    def _proposals(self, context: np.ndarray, depth: int, start: int = 0) -> Iterator[tuple[int, str, TokenTree]]:
        """(drafter index, name, proposal) in priority order from ``start``, cleaned for the verifier; lazily, so
        a drafter after the one that wins the step is never asked."""
        for j in range(start, len(self.drafters)):
            d = self.drafters[j]
            # a drafter with a budget of its own (a draft model's PolicyGate, whose meter times every ask) is
            # always asked; another whose drafts keep being dropped is asked within the asking budget only
            if self._may_skip and self.asks is not None and not getattr(d, "own_budget", False) \
                    and not self.asks.ask(j):
                self._skipped = True
                self._idle(self._last_key.get(j))
                continue
            prop = d.propose(context, depth)
            if prop is None or len(prop) == 0:
                if self._may_skip and self.asks is not None:
                    self.asks.outcome(j, False)  # asked for nothing: as fruitless as a dropped proposal
                continue
            if self.chain_only:
                prop = prop.first_path()
            if self.vocab_size is not None:
                prop = prop.within_vocab(self.vocab_size)
            self._last_key[j] = policy_key(d.name, prop.match_length)
            yield j, d.name, prop

    def _idle(self, key: str | None) -> None:
        """A step that left a drafter unasked counts as idle for the key its last proposal was learned under
        (:func:`~redraft.policy.candidates.policy_key`: its source and match length), so that key's probes still
        come on time; the drafter's other keys wait (each key counting every skipped step would probe each at the
        whole budget's rate)."""
        assert self.policy is not None
        if key is not None and key in self.policy.idle:
            self.policy.skip(key)

    def _find(self, context: np.ndarray, depth: int, start: int) -> tuple[int, str, TokenTree] | None:
        """The first drafter from ``start`` on with a proposal: (its index, its name, the proposal)."""
        assert self.policy is not None
        return next(self._proposals(context, depth, start), None)

    # ---- learning ---------------------------------------------------------------------------------------------

    def observe(self, draft: Draft, path: Sequence[int], emitted: int,
                judged: int | None = None) -> dict[str, SourceOutcome]:
        """Feed one verify forward's outcome to the policy and to every drafter (its ``observe``, so its guard).

        Args:
            draft: the verified :class:`Draft` (empty for a draft-free forward).
            path: accepted node indices of ``draft.tree`` whose tokens were emitted.
            emitted: tokens the forward emitted (accepted + bonus, fewer when the output ended inside the draft).
            judged: None, or the draft depth the output reached when it was cut short (EOS, a stop string, a limit,
                a near-tie, vLLM verifying only a prefix): deeper nodes count neither as proposed nor as depth.
        Returns:
            drafter name -> :class:`SourceOutcome`, for every drafter.
        """
        tree = draft.tree
        self._forwards += 1
        if self.policy is not None:
            observe_outcomes(self.policy, tree, draft.keys, path, judged)
        proposed: dict[str, int] = {}
        for s, depth in zip(tree.sources, tree.depths, strict=True):
            if judged is None or depth <= judged:
                proposed[s] = proposed.get(s, 0) + 1
        accepted: dict[str, int] = {}
        for i in path:
            accepted[tree.sources[i]] = accepted.get(tree.sources[i], 0) + 1
        out: dict[str, SourceOutcome] = {}
        for d in self.drafters:
            p, a = proposed.get(d.name, 0), accepted.get(d.name, 0)
            guard = getattr(d, "guard", None)
            before = guard.pauses if guard is not None else 0
            d.observe(p, a, emitted)
            out[d.name] = SourceOutcome(p, a, guard is not None and guard.pauses > before)
        return out
