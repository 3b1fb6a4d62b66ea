"""A chain judged only as deep as it can pay: :func:`redraft.pricing.draft.chain_floor` and the policy's early stop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.decoding.planner import DraftLimits, DraftPlanner
from redraft.policy import SpeculationPolicy, select_nodes, succession_priors
from redraft.policy.candidates import Candidates, cut, first_prior, observe_outcomes, proposal_priors
from redraft.pricing import CostCurve
from redraft.pricing.draft import chain_floor
from redraft.tree import TokenTree

# llama.cpp on the bundled Q4_1, 1 thread (a row costs most of a step), a curve with a dip, and a GPU-like flat one
STEEP = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 64), (1.0, 1.81, 2.42, 3.0, 3.6, 5.9, 10.8, 19.7, 40.2))
DIP = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48, 64), (1.0, 1.68, 2.12, 1.57, 1.8, 2.34, 2.29, 2.52, 3.39, 4.11))
FLAT = CostCurve((0, 64), (1.0, 1.2))


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


@pytest.mark.parametrize("curve", [STEEP, DIP, FLAT])
def test_the_floor_is_the_least_price_per_node_of_going_on(curve):
    costs = curve.table(48)
    floor = chain_floor(costs)
    assert floor[0] == np.inf and len(floor) == 49
    for k in range(1, 49):
        brute = min((costs[j] - costs[k - 1]) / (j - k + 1) for j in range(k, 49))
        assert floor[k] == pytest.approx(brute, rel=1e-12)


def twin_policies(curve: CostCurve, seed: int) -> tuple[SpeculationPolicy, SpeculationPolicy]:
    """Two policies with the same history; the second estimates every node (its chain floor is 0, so neither the
    early stop nor the first-node shortcut applies)."""
    pols = (SpeculationPolicy(curve, max_nodes=48), SpeculationPolicy(curve, max_nodes=48))
    rng = np.random.default_rng(seed)
    first, then = rng.uniform(0.05, 1.0), rng.uniform(0.2, 1.0)
    for _ in range(int(rng.integers(0, 40))):
        a = 0
        if rng.random() < first:
            a = 1
            while a < 48 and rng.random() < then:
                a += 1
        for p in pols:
            p.observe("ngram/2", 48, a)
    pols[1]._table_prices = lambda: (np.zeros(49), 1)  # type: ignore[method-assign]
    return pols


@pytest.mark.parametrize("curve", [STEEP, DIP, FLAT])
@pytest.mark.parametrize("seed", range(16))
def test_stopping_early_changes_no_plan(curve, seed):
    """Plans (the verified nodes, probes included) and idle counts over 60 steps of chance drafts are those of a
    policy that estimates every node of the chain."""
    fast, full = twin_policies(curve, seed)
    rng = np.random.default_rng(seed + 100)
    for _ in range(60):
        n = int(rng.integers(1, 49))
        prior = succession_priors(chain(n), int(rng.integers(1, 9))) if rng.random() < 0.7 else None
        a, b = (p.plan(chain(n), ["ngram/2"] * n, prior) for p in (fast, full))
        assert a.nodes == b.nodes and a.probes == b.probes
        assert a.expected_tokens == pytest.approx(b.expected_tokens, rel=1e-9)
        assert fast.idle == full.idle and fast.probe_paid == full.probe_paid and fast.probing == full.probing
        accepted = int(rng.integers(0, len(a.nodes) + 1)) if a.nodes else 0
        for p in (fast, full):
            if a.nodes:
                p.observe("ngram/2", len(a.nodes), accepted)


def test_a_chance_draft_is_estimated_only_a_few_nodes_deep_on_a_steep_curve():
    pol = SpeculationPolicy(STEEP, max_nodes=48)
    for i in range(30):  # level 1 right a third of the time, a couple of tokens after it
        pol.observe("ngram/2", 48, 2 if i % 3 == 0 else 0)
    prior = succession_priors(chain(48), 2)
    cond = pol.conditionals(chain(48), ["ngram/2"] * 48, prior, floor=pol.chain_floor())
    assert 0 < np.count_nonzero(cond) <= 8
    full = pol.conditionals(chain(48), ["ngram/2"] * 48, prior)
    assert np.count_nonzero(full) == 48
    np.testing.assert_array_equal(cond[:np.count_nonzero(cond)], full[:np.count_nonzero(cond)])
    # a replay's chain is likely right to its end: nothing is left out
    sure = SpeculationPolicy(STEEP, max_nodes=48)
    for _ in range(10):
        sure.observe("corpus/64", 48, 48)
    deep = sure.conditionals(chain(48), ["corpus/64"] * 48, succession_priors(chain(48), 64), floor=sure.chain_floor())
    assert np.count_nonzero(deep) == 48


def test_a_hopeless_chance_draft_is_judged_on_its_first_node_and_still_probed():
    """A source right a tenth of the time at level 1: its plans are plain steps decided without estimating the
    chain, and its probes still come at the interval the cheapest probe allows."""
    pol = SpeculationPolicy(STEEP, max_nodes=48)
    for _ in range(20):
        pol.observe("ngram/1", 48, 0)
    calls = []
    real = pol.conditionals

    def counting(parents, *args, **kw):
        calls.append(len(parents))
        return real(parents, *args, **kw)

    pol.conditionals = counting  # type: ignore[method-assign]
    plans = [pol.plan(chain(48), ["ngram/1"] * 48, succession_priors(chain(48), 1)) for _ in range(200)]
    probes = [i for i, s in enumerate(plans) if s.probes]
    assert 2 <= len(probes) <= 10 and all(not s.nodes for s in plans if not s.probes)
    assert len(calls) <= 50  # the first node alone decided most steps: the chain was estimated on few of them


@settings(max_examples=200, deadline=None)
@given(outcomes=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), max_size=60),
       n=st.integers(1, 48), match=st.one_of(st.none(), st.integers(1, 9)), scale=st.sampled_from([1.0, 1.6, 3.0]),
       gain=st.sampled_from([0.0, 0.1]))
def test_a_chain_below_the_least_first_chance_never_pays(outcomes, n, match, scale, gain):
    policy = SpeculationPolicy(STEEP, max_nodes=48, min_gain=gain)
    policy.costs = 1.0 + scale * (policy.costs - 1.0)
    for depth, accepted in outcomes:
        policy.observe("ngram", depth, min(accepted, depth))
    parents, sources = chain(n), ["ngram"] * n
    priors = None if match is None else list(succession_priors(parents, match))
    cond = policy.conditionals(parents, sources, priors)
    best = select_nodes(parents, cond, policy.costs, min_gain=gain)
    if cond[0] <= policy.least_first("ngram"):
        assert not best.nodes  # the bound said no cut of this chain pays: none does


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.floats(0.5, 60.0, allow_nan=False), min_size=1, max_size=40))
def test_the_floor_equals_the_brute_force_minimum_on_any_table(costs):
    """The hull walk gives, at every depth, the least price per node over every deeper cut (the K x K minimum),
    whatever the table's shape (dips, plateaus, a cost below one's)."""
    table = np.array([1.0] + costs)
    floor = chain_floor(table)
    for k in range(1, len(table)):
        brute = min((table[j] - table[k - 1]) / (j - k + 1) for j in range(k, len(table)))
        assert floor[k] == pytest.approx(brute, rel=1e-9, abs=1e-12)


class FullEstimates(SpeculationPolicy):
    """The policy with its per-source estimates over every level the tracker holds (before they were cut one level
    past the deepest tested one)."""

    def _estimates(self, source):
        tr = self.tracker
        succ, trials = tr.counts(source)
        return (tr.conditional(source, tr.max_depth).tolist(), succ.tolist(), trials.tolist(),
                tr.weights(source).tolist())


@settings(max_examples=150, deadline=None)
@given(outcomes=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), max_size=40),
       n=st.integers(1, 48), match=st.one_of(st.none(), st.integers(1, 9)))
def test_estimates_cut_past_the_deepest_tested_level_change_no_conditional(outcomes, n, match):
    cut, full = SpeculationPolicy(STEEP, max_nodes=48), FullEstimates(STEEP, max_nodes=48)
    for depth, accepted in outcomes:
        for p in (cut, full):
            p.observe("ngram", depth, min(accepted, depth))
    parents, sources = chain(n), ["ngram"] * n
    priors = None if match is None else list(succession_priors(parents, match))
    assert len(cut._estimates("ngram")[0]) <= min(48, max((d for d, _ in outcomes), default=0) + 2)
    np.testing.assert_array_equal(cut.conditionals(parents, sources, priors),
                                  full.conditionals(parents, sources, priors))
    tree = [-1, 0, 0, 1, 2, 2][:n]  # a tree as well: depths, siblings and their shares
    tree_priors = None if priors is None else priors[:len(tree)]
    np.testing.assert_array_equal(cut.conditionals(tree, sources[:len(tree)], tree_priors),
                                  full.conditionals(tree, sources[:len(tree)], tree_priors))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), match=st.integers(0, 9), counts=st.one_of(st.none(), st.lists(st.integers(0, 5),
       min_size=12, max_size=12)), root=st.integers(0, 20))
def test_the_first_prior_is_the_proposals_first(n, match, counts, root):
    prop = TokenTree.chain(list(range(10, 10 + n)), "corpus")
    prop.match_length, prop.root_count = match, root
    prop.counts = None if counts is None else counts[:n]
    whole = proposal_priors(prop)
    first = first_prior(prop)
    assert (np.isnan(first) and whole is None) or first == whole[0]


class Chance:
    """A drafter proposing random chains (an n-gram lookup's: a match length, no counts)."""

    name = "ngram"

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def propose(self, context, max_depth):
        tree = TokenTree.chain([int(t) for t in self.rng.integers(0, 50, int(self.rng.integers(1, 20)))], self.name)
        tree.match_length = int(self.rng.integers(1, 5))
        return tree

    def observe(self, proposed, accepted, emitted):
        pass


@pytest.mark.parametrize("seed", range(8))
def test_the_planner_tells_a_hopeless_chain_before_its_candidates_as_plan_would(seed, monkeypatch):
    """Planned with the shortcut and through plan on twin policies, 80 steps of chance chains give the same drafts
    and idle counts; the shortcut builds no candidates for the chains it tells hopeless."""
    fast, slow = (SpeculationPolicy(STEEP, max_nodes=48) for _ in range(2))
    rng = np.random.default_rng(seed)
    for _ in range(int(rng.integers(0, 30))):
        depth, accepted = int(rng.integers(1, 10)), int(rng.integers(0, 3))
        for p in (fast, slow):
            p.observe("ngram/2", depth, min(depth, accepted))
    planner = DraftPlanner([Chance(seed)], fast)
    reference = Chance(seed)
    built = []
    real_add = Candidates.add
    monkeypatch.setattr(Candidates, "add", lambda self, *a, **kw: built.append(1) or real_add(self, *a, **kw))
    context = np.arange(30)
    for _ in range(80):
        draft = planner.propose(context, DraftLimits(16))
        cand = Candidates()
        real_add(cand, reference.propose(context, 16), "ngram", budget=48, max_depth=16)
        tree, keys = cut(slow, cand, max_depth=16)
        assert draft.tree.tokens == tree.tokens and draft.keys == keys
        assert fast.idle == slow.idle and fast.probe_paid == slow.probe_paid
        accepted = int(rng.integers(0, len(tree) + 1)) if len(tree) else 0
        planner.observe(draft, list(range(accepted)), accepted + 1)
        observe_outcomes(slow, tree, keys, list(range(accepted)), None)
    assert len(built) < 80  # most chains were told hopeless without candidates
