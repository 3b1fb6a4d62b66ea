"""SpeculationPolicy: per step, how many of the drafted nodes to verify, from the cost curve and learned acceptance.

Per candidate node i (source s, depth d) the policy estimates q(i) = P(i accepted | parent accepted):
- with no prior from the source: the learned level estimate of (s, d) (:class:`AcceptanceTracker`);
- with a prior p(i) from the source (:mod:`redraft.policy.priors`): the same Beta posterior but centred on the
  node's prior scaled by what was learned above it, (successes_{s,d} + w * p'(i) * r(parent)) / (trials_{s,d} + w),
  where r(j) = min(1, q(j) / p'(j)) below level 1 (r = 1 at level 1, which says whether the lookup found the right
  place at all, a different question from what follows a right first token): the source's self-knowledge decides while
  evidence is thin and recent outcomes decide once there are some. Without r a deep level, tested only when every
  level above it was accepted and so almost never on chance drafts, kept its prior: a 2-4-token n-gram match's
  rule-of-succession prior (0.8-0.97 per level) made 32-token chance drafts look worth verifying on novel text
  when level 1 was right 20-30% of the time and the levels below it about half the time. With r the learned
  shortfall at the levels above carries down, as the level estimates without priors shrink toward the level
  above (:class:`AcceptanceTracker`); a replay's learned estimates match its prior (r ~ 1) and keep it;
- siblings split their parent's chance by stick-breaking: the r-th sibling gets its own estimate times the chance
  that every earlier sibling failed (p'(i) is the sibling's prior share of what the earlier ones left), so the
  siblings' probabilities never sum past 1.
Then :func:`~redraft.policy.select.select_nodes` keeps the subtree maximising expected tokens / c(size).

Exploration: a source whose candidates were dropped on every step is re-tried with a probe, the draft of 1..4
tokens along its first path whose expected net cost c(d) - E(d) is lowest, once its cost should nothing be accepted,
c(d) - 1, spread over the idle steps (steps in which it had a candidate that was dropped) falls under
``probe_overhead`` of a plain step: a useless source costs at most that share of the run. A probe is exactly its
path (never extended by the selection: the source's deeper levels are untested and their estimates optimistic).
Its counts decay with every outcome, so after a probe that succeeds the failures before it weigh less and the
source drafts again within a step or two. On a flat curve (a GPU) probes are nearly free and come at once; on a
steep one they are rare. Idle steps themselves teach nothing:
forgetting on them would re-try a useless source every few steps on its prior alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from redraft.defaults import PROBE_MAX, PROBE_OVERHEAD, PROMPT_DRAFT_CHANCE
from redraft.policy.acceptance import AcceptanceTracker
from redraft.policy.priors import node_depths
from redraft.policy.select import Selection, path_probabilities, select_nodes
from redraft.pricing.curve import CostCurve
from redraft.pricing.draft import chain_floor, marginal_costs, probe_cost
from redraft.pricing.loop import LoopPrices


class SpeculationPolicy:
    """Chooses each step's verified draft from the measured cost curve and per-source acceptance.

    Args:
        curve: the verify cost curve c(n) measured here (:func:`redraft.pricing.cache.cached_cost_curve`).
        max_nodes: most draft nodes in one verify forward (the tree budget; also the deepest chain).
        tracker: the acceptance estimates (default: a fresh :class:`AcceptanceTracker` over ``max_nodes`` levels).
        probe_overhead: the share of a plain step an idle source's probes may cost on average (> 0).
        probe_max: longest probe in tokens (the curve picks the cheapest length up to this).
        min_gain: a draft must beat a plain step's rate by more than this fraction (0 = any gain).
        prompt_chance: the forward whose first token a streaming client awaits (the one that carries the prompt,
            or what a prefix cache left of it: ``plan(awaited=True)``) verifies a draft only when its likeliest
            first token's chance is at least this (0..1; 0 = price it like any draft). Each drafted row there delays
            the first token, which the expected-tokens-per-cost rule does not count; vLLM, SGLang and llama.cpp
            never draft in a prefill, and here only a likely-right draft (a replayed prompt's) is carried. A client
            awaiting the whole answer is served by the price alone.
        learn_prices: rescale the curve's draft part by the loop's own step times (:class:`LoopPrices`, fed by
            :meth:`observe_step`): the price a draft has in this loop, its planning and the step after it included,
            where the bare curve times forwards alone. For one sequence's own loop (the engine); a step shared with
            other sequences is priced at its load instead (:class:`redraft.policy.load.LoadAwarePolicy`).
    Raises:
        ValueError: max_nodes < 1, probe_overhead <= 0, probe_max < 1, min_gain < 0 or prompt_chance outside 0..1.
    """

    def __init__(self, curve: CostCurve, *, max_nodes: int = 64, tracker: AcceptanceTracker | None = None,
                 probe_overhead: float = PROBE_OVERHEAD, probe_max: int = PROBE_MAX, min_gain: float = 0.0,
                 prompt_chance: float = PROMPT_DRAFT_CHANCE, learn_prices: bool = False) -> None:
        if max_nodes < 1 or not probe_overhead > 0 or probe_max < 1 or min_gain < 0 or not 0 <= prompt_chance <= 1:
            raise ValueError(f"SpeculationPolicy needs max_nodes >= 1, probe_overhead > 0, probe_max >= 1, "
                             f"min_gain >= 0 and 0 <= prompt_chance <= 1; got {max_nodes}, {probe_overhead}, "
                             f"{probe_max}, {min_gain}, {prompt_chance}")
        self.curve = curve
        self.costs = curve.table(max_nodes)
        self.max_nodes = max_nodes
        self.tracker = tracker if tracker is not None else AcceptanceTracker(max_nodes)
        self.probe_overhead, self.probe_max, self.min_gain = probe_overhead, probe_max, min_gain
        self.prompt_chance = prompt_chance
        self.idle: dict[str, int] = {}  # steps since the source last had a node verified
        self.probing: set[str] = set()  # sources probed in the last plan, until their outcome is observed
        self.probe_paid: set[str] = set()  # sources whose last probe had a token accepted: probe again at once
        self._prices: dict[bytes, tuple[np.ndarray, int]] = {}  # (chain floor, shortest probe interval) per cost table
        self.loop = LoopPrices(self.costs) if learn_prices else None
        self._least: dict[str, tuple[tuple[int, bytes], float]] = {}  # least_first per source, with its key
        # _estimates per source, with its key
        self._lists: dict[str, tuple[int, tuple[list[float], list[float], list[float], list[float]]]] = {}

    def at_load(self, carried: int, share: float | None = None) -> SpeculationPolicy:
        """Price the next plan for a step already carrying ``carried`` rows (``share``: what this request's accepted
        tokens save of the step, :func:`redraft.pricing.load.load_costs`): a single stream's cost curve does not depend on
        other sequences, so nothing changes here (:class:`redraft.policy.load.LoadAwarePolicy` reprices).
        Returns self."""
        return self

    @property
    def costs(self) -> np.ndarray:
        """float64 [max_nodes + 1]: the cost table the next plan prices with, c(n) in plain steps (the curve's, or
        what :class:`LoopPrices` or a load made of it). Assign a new table to change it (not in place: the prices
        derived from it are kept per assignment)."""
        return self._costs

    @costs.setter
    def costs(self, table: np.ndarray) -> None:
        self._costs = table
        self._costs_key: bytes | None = None  # its bytes, taken when first needed

    def _table_key(self) -> bytes:
        """The cost table's bytes (what the per-table prices are kept under), once per assignment."""
        if self._costs_key is None:
            self._costs_key = self._costs.tobytes()
        return self._costs_key

    def observe_step(self, draft: int, seconds: float, *, follows: bool = True) -> None:
        """One step of this policy's own loop: ``draft`` tokens verified (0 = a plain step) in ``seconds`` of wall
        time from its plan to the next plan; ``follows`` False when the step before it was not observed. With
        ``learn_prices`` the cost table is rescaled when the loop's prices move (:class:`LoopPrices`); otherwise
        nothing happens."""
        if self.loop is not None and self.loop.observe(draft, seconds, follows=follows):
            self.costs = self.loop.prices()

    def may_pay(self, depth: int) -> bool:
        """Whether a draft of at most ``depth`` tokens can pay at the price set by :meth:`at_load`; False lets the
        caller skip its drafters for the step. A single stream never skips (a probe may always run);
        :class:`redraft.policy.load.LoadAwarePolicy` answers from the step's load."""
        return True

    def conditionals(self, parents: Sequence[int], sources: Sequence[str],
                     priors: Sequence[float] | None = None, *, floor: np.ndarray | None = None) -> np.ndarray:
        """float64 [N]: q(i) = P(node i accepted | parent accepted) per candidate node (see the module notes).

        Args:
            parents: parent index per node (-1 = child of the root), parents first.
            sources: the drafter name per node.
            priors: per node, the source's own P(accept | parent), or NaN / None where it has none.
            floor: for a chain only (``parents`` = -1, 0, 1, ...): :func:`~redraft.pricing.draft.chain_floor` of
                the step's cost table. The first node below the probe depth whose chance of being reached is at
                most the floor at its depth gets 0, and so does every node after it (no cut that deep can pay),
                without being estimated.
        """
        # Python floats and lists in the loop (per-element numpy indexing costs more than the arithmetic here);
        # the operations and their order are those of float64, so the values are the same
        n = len(parents)
        depths = list(range(1, n + 1)) if list(parents) == list(range(-1, n - 1)) else node_depths(parents).tolist()
        est = {s: self._estimates(s) for s in set(sources)}
        levels = {s: e[0] for s, e in est.items()}
        counts = {s: (e[1], e[2]) for s, e in est.items()}
        weights = {s: e[3] for s, e in est.items()}
        prior = None if priors is None else [math.nan if p is None else float(p) for p in priors]
        used: dict[int, float] = {}  # prior share taken by earlier siblings, per parent
        left: dict[int, float] = {}  # chance that every earlier sibling failed, per parent
        scale = [1.0] * len(parents)  # learned estimate / prior along the path, at most 1 (see the module notes)
        cond = [0.0] * len(parents)
        stop = floor.tolist() if floor is not None else None
        reach = 1.0  # a chain's chance of reaching node i
        for i, (p, s) in enumerate(zip(parents, sources, strict=True)):
            lvl = min(depths[i], len(levels[s])) - 1
            above = 1.0 if p < 0 else scale[p]
            if prior is not None and not math.isnan(prior[i]):
                share = min(1.0, max(0.0, prior[i]) / max(1e-12, 1.0 - used.get(p, 0.0)))
                used[p] = used.get(p, 0.0) + max(0.0, prior[i])
                succ, trials = counts[s]
                w = weights[s][lvl]
                q = (succ[lvl] + w * share * above) / (trials[lvl] + w)
                # level 1 says whether the lookup found the right place at all; what follows a right first token
                # is another question, so only deeper levels' shortfall carries down
                scale[i] = min(1.0, q / share) if share > 0 and p >= 0 else above
            else:
                q = levels[s][lvl]
                scale[i] = above
            fail = left.get(p, 1.0)
            cond[i] = q * fail
            left[p] = fail * (1.0 - q)
            if stop is not None:
                reach *= cond[i]
                if i >= self.probe_max and reach <= stop[min(i + 1, len(stop) - 1)]:
                    cond[i] = 0.0
                    break
        return np.array(cond, dtype=np.float64)

    def _estimates(self, source: str) -> tuple[list[float], list[float], list[float], list[float]]:
        """The tracker's estimates of ``source`` as Python lists: its conditionals, successes, trials and prior
        weights per level, read once per outcome recorded (:meth:`AcceptanceTracker.updates`), not once per plan.
        The lists stop one level past the deepest level ever tested (at most the tracker's ``max_depth``): every
        level after that one has its values (never tried: no counts, the whole prior weight, the conditional of
        the last tested level carried on), so a level d reads index min(d, len) - 1."""
        tr = self.tracker
        key = tr.updates(source)
        hit = self._lists.get(source)
        if hit is None or hit[0] != key:
            succ, trials = tr.counts(source)
            tested = np.flatnonzero(trials)
            k = min(tr.max_depth, int(tested[-1]) + 2 if len(tested) else 1)
            hit = self._lists[source] = (key, (tr.conditional(source, k).tolist(), succ[:k].tolist(),
                                               trials[:k].tolist(), tr.weights(source)[:k].tolist()))
        return hit[1]

    def plan(self, parents: Sequence[int], sources: Sequence[str], priors: Sequence[float] | None = None, *,
             max_depth: int | None = None, budget: int | None = None, fed: int = 1,
             awaited: bool = False) -> Selection:
        """The nodes of this step's candidate tree to verify. Call once per step, before the verify forward.

        Args:
            parents, sources, priors: the candidate tree (see :meth:`conditionals`); empty = nothing drafted.
            max_depth: nodes deeper than this are never kept (e.g. the tokens left to generate).
            budget: most nodes kept (default and cap: ``max_nodes``).
            fed: tokens the verify forward carries before the draft (the root; at the first step the whole
                prompt). With m = fed - 1 > 0 a draft of n costs what it adds to that forward, c(m + n) - c(m), on
                top of one plain step (:meth:`step_costs`): a prefill of a few hundred tokens is past the curve's
                flat start, so 32 chance draft tokens on it cost ~2 plain steps where c(32) says 1.5, and only a
                draft that is likely right (a replay's) is worth it there.
            awaited: a streaming client waits for this forward's first token: only a draft whose first token's
                chance reaches ``prompt_chance`` is carried at all (no probe either).
        Returns:
            :class:`Selection`; keep ``selection.nodes`` (with :func:`~redraft.policy.select.subtree_parents`).
            A chain is kept past the best single forward's depth (up to whole) when verifying it in forwards of that
            depth would cost more per expected token (``_whole_chain``: a replay's tail in one forward).
            Sources with no kept node have their idle count advanced (towards a probe).
        """
        if len(parents) == 0:
            return Selection([], 1.0, 1.0)
        n = len(parents)
        # one source's chain (an n-gram or corpus draft): its nodes past the chain floor cannot be in this forward,
        # so a draft that is cut (most chance drafts on a steep curve) is judged on its first few nodes alone
        chain = fed <= 1 and sources.count(sources[0]) == n and list(parents) == list(range(-1, n - 1))
        whole = parents, sources
        if chain and self.hopeless_chain(sources[0], None if priors is None else priors[0], max_depth=max_depth,
                                         awaited=awaited):
            return Selection([], 1.0, 1.0)
        cond = self.conditionals(parents, sources, priors, floor=self.chain_floor() if chain else None)
        if chain and (looked := max(int(np.flatnonzero(cond)[-1]) + 1 if cond.any() else 0,
                                    min(n, self.probe_max))) < n:
            parents, sources, cond = parents[:looked], sources[:looked], cond[:looked]
        if max_depth is not None:
            cond = np.where(node_depths(parents) > max_depth, 0.0, cond)
        if awaited and self.prompt_chance > 0:
            first = [c for c, p in zip(cond.tolist(), parents, strict=True) if p < 0]
            if max(first, default=0.0) < self.prompt_chance:
                return Selection([], 1.0, 1.0)  # not counted as idle: the source was not judged on its merits
        budget = self.max_nodes if budget is None else min(budget, self.max_nodes)
        sel = select_nodes(parents, cond, self.step_costs(fed), budget=budget, min_gain=self.min_gain)
        if sel.nodes and len(parents) < n:  # it drafts: the later forwards of the whole chain count (_whole_chain)
            parents, sources = whole
            cond = self.conditionals(parents, sources, priors)
            if max_depth is not None:
                cond = np.where(node_depths(parents) > max_depth, 0.0, cond)
        prob = path_probabilities(parents, cond)
        sel = self._whole_chain(parents, prob, sel, fed, budget)
        chosen = {sources[i] for i in sel.nodes}
        nodes, probes = set(sel.nodes), []
        for s in dict.fromkeys(sources):
            paid = s in self.probe_paid
            if s in chosen or (self.idle.get(s, 0) < 1 and not paid):
                continue  # it drafts now, or it drafted last time it had a candidate: nothing to probe
            path = self._probe_path(parents, sources, prob, s, max_depth)
            # after a probe that paid, the next comes at once: a source that turned useful is trusted again
            # within a few steps, while a useless one still costs at most probe_overhead
            due = paid or self.idle.get(s, 0) >= max(1, self._probe_interval(path))
            if path and due and len(nodes | set(path)) <= budget:
                nodes |= set(path)  # exactly the probe: extending it on the source's untested deeper levels
                probes.append(s)    # would spend more than the probe budget on a source that is likely useless
        if probes:
            keep = sorted(nodes)
            sel = Selection(keep, 1.0 + float(prob[keep].sum()), float(self.costs[len(keep)]), probes)
        kept = {sources[i] for i in sel.nodes}
        self.probing = set(probes)
        for s in dict.fromkeys(sources):
            if s in kept:
                self.idle[s] = 0
            else:
                self.idle[s] = self.idle.get(s, 0) + 1
            if s in chosen or s not in kept:
                self.probe_paid.discard(s)  # drafting on its own estimate again, or dropped: probes wait again
        return sel

    def _whole_chain(self, parents: Sequence[int], prob: np.ndarray, sel: Selection, fed: int,
                     budget: int) -> Selection:
        """For a chain candidate: a wider first forward than the selected depth, when the chain is then verified
        with more expected tokens per unit of verify time than in forwards of the selected depth alone.

        The selected depth d maximises one forward's rate, which assumes the next forwards repeat it; a chain of L
        nodes verified d at a time ends in a short forward (a replay of 128 tokens as 41 + 64 + 20), and a
        forward's cost is not proportional to its width (``c(0) = 1``). Each plan covers the same L nodes: a first
        forward of D nodes, then forwards of d; forward j happens only if the node before it (the previous
        forward's bonus token) is reached, so its cost and tokens count with that probability. D is tried at d, at
        the curve's measured sizes between d and L (the curve is linear in between, so the best D lies on one of
        them or at an end) and at L. Where acceptance decays (a chance draft) the later forwards are unlikely and d
        stays; where the chain is likely right to its end (a replay) the first forward widens when the curve says
        that is cheaper per token. Trees are left to the selection.
        """
        d = len(sel.nodes)
        n = min(len(parents), budget)
        if d == 0 or n <= d or not np.array_equal(np.asarray(parents[:n]), np.arange(-1, n - 1)):
            return sel
        length = n
        while length > d and prob[length - 1] <= 0.0:  # nodes cut by max_depth have probability 0
            length -= 1
        if length <= d:
            return sel
        first, later = self.step_costs(fed).tolist(), self.costs.tolist()
        sizes = [d] + [int(s) for s in self.curve.sizes if d < s < length] + [length]
        reached = prob[:length].tolist()
        total = np.concatenate(([0.0], np.cumsum(prob[:length]))).tolist()  # total[j]: expected tokens of nodes < j
        best, best_rate = d, -1.0
        for width in sizes:
            tokens, cost = 1.0 + total[width], first[width]
            for start in range(width + 1, length, d + 1):
                reach, size = reached[start - 1], min(d, length - start)
                tokens += reach + total[start + size] - total[start]
                cost += reach * later[size]
            if tokens / cost > best_rate * (1 + 1e-9):
                best, best_rate = width, tokens / cost
        if best == d:
            return sel
        return Selection(list(range(best)), 1.0 + float(prob[:best].sum()), float(first[best]))

    def chain_floor(self) -> np.ndarray:
        """:func:`~redraft.pricing.draft.chain_floor` of the cost table now (one per table: under load the table
        changes with the step's rows, :class:`~redraft.policy.load.LoadAwarePolicy`)."""
        return self._table_prices()[0]

    def _table_prices(self) -> tuple[np.ndarray, int]:
        """(chain floor, fewest idle steps before any probe) of the cost table now, computed once per table."""
        key = self._table_key()
        prices = self._prices.get(key)
        if prices is None:
            if len(self._prices) >= 64:
                self._prices.clear()
            shortest = min(self._probe_interval(list(range(n)))
                           for n in range(1, min(self.probe_max, len(self.costs) - 1) + 1))
            prices = self._prices[key] = (chain_floor(self.costs), max(1, shortest))
        return prices

    def hopeless_chain(self, source: str, first_prior: float | None = None, *, max_depth: int | None = None,
                       awaited: bool = False) -> bool:
        """Whether :meth:`plan` of a one-source chain from ``source`` (its key; ``fed`` 1) is a plain step, told from
        its first node alone (``first_prior``: None or NaN for none), the idle count then advanced as plan would: no
        node of a chain is likelier than its first, so if the first's chance is at most the chain floor at depth 1
        no cut pays (:func:`~redraft.pricing.draft.chain_floor`), and no probe is due (none paid last, fewer idle
        steps than the cheapest probe's interval). Most chance drafts of novel text end here in O(1): plan asks it
        first, the draft planner before it builds candidates."""
        floor, shortest = self._table_prices()
        if source in self.probe_paid or self.idle.get(source, 0) >= shortest or (max_depth is not None
                                                                                  and max_depth < 1):
            return False
        levels, succ, trials, weights = self._estimates(source)
        prior = None if first_prior is None else float(first_prior)
        if prior is None or math.isnan(prior):
            first = levels[0]
        else:  # conditionals' estimate of a root child, in the same operations
            share = min(1.0, max(0.0, prior) / max(1e-12, 1.0))
            first = (succ[0] + weights[0] * share * 1.0) / (trials[0] + weights[0])
        if (first > floor[1] and first > self.least_first(source)) or (
                awaited and self.prompt_chance > 0 and first < self.prompt_chance):
            return False  # it may pay, or plan's prompt rule applies (no idle step counted there)
        self.probing = set()
        self.idle[source] = self.idle.get(source, 0) + 1
        return True

    def least_first(self, source: str) -> float:
        """The least chance of its first node at which a chain of ``source`` can pay at the price now: with u_d
        the upper bound of its level-d estimate (:meth:`AcceptanceTracker.upper`), node i of the chain is reached
        with chance at most q1 U(i), U(i) = u_2 ... u_i, so a cut at n yields at most 1 + q1 S(n) tokens, S(n) =
        U(1) + ... + U(n), and beats a plain step by ``min_gain`` only when q1 > ((1 + min_gain) c(n) - 1) / S(n)
        for some n. The minimum over n, kept per source until its estimates or the cost table change: on novel
        text a chance draft whose first token is likely enough but whose deeper levels are not (a short n-gram
        match) is told hopeless here, without estimating its nodes."""
        key = (self.tracker.updates(source), self._table_key())
        hit = self._least.get(source)
        if hit is not None and hit[0] == key:
            return hit[1]
        up = self.tracker.upper(source)
        n = len(self.costs) - 1
        reach = np.ones(n)
        reach[1:] = np.cumprod(up[np.minimum(np.arange(1, n), len(up) - 1)])
        need = ((1.0 + self.min_gain) * self.costs[1:] - 1.0) / np.cumsum(reach)
        least = float(need.min()) if n else math.inf
        self._least[source] = (key, least)
        return least

    def step_costs(self, fed: int = 1) -> np.ndarray:
        """float64 [max_nodes + 1]: the cost in plain steps of verifying n = 0..max_nodes draft tokens in a forward
        that carries ``fed`` tokens before them: c(n) for fed = 1, else 1 + c(fed - 1 + n) - c(fed - 1) (the draft's
        marginal cost over the forward the pending tokens need anyway, counted against a plain step's 1)."""
        if int(fed) <= 1:
            return self.costs
        return marginal_costs(self.curve, fed, self.max_nodes)

    def skip(self, source: str) -> None:
        """A step in which ``source`` was not asked to draft because its drafts would not pay (a draft model's own
        cost, :class:`redraft.policy.gate.PolicyGate`): counted as an idle step, so its probes still come."""
        self.idle[source] = self.idle.get(source, 0) + 1
        self.probe_paid.discard(source)

    def probe_soon(self, source: str) -> None:
        """Probe ``source`` at its next candidate, whatever its idle count (a new draft model: one probe tells
        more than its prior, and it is worth the one draft it costs)."""
        self.probe_paid.add(source)

    def depth(self, source: str, length: int, priors: Sequence[float] | None = None, *,
              max_depth: int | None = None) -> int:
        """How many leading tokens of a ``length``-token chain from ``source`` to verify (0 = a plain step)."""
        parents = list(range(-1, length - 1))
        return len(self.plan(parents, [source] * length, priors, max_depth=max_depth))

    def observe(self, source: str, proposed_depth: int, accepted: int) -> None:
        """After the verify forward: the source's kept draft reached ``proposed_depth`` levels and its first
        ``accepted`` levels were accepted (:func:`~redraft.policy.select.source_outcomes` computes both for a
        tree). ``proposed_depth`` 0 is ignored (:meth:`plan` already accounted for a dropped source)."""
        self.tracker.observe(source, proposed_depth, accepted)
        if source in self.probing:
            self.probing.discard(source)
            if accepted > 0:
                self.probe_paid.add(source)
            else:
                self.probe_paid.discard(source)

    def _probe_path(self, parents, sources, prob, source: str, max_depth: int | None) -> list[int]:
        """The probe for ``source``: its first node's ancestors, then its first children, at most the probe
        length deep, cut where the expected net cost c(d) - E(d) is lowest."""
        limit = min(self.probe_max, self.max_nodes, self.probe_max if max_depth is None else max_depth)
        first = next((i for i, s in enumerate(sources) if s == source), None)
        if first is None:
            return []
        path = []
        node = first
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        if len(path) > limit:  # the source's first node lies deeper than a probe reaches
            return []
        while len(path) < limit:
            nxt = next((j for j in range(path[-1] + 1, len(parents))
                        if parents[j] == path[-1] and sources[j] == source), None)
            if nxt is None:
                break
            path.append(nxt)
        net = self.costs[1:len(path) + 1] - (1.0 + np.cumsum(prob[path]))
        return path[:int(np.argmin(net)) + 1]

    def _probe_interval(self, path: list[int]) -> int:
        """Idle steps before a probe along ``path``: its cost should nothing be accepted, c(d) - 1, over
        ``probe_overhead``. The worst case, not the expected cost: an idle source's estimate never falls below its
        prior's share (a few percent), so the expected cost would undercount what a useless source's probes cost."""
        return math.ceil(probe_cost(self.costs, len(path)) / self.probe_overhead)
