"""The vLLM proposer's draft length under the cost-aware policy at the step's load, on synthetic batches.

The load rule itself (redraft/pricing/load.py) is checked against its formula; the proposer (FakeBatch from
test_vllm_proposer.py: vLLM's persistent batch with a fixed greedy output per request, so verification accepts a
draft's longest matching prefix plus the bonus id) is checked for: depth shrinking as other requests fill the step
and growing back when they leave, no drafts from a source that is never right, the cap num_speculative_tokens,
and output ids identical to the greedy outputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_vllm_proposer import FakeBatch, periodic_miss_request, rng_ids, step, vllm_config

from redraft.defaults import PROBE_MAX
from redraft.integrations.vllm_proposer import ProposerConfigError, RedraftProposer
from redraft.policy import AcceptanceTracker
from redraft.policy.load import LoadAwarePolicy
from redraft.pricing import CostCurve
from redraft.pricing.load import LoadPricing, load_costs

# A step whose cost is mostly fixed overhead: C(T) = 1 + 0.02 (T - 1) (c(n) = 1 + 0.02 n).
OVERHEAD = CostCurve((0, 1000), (1.0, 21.0))
# Cheap up to 8 rows, then steep: the marginal row costs more than a row's share of a loaded step.
KNEE = CostCurve((0, 7, 15, 63), (1.0, 1.1, 3.0, 20.0))
# Every draft row costs 15% of a plain step: more than the acceptance a source keeps by its prior alone after it
# failed every draft (the tracker's Beta prior of weight 1 against ~5 decayed trials: 0.5 / 6 ~ 8% at level 1 for a
# source without priors, 0.8 / 6 ~ 13% for a corpus draft of a 3-token match), so only probes remain.
STEEP = CostCurve((0, 100), (1.0, 16.0))


def test_load_costs_at_one_row_is_the_curve():
    np.testing.assert_allclose(load_costs(KNEE, 1, 40), KNEE.table(40))
    np.testing.assert_allclose(load_costs(CostCurve.flat(), 57, 16), np.ones(17))


def test_load_costs_formula_and_compute_bound_limit():
    for b in (2, 10, 300):
        got = load_costs(OVERHEAD, b, 8)
        want = [1 + b * 0.02 * n / (1 + 0.02 * (b - 1)) for n in range(9)]
        np.testing.assert_allclose(got, want)
    # a step that is all compute (C(T) = T): each draft row costs a whole token once the step is loaded
    compute = CostCurve((0, 1000), (1.0, 1001.0))
    assert load_costs(compute, 10_000, 4)[4] == pytest.approx(5.0, rel=1e-9)
    assert load_costs(compute, 1, 4)[4] == pytest.approx(5.0)


def test_load_costs_never_below_a_plain_step_and_bad_arguments():
    dip = CostCurve((0, 2, 4), (1.0, 0.8, 2.0))  # a measured curve need not be monotonic
    assert (load_costs(dip, 1, 6) >= 1.0).all() and (load_costs(dip, 2, 6) >= 1.0).all()
    with pytest.raises(ValueError, match="carried >= 1"):
        load_costs(dip, 0, 4)
    with pytest.raises(ValueError, match="n_max >= 0"):
        load_costs(dip, 3, -1)


def test_load_pricing_remembers_tables_per_load():
    pricing = LoadPricing(KNEE, 16, remember=2)
    first = pricing.costs(5)
    assert pricing.costs(5) is first and not first.flags.writeable
    pricing.costs(6)
    pricing.costs(7)  # the oldest (5) is dropped
    assert pricing.costs(5) is not first
    np.testing.assert_allclose(pricing.costs(5), first)


def primed_tracker(rate: float, k: int = 32, forwards: int = 40) -> AcceptanceTracker:
    """Acceptance learned from ``forwards`` drafts of k tokens whose first rejection falls at a geometric level."""
    tracker = AcceptanceTracker(k)
    rng = np.random.default_rng(0)
    for _ in range(forwards):
        accepted = min(k, int(rng.geometric(1 - rate)) - 1)
        tracker.observe("s", k, accepted)
    return tracker


def test_policy_depth_shrinks_with_load_and_grows_back():
    pricing = LoadPricing(OVERHEAD, 32)
    policy = LoadAwarePolicy(pricing, tracker=primed_tracker(0.8))
    depths = [policy.at_load(b).depth("s", 32) for b in (1, 4, 16, 64, 256, 1)]
    assert depths[0] > depths[2] > depths[4], depths
    assert all(a >= b for a, b in zip(depths[:4], depths[1:5], strict=True)), depths
    assert depths[-1] == depths[0]
    assert policy.at_load(1).depth("s", 32) <= 32


def test_policy_never_drafts_a_source_that_is_never_right():
    policy = LoadAwarePolicy(LoadPricing(STEEP, 16), tracker=primed_tracker(0.0, 16))
    assert [policy.at_load(1).depth("s", 16) for _ in range(3)] == [0, 0, 0]
    # the prior forgets like the outcomes: after forty failures the estimate is ~1%, which does not pay for a token
    # even on a nearly free step, and a loaded step prices it out further
    cheap = LoadAwarePolicy(LoadPricing(OVERHEAD, 16), tracker=primed_tracker(0.0, 16))
    assert cheap.tracker.conditional("s", 1)[0] < 0.02
    assert [cheap.at_load(b).depth("s", 16) for b in (1, 16, 16)] == [0, 0, 0]


def make_policy_proposer(tmp_path, spans, k, curve, **env):
    environ = {k_.upper(): str(v) for k_, v in env.items()}
    path = tmp_path / "corpus.txt"
    path.write_text("\n-1\n".join(" ".join(map(str, s)) for s in spans) + "\n")
    environ["REDRAFT_DRAFT_CORPUS"] = str(path)
    if curve is not None:
        (tmp_path / "curve.json").write_text(json.dumps(curve.to_dict()))
        environ["REDRAFT_COST_CURVE"] = str(tmp_path / "curve.json")
    return RedraftProposer(vllm_config(k=k), environ=environ)


def test_depth_shrinks_as_the_batch_fills_and_grows_back_when_it_empties(tmp_path):
    prompt, out = rng_ids(31, 20), rng_ids(32, 300)
    prop = make_policy_proposer(tmp_path, [prompt + out], 16, KNEE, redraft_ngram=0)
    batch = FakeBatch(max_num_reqs=24)
    batch.add(0, prompt, out)
    drafts = None

    def run(steps):
        nonlocal drafts
        lengths = []
        for _ in range(steps):
            sampled, drafts = step(prop, batch, drafts)
            lengths.append(len(drafts[0]))
        return lengths

    alone = run(6)
    for row in range(1, 21):  # 20 other requests join: each brings one row a step, none drafts
        batch.add(row, rng_ids(100 + row, 12), rng_ids(200 + row, 200))
    drafts = drafts + [[]] * 20
    loaded = run(6)
    batch.reqs = batch.reqs[:1]  # they finish and leave the batch
    drafts = drafts[:1]
    again = run(6)
    assert min(alone[1:]) >= 6 and max(loaded[1:]) < min(alone[1:]), (alone, loaded)
    assert max(loaded[2:]) == 0, loaded  # a marginal row costs more than a row's share: no draft pays
    assert again[1:] == alone[1:], (alone, again)
    assert list(batch.context(0)) == prompt + out[:len(batch.context(0)) - len(prompt)]


def test_carried_rows_count_earlier_drafts_in_the_same_step(tmp_path, monkeypatch):
    from redraft.integrations.planned import RequestDrafts

    seen = []
    original = RequestDrafts.propose

    def spy(self, context, cap, carried, share=None, **kw):
        out = original(self, context, cap, carried, share, **kw)
        seen.append((carried, len(out)))
        return out

    monkeypatch.setattr(RequestDrafts, "propose", spy)
    spans = [rng_ids(40 + i, 20) + rng_ids(50 + i, 80) for i in range(3)]
    prop = make_policy_proposer(tmp_path, spans, 8, None, redraft_ngram=0)
    batch = FakeBatch(max_num_reqs=3)
    for i, s in enumerate(spans):
        batch.add(i, s[:20], s[20:])
    drafts = None
    for _ in range(4):
        seen.clear()
        sampled, drafts = step(prop, batch, drafts)
        assert [c for c, _ in seen] == [3, 3 + seen[0][1], 3 + seen[0][1] + seen[1][1]]


def test_capped_by_num_speculative_tokens_and_ids_identical(tmp_path):
    for k in (4, 8, 32):
        prompt, out = rng_ids(60 + k, 16), rng_ids(70 + k, 120)
        prop = make_policy_proposer(tmp_path, [prompt + out], k, None, redraft_ngram=0)  # flat: deep drafts pay
        batch = FakeBatch()
        batch.add(0, prompt, out)
        drafts, lengths = None, []
        while not batch.done(0):
            sampled, drafts = step(prop, batch, drafts)
            lengths.append(len(drafts[0]))
        assert max(lengths) == k and all(n <= k for n in lengths), (k, lengths)
        assert list(batch.context(0)) == prompt + out
        assert prop.totals["accepted"] == prop.totals["proposed"] > 0


def test_a_source_that_is_never_right_stops_drafting(tmp_path):
    prompt, out, bad = periodic_miss_request()
    prop = make_policy_proposer(tmp_path, [bad], 16, STEEP, redraft_ngram=0)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts, lengths = None, []
    for _ in range(80):
        sampled, drafts = step(prop, batch, drafts)
        lengths.append(len(drafts[0]))
    late = [n for n in lengths[20:] if n]
    assert prop.totals["accepted"] == 0 and sum(lengths[:20]) > 0
    assert len(late) <= 6 and all(n <= PROBE_MAX for n in late), lengths  # only rare short probes
    assert list(batch.context(0)) == prompt + out[:len(batch.context(0)) - len(prompt)]


def test_policy_settings_and_bad_cost_curve(tmp_path):
    assert RedraftProposer(vllm_config(), environ={}).settings.policy
    assert not RedraftProposer(vllm_config(), environ={"REDRAFT_POLICY": "0"}).settings.policy
    assert not RedraftProposer(vllm_config(), environ={"REDRAFT_CORPUS_K": "4"}).settings.policy
    assert not RedraftProposer(vllm_config(), environ={"REDRAFT_CORPUS_MINACC": "30"}).settings.policy
    with pytest.raises(ProposerConfigError, match="REDRAFT_POLICY='2': expected 0 or 1"):
        RedraftProposer(vllm_config(), environ={"REDRAFT_POLICY": "2"})
    with pytest.raises(ProposerConfigError, match="REDRAFT_COST_CURVE=.*cannot be read"):
        RedraftProposer(vllm_config(), environ={"REDRAFT_COST_CURVE": str(tmp_path / "none.json")})
    (tmp_path / "bad.json").write_text('{"sizes": [1, 2], "costs": [1, 2]}')
    with pytest.raises(ProposerConfigError, match="REDRAFT_COST_CURVE=.*expected a JSON cost curve.*ascend"):
        RedraftProposer(vllm_config(), environ={"REDRAFT_COST_CURVE": str(tmp_path / "bad.json")})
    (tmp_path / "cache.json").write_text(json.dumps({"key": {}, "curve": KNEE.to_dict()}))
    prop = RedraftProposer(vllm_config(), environ={"REDRAFT_COST_CURVE": str(tmp_path / "cache.json")})
    assert prop.curve == KNEE
