"""The speculation policy (redraft.policy): cost curve, online acceptance, source priors, node selection, probes,
the on-disk curve cache, and the shared forward-timing code on a tiny model (shapes only, no timing asserts)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from conftest import build_tiny

from redraft.policy import (
    AcceptanceTracker,
    SpeculationPolicy,
    count_priors,
    depth_limit,
    select_nodes,
    source_outcomes,
    source_priors,
    subtree_parents,
    succession_priors,
)
from redraft.policy.select import path_probabilities
from redraft.pricing import CostCurve
from redraft.pricing.cache import (
    cached_cost_curve,
    curve_key,
    curve_path,
    default_directory,
    load_curve,
    save_curve,
)
from redraft.pricing.measure import measure_cost_curve, time_forwards


def linear(slope: float, up_to: int = 64) -> CostCurve:
    """c(n) = 1 + slope * n."""
    return CostCurve((0, up_to), (1.0, 1.0 + slope * up_to))


def trained(curve: CostCurve, rate: float, steps: int = 40, **kw) -> SpeculationPolicy:
    """A policy that has seen ``steps`` 10-level drafts of the source "s", each level accepted with ``rate``."""
    pol = SpeculationPolicy(curve, **kw)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        a = 0
        while a < 10 and rng.random() < rate:
            a += 1
        pol.observe("s", 10, a)
    return pol


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def best_chain_depth(pol: SpeculationPolicy, source: str, length: int, priors=None) -> int:
    """Brute force: the depth maximising E(d) / c(d) with the policy's own conditionals (0 unless it beats 1)."""
    cond = pol.conditionals(chain(length), [source] * length, priors)
    prob = np.cumprod(cond)
    rates = [(1 + prob[:d].sum()) / pol.costs[d] for d in range(min(length, pol.max_nodes) + 1)]
    d = int(np.argmax(rates))
    return d if rates[d] > 1 else 0


# ---- cost curve ---------------------------------------------------------------------------------------------------

def test_cost_curve_interpolates_without_smoothing_and_extrapolates_with_last_slope():
    c = CostCurve((0, 1, 3, 5), (1.0, 2.0, 1.5, 2.5))  # not monotonic: 3 drafts cheaper than 1
    assert c.cost(0) == 1.0 and c.cost(1) == 2.0 and c.cost(3) == 1.5
    assert c.cost(2) == pytest.approx(1.75)
    assert c.cost(7) == pytest.approx(3.5)  # slope 0.5 past the last point
    assert list(c.table(4)) == pytest.approx([1.0, 2.0, 1.75, 1.5, 2.0])
    falling = CostCurve((0, 4, 8), (1.0, 3.0, 2.0))
    assert falling.cost(20) == 2.0  # a falling last segment is not extrapolated downwards
    assert CostCurve.flat(8).cost(100) == 1.0


def test_cost_curve_from_times_and_dict_round_trip():
    c = CostCurve.from_times([0, 2, 4], [0.1, 0.15, 0.3])
    assert c.costs == pytest.approx((1.0, 1.5, 3.0))
    assert CostCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("sizes,costs", [((), ()), ((0, 1), (1.0,)), ((1, 2), (1.0, 2.0)), ((0, 2, 2), (1, 2, 3)),
                                         ((0, 1), (1.0, -1.0)), ((0, 1), (1.0, float("nan"))), ((0, 1), (2.0, 3.0))])
def test_cost_curve_rejects_bad_input(sizes, costs):
    with pytest.raises(ValueError, match="cost curve"):
        CostCurve(sizes, costs)


# ---- acceptance tracker -------------------------------------------------------------------------------------------

def test_tracker_counts_accepted_levels_first_rejection_and_nothing_deeper():
    tr = AcceptanceTracker(8, decay=1.0)
    tr.observe("a", 5, 2)
    succ, trials = tr.counts("a")
    assert list(succ) == [1, 1, 0, 0, 0, 0, 0, 0]
    assert list(trials) == [1, 1, 1, 0, 0, 0, 0, 0]  # level 3 rejected; levels 4, 5 never tested
    tr.observe("a", 3, 3)
    assert list(tr.counts("a")[1][:4]) == [2, 2, 2, 0]
    tr.observe("a", 0, 0)  # did not draft: nothing learned
    assert list(tr.counts("a")[1][:4]) == [2, 2, 2, 0]


def test_tracker_estimate_follows_recent_outcomes_and_shrinks_deep_levels_to_the_level_above():
    tr = AcceptanceTracker(16, prior_mean=0.5, prior_weight=1.0, decay=0.8)
    for _ in range(30):
        tr.observe("a", 4, 4)
    q = tr.conditional("a", 16)
    assert q[0] > 0.9 and q[3] > 0.9
    assert q[10] == pytest.approx(q[3])  # never tested: the level above's estimate
    for _ in range(30):
        tr.observe("a", 4, 0)
    assert tr.conditional("a", 1)[0] < 0.15
    assert tr.conditional("new", 3)[0] == pytest.approx(0.5)


def test_the_prior_forgets_per_tested_level_down_to_its_floor():
    tr = AcceptanceTracker(8, prior_weight=1.0, decay=0.8, min_weight=0.1)
    assert list(tr.weights("new")) == [1.0] * 8
    tr.observe("a", 6, 2)  # levels 1-3 tested (3 rejected), 4-6 not
    tr.observe("a", 6, 0)  # level 1 tested again
    assert tr.weights("a")[:4].tolist() == pytest.approx([0.64, 0.8, 0.8, 1.0])
    for _ in range(40):
        tr.observe("a", 6, 0)
    assert tr.weights("a")[0] == pytest.approx(0.1) and tr.weights("a")[1] == pytest.approx(0.8)
    # a source that always fails: ~2% of the prior, where a prior of constant weight kept it at mean / 6
    assert tr.conditional("a", 1)[0] == pytest.approx(0.5 * 0.1 / (1 / 0.2 + 0.1), rel=1e-2)
    with pytest.raises(ValueError, match="min_weight"):
        AcceptanceTracker(8, prior_weight=1.0, min_weight=2.0)


def test_a_chance_match_that_always_fails_stops_drafting_on_the_prompts_forward():
    """The chat template's tail matches every stored answer: a 7-id match whose rule-of-succession prior is 0.89 per
    level, never accepted. With a prior of constant weight its level-1 estimate stayed at ~0.15 and, its deep levels
    untested at 0.9, the policy kept verifying 5-10 of its tokens on each question's prompt forward; once the prior
    forgets like the outcomes, it stops (and probes take over)."""
    curve = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 512),
                      (1.0, 1.67, 2.07, 1.54, 1.66, 1.78, 2.28, 2.85, 4.15, 4.97, 8.53, 17.07, 32.95))
    prior = succession_priors(chain(48), 7)

    def drafted(tracker: AcceptanceTracker) -> int:
        pol = SpeculationPolicy(curve, tracker=tracker)
        for _ in range(12):
            pol.observe("corpus/4", 10, 0)
        return len(pol.plan(chain(48), ["corpus/4"] * 48, prior, fed=60).nodes)

    assert drafted(AcceptanceTracker(64, min_weight=1.0)) >= 5  # the prior never forgotten: keeps drafting
    assert drafted(AcceptanceTracker(64)) == 0
    # a replay's levels that were never tested keep their prior: learned at levels 1-10, then trusted below them
    pol = SpeculationPolicy(curve)
    for _ in range(3):
        pol.observe("corpus/64", 10, 10)
    cond = pol.conditionals(chain(48), ["corpus/64"] * 48, succession_priors(chain(48), 70))
    assert (cond[10:] == pytest.approx(succession_priors(chain(48), 70)[10:]))


def test_a_streamed_prompts_forward_carries_only_a_likely_right_draft():
    """A draft on a forward that carries the prompt (fed > 1) while a streaming client awaits the first token
    delays that token: it is verified only when its first token's chance reaches prompt_chance. The chat template's
    tail before the one stored answer (a short match, 1 occurrence: 1/2 of its succession prior) is not; a replayed
    prompt's whole-context match is; the same tail draft on a forward after the first token, or with the whole
    answer awaited, is priced like any draft."""
    flat = CostCurve((0, 1, 64), (1.0, 1.05, 1.2))
    tail = source_priors(chain(32), counts=[1] * 32, match_length=6, root_count=1)
    assert tail[0] == pytest.approx(0.5 * 7 / 8)
    replay = succession_priors(chain(32), 4096)
    def kept(pol, priors, fed=20, awaited=True, key="corpus/4"):
        return len(pol.plan(chain(32), [key] * 32, priors, fed=fed, awaited=awaited).nodes)

    assert kept(SpeculationPolicy(flat), tail) == 0
    assert kept(SpeculationPolicy(flat), tail, fed=1) == 0  # the prompt all cached but its last token: still first
    assert kept(SpeculationPolicy(flat), tail, fed=1, awaited=False) > 0
    assert kept(SpeculationPolicy(flat), tail, awaited=False) > 0
    assert kept(SpeculationPolicy(flat, prompt_chance=0.0), tail) > 0
    assert kept(SpeculationPolicy(flat), replay, key="corpus/4096") == 32
    pol = SpeculationPolicy(flat)
    kept(pol, tail)
    assert pol.idle.get("corpus/4", 0) == 0  # declined for the first token's sake, not judged: no probe is owed
    with pytest.raises(ValueError, match="prompt_chance"):
        SpeculationPolicy(flat, prompt_chance=1.5)


@pytest.mark.parametrize("args", [(0,), (4, 5), (-1, 0)])
def test_tracker_rejects_bad_outcomes(args):
    tr = AcceptanceTracker(8)
    with pytest.raises(ValueError):
        tr.observe("a", *args) if len(args) == 2 else AcceptanceTracker(*args)


# ---- the decision on synthetic curves -----------------------------------------------------------------------------

def test_flat_curve_drafts_to_the_cap():
    pol = trained(CostCurve.flat(64), 0.5, max_nodes=32)
    assert pol.depth("s", 48) == 32  # capped by max_nodes
    assert pol.depth("s", 20) == 20  # the whole candidate
    assert pol.depth("s", 48, max_depth=7) == 7


def test_steep_curve_drafts_less_than_a_gentle_one():
    gentle, steep = trained(linear(0.02), 0.85), trained(linear(0.25), 0.85)
    d_gentle, d_steep = gentle.depth("s", 48), steep.depth("s", 48)
    assert 0 < d_steep < d_gentle
    assert d_gentle == best_chain_depth(gentle, "s", 48) and d_steep == best_chain_depth(steep, "s", 48)


def test_nonmonotonic_curve_picks_the_cheap_wider_forward():
    # one draft costs 2 steps, three cost 1.5 (as on the development CPU): at 50% acceptance only 3+ pays
    curve = CostCurve((0, 1, 2, 3, 4, 8), (1.0, 2.0, 2.2, 1.5, 1.6, 3.0))
    pol = trained(curve, 0.5)
    d = pol.depth("s", 8)
    assert d >= 3 and d == best_chain_depth(pol, "s", 8)


def test_zero_acceptance_stops_drafting_with_cheap_bounded_probes():
    curve = linear(0.3)
    pol = SpeculationPolicy(curve, probe_overhead=0.03)
    drafted, overhead = [], 0.0
    for step in range(400):
        d = pol.depth("s", 16)
        pol.observe("s", d, 0)
        drafted.append(d)
        if step >= 100:
            overhead += curve.cost(d) - 1.0  # nothing accepted: every draft token is pure cost
    late = drafted[100:]
    assert drafted[0] > 0  # the prior lets a new source try
    assert sum(d > 0 for d in late) <= len(late) // 5  # mostly off
    assert max(late) <= pol.probe_max  # what remains are probes
    assert overhead / len(late) <= 2 * pol.probe_overhead


def test_acceptance_that_returns_reenables_drafting_within_a_few_steps():
    curve = linear(0.3)
    pol = SpeculationPolicy(curve, probe_overhead=0.03)
    for _ in range(200):
        pol.observe("s", pol.depth("s", 16), 0)
    steps = None
    for step in range(40):  # every proposal now right
        sel = pol.plan(chain(16), ["s"] * 16)
        pol.observe("s", len(sel), len(sel))
        if len(sel) > pol.probe_max and not sel.probes:
            steps = step
            break
    assert steps is not None and steps <= 20  # one probe interval (~8 steps here) and a step or two more


def test_probe_interval_shrinks_on_a_cheaper_curve():
    """The same useless source is probed more often when wider forwards cost less."""
    def probes(curve):
        pol = SpeculationPolicy(curve)
        return sum(pol.observe("s", d, 0) or d > 0 for d in (pol.depth("s", 8) for _ in range(300)))

    assert probes(linear(0.05)) > probes(linear(0.5)) > 0


def test_sources_are_learned_separately():
    pol = SpeculationPolicy(linear(0.1))
    for _ in range(40):
        pol.observe("good", 8, 8)
        pol.observe("bad", 8, 0)
    assert pol.depth("good", 8) == 8 and pol.depth("bad", 8) == 0


# ---- source self-knowledge ----------------------------------------------------------------------------------------

def test_count_and_succession_priors():
    parents, counts = [-1, 0, 0, 1], [4, 3, 1, 3]
    # the root's children keep one share of the matched suffix's occurrences for a continuation not seen yet
    assert list(count_priors(parents, counts)) == pytest.approx([0.8, 0.75, 0.25, 1.0])
    assert list(count_priors(parents, counts, root_count=8)) == pytest.approx([4 / 9, 0.75, 0.25, 1.0])
    assert count_priors([-1, 0], [1, 1])[0] == pytest.approx(0.5)  # one stored answer: a guess at the next one
    assert list(succession_priors([-1, 0, 1], 3)) == pytest.approx([4 / 5, 5 / 6, 6 / 7])
    assert source_priors([-1, 0]) is None
    both = source_priors(parents, counts=counts, match_length=3)
    assert list(both) == pytest.approx(count_priors(parents, counts) * succession_priors(parents, 3))
    assert depth_limit(3, 4.0) == 12 and depth_limit(0, 4.0, 1.0) == 1


def test_priors_raise_or_lower_the_expected_acceptance_while_evidence_is_thin():
    # a source never seen: its prior mean (0.5) decides unless the source knows better
    long_match, rare = succession_priors(chain(16), 8), count_priors(chain(16), [1] * 16, root_count=5)
    steep, milder = linear(0.6), linear(0.3)
    assert SpeculationPolicy(steep).depth("s", 16) == 0
    assert SpeculationPolicy(steep).depth("s", 16, long_match) > 0  # an 8-token match: worth drafting
    assert SpeculationPolicy(milder).depth("s", 16) > 0
    assert SpeculationPolicy(milder).depth("s", 16, rare) == 0  # 1 of 5 occurrences continue this way
    # with evidence, the prior still moves the estimate its way
    base = trained(milder, 0.6, steps=3).conditionals(chain(8), ["s"] * 8)
    up = trained(milder, 0.6, steps=3).conditionals(chain(8), ["s"] * 8, succession_priors(chain(8), 8))
    assert (up > base).all()


# a one-thread CPU curve measured under load (the cached curve of docs/benchmarks.md's ceiling runs)
LOADED_CPU = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 512),
                       (1.0, 1.68, 2.12, 1.57, 1.8, 2.34, 2.29, 2.52, 3.39, 4.11, 8.94, 17.49, 33.13))


def chance_drafts(pol: SpeculationPolicy, key: str, steps: int = 30, first: float = 0.25, then: float = 0.5) -> None:
    """``steps`` 32-token drafts of ``key``: level 1 accepted with ``first``, each deeper level with ``then`` (novel
    text's n-gram drafts: the phrase matched by chance or not, and if it did, a few tokens more)."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        a = 0
        if rng.random() < first:
            a = 1
            while a < 32 and rng.random() < then:
                a += 1
        pol.observe(key, 32, a)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_deep_levels_follow_what_was_learned_below_level_one(n):
    """A short match's rule-of-succession prior says 0.8-0.97 per deep level; once the levels below level 1 were
    seen at about half, the estimates follow them, and 32-token chance drafts no longer look worth verifying."""
    pol = SpeculationPolicy(LOADED_CPU)
    chance_drafts(pol, "ngram/2")
    prior = succession_priors(chain(32), n)
    cond = pol.conditionals(chain(32), ["ngram/2"] * 32, prior)
    succ, trials = pol.tracker.counts("ngram/2")
    # level 1: what was seen lately (a quarter over all 30, fewer in the last few), the prior all but forgotten
    assert 0.05 < cond[0] < 0.35 and cond[0] == pytest.approx(succ[0] / trials[0], abs=0.02)
    assert (cond[1:] < 0.75).all() and (cond[1:] > 0.25).all()  # deeper: about half, not the prior's 0.8-0.97
    assert pol.depth("ngram/2", 32, prior) == 0
    # level 1's own shortfall (a chance match) does not carry down: a source right at level 1 whenever it drafts
    # past it keeps its deep prior
    sure = SpeculationPolicy(LOADED_CPU)
    chance_drafts(sure, "corpus/64", first=0.25, then=1.0)
    deep = sure.conditionals(chain(32), ["corpus/64"] * 32, succession_priors(chain(32), 64))
    assert (deep[1:] > 0.9).all()


def test_a_replay_with_no_history_still_drafts_deep():
    fresh = SpeculationPolicy(LOADED_CPU, max_nodes=512)
    assert fresh.depth("corpus/64", 300, succession_priors(chain(300), 64)) > 48


def chunked_rate(pol: SpeculationPolicy, prob: np.ndarray, d: int) -> float:
    """Expected tokens per plain step of verifying a chain with path probabilities ``prob`` d nodes a forward."""
    tokens = cost = 0.0
    for start in range(0, len(prob), d + 1):
        reach = 1.0 if start == 0 else prob[start - 1]
        size = min(d, len(prob) - start)
        tokens += reach + prob[start:start + size].sum()
        cost += reach * pol.costs[size]
    return tokens / cost


def test_a_likely_chain_goes_in_one_forward_when_chunks_cost_more():
    """The best single forward on this curve is 64 tokens; a learned replay's remaining 85 go in one forward (64 +
    a 20-token forward cost more per token), a long remainder where 64-token forwards are cheaper per token stays
    at 64, and a chance draft is never widened."""
    pol = SpeculationPolicy(LOADED_CPU, max_nodes=512)
    for _ in range(5):
        pol.observe("corpus/32", 64, 64)
    for length in (85, 126, 300):
        prior = succession_priors(chain(length), 53)
        prob = path_probabilities(chain(length), pol.conditionals(chain(length), ["corpus/32"] * length, prior))
        whole = (1 + prob.sum()) / pol.costs[length]
        got = pol.depth("corpus/32", length, prior)
        assert got == (length if whole > chunked_rate(pol, prob, 64) else 64), (length, got)
    assert pol.depth("corpus/32", 85, succession_priors(chain(85), 53)) == 85
    assert pol.depth("corpus/32", 300, succession_priors(chain(300), 53)) == 64
    chance = SpeculationPolicy(LOADED_CPU)
    chance_drafts(chance, "ngram/2", first=0.9, then=0.6)
    d = chance.depth("ngram/2", 32, succession_priors(chain(32), 4))
    assert 0 < d < 32
    # a tree is left to the selection
    parents = [-1, 0, 0] + list(range(2, 84))
    sel = pol.plan(parents, ["corpus/32"] * len(parents), [1.0, 0.9, 0.1] + [0.99] * 82)
    assert len(sel) < len(parents)


def test_sibling_conditionals_never_sum_past_one():
    pol = trained(CostCurve.flat(), 0.9)
    parents = [-1, -1, -1, 0, 0]
    for priors in (None, [0.6, 0.5, 0.4, 0.9, 0.9]):
        cond = pol.conditionals(parents, ["s"] * 5, priors)
        assert cond[:3].sum() <= 1.0 + 1e-12 and cond[3:].sum() <= 1.0 + 1e-12
        assert cond[0] >= cond[1] >= cond[2]


# ---- node selection -----------------------------------------------------------------------------------------------

def random_tree(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def test_select_nodes_is_the_best_subtree_by_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(1, 8))
        parents = random_tree(rng, n)
        cond = rng.random(n) ** 2
        costs = np.concatenate(([1.0], 1.0 + np.cumsum(rng.random(n) * 0.6)))
        sel = select_nodes(parents, cond, costs)
        prob = path_probabilities(parents, cond)
        best = 1.0
        for mask in itertools.product([0, 1], repeat=n):
            keep = [i for i in range(n) if mask[i]]
            if all(parents[i] < 0 or mask[parents[i]] for i in keep):
                best = max(best, (1 + prob[keep].sum()) / costs[len(keep)])
        assert sel.rate == pytest.approx(best)
        assert all(parents[i] < 0 or parents[i] in sel.nodes for i in sel.nodes)


def test_select_nodes_budget_forced_probe_and_min_gain():
    parents, cond = chain(6), [0.9] * 6
    assert len(select_nodes(parents, cond, CostCurve.flat().table(6), budget=4)) == 4
    useless = select_nodes(parents, [0.0] * 6, linear(0.5).table(6), forced=[1])
    assert useless.nodes == [0, 1]  # forced node and its ancestor, nothing else
    marginal = select_nodes([-1], [0.1], np.array([1.0, 1.05]))
    assert len(marginal) == 1 and len(select_nodes([-1], [0.1], np.array([1.0, 1.05]), min_gain=0.1)) == 0


def test_tree_plan_keeps_the_likely_branch():
    pol = trained(linear(0.1), 0.9)
    parents, sources = [-1, 0, 1, -1, 3], ["s"] * 5
    priors = [0.9, 1.0, 1.0, 0.1, 1.0]  # branch 0-1-2 holds 90% of the occurrences
    sel = pol.plan(parents, sources, priors)
    assert sel.nodes[:3] == [0, 1, 2] and 4 not in sel.nodes


def test_source_outcomes_and_subtree_parents():
    assert source_outcomes(chain(5), ["c"] * 5, [0, 1]) == {"c": (5, 2)}
    assert source_outcomes(chain(3), ["c"] * 3, []) == {"c": (3, 0)}
    # corpus A B C D, n-gram A B X merged: X (depth 3) hangs under the corpus's B
    parents, sources = [-1, 0, 1, 2, 1], ["c", "c", "c", "c", "n"]
    assert source_outcomes(parents, sources, [0, 1, 2]) == {"c": (4, 3), "n": (3, 2)}
    assert source_outcomes(parents, sources, [0, 1, 4]) == {"c": (4, 2), "n": (3, 3)}
    assert subtree_parents([-1, 0, 1, -1, 3], [0, 1, 3]) == [-1, 0, -1]


# ---- cache --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return build_tiny("llama", "sdpa", seed=3)


class FakeMeasure:
    def __init__(self):
        self.calls = 0

    def __call__(self, model, sizes, prefix, repeats):
        self.calls += 1
        return CostCurve(tuple(sizes), tuple(1.0 + 0.1 * s for s in sizes))


def test_cache_key_changes_with_threads_dtype_and_settings(tiny):
    base = curve_key(tiny, threads=1)
    assert curve_key(tiny, threads=1) == base
    assert curve_key(tiny, threads=2) != base
    assert curve_key(tiny, threads=1, repeats=7) != base
    assert curve_key(tiny.to(torch.float64), threads=1) != base
    tiny.to(torch.float32)
    assert curve_key(tiny, threads=1) == base
    assert curve_path(base, "/x") != curve_path(curve_key(tiny, threads=2), "/x")


def test_llama_cache_key_names_the_builds_numerics(tmp_path, monkeypatch):
    """A llama.cpp build with llamafile's sgemm batches rows at another cost than a batch-invariant one: their
    curves are cached apart (the GGUF, threads and machine alike)."""
    import importlib.metadata
    from types import SimpleNamespace

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.36")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def target(numerics):
        return SimpleNamespace(runtime="llama.cpp", path=gguf, description="llama 135M Q4_1", n_threads=2,
                               max_length=4096, numerics=numerics)

    invariant, sgemm = curve_key(target("llama.cpp batch-invariant")), curve_key(target("llama.cpp"))
    assert invariant != sgemm and invariant == curve_key(target("llama.cpp batch-invariant"))
    assert curve_path(invariant, "/x") != curve_path(sgemm, "/x")


def test_cache_round_trip_measures_once(tiny, tmp_path):
    fake = FakeMeasure()
    a = cached_cost_curve(tiny, directory=tmp_path, sizes=(0, 1, 4), measure=fake)
    b = cached_cost_curve(tiny, directory=tmp_path, sizes=(0, 1, 4), measure=fake)
    assert fake.calls == 1 and a == b and a.sizes == (0, 1, 4)
    files = list((tmp_path / "cost-curves").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left behind
    cached_cost_curve(tiny, directory=tmp_path, sizes=(0, 1, 4), measure=fake, refresh=True)
    assert fake.calls == 2


@pytest.mark.parametrize("content", ["{not json", "[]", "OTHER-KEY", "KEY-BAD-CURVE", b"\xff\xfe\x00"])
def test_corrupted_cache_is_ignored_with_a_warning_and_measured_again(tiny, tmp_path, content):
    fake = FakeMeasure()
    key = curve_key(tiny, sizes=(0, 2))
    path = curve_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    if content == "KEY-BAD-CURVE":  # c(0) must be 1
        content = json.dumps({"key": key, "curve": {"sizes": [0, 2], "costs": [2.0, 3.0]}})
    elif content == "OTHER-KEY":  # a valid curve measured under another key (e.g. a hash collision)
        content = json.dumps({"key": dict(key, threads=99), "curve": {"sizes": [0, 2], "costs": [1.0, 9.0]}})
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(RuntimeWarning, match="cost curve cache"):
        curve = cached_cost_curve(tiny, directory=tmp_path, sizes=(0, 2), measure=fake)
    assert fake.calls == 1 and curve.sizes == (0, 2)
    assert load_curve(path, key) == curve  # rewritten whole


def test_unwritable_cache_warns_and_still_returns_the_curve(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not written"):
        curve = cached_cost_curve(tiny, directory=blocker, sizes=(0, 1), measure=FakeMeasure())
    assert curve.sizes == (0, 1)
    with pytest.warns(RuntimeWarning, match="not written"):
        assert not save_curve(blocker / "x.json", {}, curve)


def test_default_directory_is_redrafts_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path))
    assert default_directory() == tmp_path


# ---- measurement (shapes only) ------------------------------------------------------------------------------------

def test_time_forwards_and_measure_cost_curve_on_a_tiny_model(tiny):
    from redraft.decoding.verify import chain_inputs
    from redraft.runtimes.transformers.target import HFTarget

    target = HFTarget(tiny)
    samples = time_forwards(target, [1, 3, 5], prefix_ids=list(range(10)), repeats=2,
                            tree_inputs=chain_inputs(target.dtype))
    assert set(samples) == {"chain", "tree mask", "reference"}  # reference: the 1-token forwards around each sample
    assert all(set(s) == {1, 3, 5} for s in samples.values())
    assert all(len(v) == 2 and all(t > 0 for t in v) for s in samples.values() for v in s.values())
    assert target.length == 0  # the cache is left empty
    curve = measure_cost_curve(HFTarget(tiny), sizes=(1, 4, 2), prefix=12, repeats=2)
    assert curve.sizes == (0, 1, 2, 4) and curve.costs[0] == 1.0
    assert all(math.isfinite(c) and c > 0 for c in curve.costs)
    with pytest.raises(ValueError, match="sizes >= 1"):
        time_forwards(target, [0], prefix_ids=[1])


def test_acceptance_tracker_counts_every_outcome_from_concurrent_threads():
    """Requests decoding in several threads share one tracker: no outcome is lost (decay 1 = plain counts)."""
    import threading

    from redraft.policy.acceptance import AcceptanceTracker

    tr = AcceptanceTracker(8, decay=1.0)

    def work():
        for _ in range(2000):
            tr.observe("corpus", 3, 2)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    succ, trials = tr.counts("corpus")
    assert succ[:2].tolist() == [16000.0, 16000.0] and trials[:3].tolist() == [16000.0, 16000.0, 16000.0]
