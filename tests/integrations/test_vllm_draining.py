"""The load rule's price in a draining batch (redraft/pricing/load.py, argument ``share``) and who holds such a
batch up (redraft/integrations/draining.py), then the vLLM proposer on synthetic batches: in a batch whose requests
all came in together and that is not full, the requests ahead of the slowest stop sending drafts that are not
certain while the slowest keeps drafting; a full batch (others may wait to join) and a batch whose requests came in
at different times keep the row-share price c_B; output ids stay the greedy outputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm_proposer import FakeBatch, rng_ids, step
from test_vllm_proposer_policy import make_policy_proposer

from redraft.integrations.draining import critical_counts
from redraft.pricing import CostCurve
from redraft.pricing.load import LoadPricing, load_costs

# C(T) = 1 + 0.02 (T - 1): a step that is mostly fixed cost (F = 0.98 of a one-row step, 0.02 a row).
OVERHEAD = CostCurve((0, 1000), (1.0, 21.0))


def test_share_of_every_row_is_the_row_share_price():
    for b in (2, 10, 40):
        np.testing.assert_allclose(load_costs(OVERHEAD, b, 8, share=1 / b), load_costs(OVERHEAD, b, 8))
    knee = CostCurve((0, 7, 15, 63), (1.0, 1.1, 3.0, 20.0))
    np.testing.assert_allclose(load_costs(knee, 1, 20, share=0.0), knee.table(20))  # one row: the curve itself


def test_ahead_of_the_slowest_a_draft_row_costs_a_whole_token():
    # an accepted token saves only the row it no longer needs (0.02), which is what each draft row adds
    np.testing.assert_allclose(load_costs(OVERHEAD, 10, 6, share=0.0), 1.0 + np.arange(7))
    # the one slowest request saves the whole fixed part with each accepted token: the single-stream price
    np.testing.assert_allclose(load_costs(OVERHEAD, 10, 6, share=1.0), OVERHEAD.table(6))
    # m slowest share it: between the two
    mid = load_costs(OVERHEAD, 10, 6, share=0.25)
    assert (OVERHEAD.table(6)[1:] < mid[1:]).all() and (mid[1:] < load_costs(OVERHEAD, 10, 6)[1:]).all()


def test_flat_curve_and_bad_critical():
    np.testing.assert_allclose(load_costs(CostCurve.flat(), 10, 8, share=0.0), np.ones(9))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="share None or within 0..1"):
            load_costs(OVERHEAD, 3, 4, share=bad)
    pricing = LoadPricing(OVERHEAD, 8)
    assert pricing.costs(10, 0.0) is pricing.costs(10, 0.0)
    assert not np.allclose(pricing.costs(10, 0.0), pricing.costs(10))


def test_critical_counts():
    assert critical_counts([(5, 1), (3, 1), (3, 2), (9, 1)], full=False) == [0, 2, 2, 0]
    assert critical_counts([(5, 1), (3, 1), (4, 1)], full=False, slack=1) == [0, 2, 2]
    assert critical_counts([(5, 1), (3, 1)], full=True) == [None, None]  # others may be waiting to join
    assert critical_counts([(5, 1), None], full=False) == [None, None]  # a request is still coming in
    assert critical_counts([(5, 1), (3, 9)], full=False) == [None, None]  # came in at different times
    assert critical_counts([(5, 1)], full=False) == [None]


def run_cohort(tmp_path, max_num_seqs, join_late=False, steps=6):
    """Four requests whose answers the corpus holds, except the last one's, whose stored span goes elsewhere: the
    first three race ahead at once, the last one falls behind. Returns the draft lengths per step and the batch."""
    prompts = [rng_ids(60 + i, 20) for i in range(4)]
    outs = [rng_ids(70 + i, 200) for i in range(4)]
    spans = [p + o for p, o in zip(prompts[:3], outs[:3], strict=True)]
    spans.append(prompts[3] + outs[3][:2] + rng_ids(99, 198))  # the last request's stored answer is wrong
    tmp_path.mkdir(exist_ok=True)
    prop = make_policy_proposer(tmp_path, spans, 8, OVERHEAD, redraft_ngram=0)
    prop.max_num_seqs = max_num_seqs
    batch = FakeBatch(max_num_reqs=4)
    drafts, lengths = None, []
    for i in range(4):
        batch.add(i, prompts[i], outs[i])
        if drafts is not None:
            drafts = drafts + [[]]
        if join_late and i == 2:  # the slowest request comes in six steps after the others
            for _ in range(6):
                sampled, drafts = step(prop, batch, drafts)
    for _ in range(steps):
        sampled, drafts = step(prop, batch, drafts)
        lengths.append([len(d) for d in drafts])
    for i in range(4):
        ctx = list(batch.context(i))
        assert ctx == prompts[i] + outs[i][:len(ctx) - len(prompts[i])]
    return lengths, batch


def test_draining_batch_stops_drafts_ahead_of_the_slowest(tmp_path, monkeypatch):
    monkeypatch.setattr("redraft.integrations.vllm_proposer.CONFIDENT_CHANCE", 1.01)  # no draft counts as trusted
    lengths, batch = run_cohort(tmp_path, max_num_seqs=64)
    assert all(n == 8 for n in lengths[0][:3]), lengths  # all tied at first: every replay drafts at the cap
    ahead = [row[:3] for row in lengths[1:]]
    assert all(n == 0 for row in ahead for n in row), lengths  # then they only wait for the slowest
    assert sum(row[3] for row in lengths) > 0, lengths  # the slowest still drafts what its corpus offers


def test_full_or_staggered_batch_keeps_the_row_share_price(tmp_path):
    full, _ = run_cohort(tmp_path / "a", max_num_seqs=4)
    assert all(n == 8 for row in full[1:3] for n in row[:3]), full  # replaced from a queue: drafting pays
    late, _ = run_cohort(tmp_path / "b", max_num_seqs=64, join_late=True)
    assert sum(n for row in late for n in row[:3]) > 3 * 8, late


def test_proposer_reads_max_num_seqs(tmp_path):
    from test_vllm_proposer import vllm_config

    from redraft.integrations.vllm_proposer import RedraftProposer

    cfg = vllm_config(k=8)
    assert RedraftProposer(cfg, environ={}).max_num_seqs is None
    cfg.scheduler_config = SimpleNamespace(max_num_seqs=7)
    assert RedraftProposer(cfg, environ={}).max_num_seqs == 7


def test_no_draft_can_pay_ahead_of_the_slowest_on_a_line():
    from redraft.policy.load import LoadAwarePolicy

    pricing = LoadPricing(OVERHEAD, 8)
    assert pricing.fewest_paying(10, 0.0) == 9  # c(n) = 1 + n: none
    assert pricing.fewest_paying(10) == 1 and pricing.fewest_paying(10, 1.0) == 1
    policy = LoadAwarePolicy(pricing)
    assert not policy.at_load(10, 0.0).may_pay(8) and policy.at_load(10, 1 / 3).may_pay(1)
    knee = LoadPricing(CostCurve((0, 7, 15, 63), (1.0, 1.1, 3.0, 20.0)), 16)
    assert knee.fewest_paying(1) == 1 and knee.fewest_paying(9) > 16  # the knee's steep part: no row pays


def test_each_request_looks_its_draft_up_once_a_step(tmp_path, monkeypatch):
    """Tied requests look up before they are priced, requests ahead of the slowest to see whether their draft is
    trusted; either way the proposal found is the one sent, never searched for twice in a step."""
    from redraft.drafters.frozen_corpus import CorpusDrafter

    calls = []
    original = CorpusDrafter.propose

    def spy(self, context, max_depth):
        calls.append(len(context))
        return original(self, context, max_depth)

    monkeypatch.setattr(CorpusDrafter, "propose", spy)
    lengths, _ = run_cohort(tmp_path, max_num_seqs=64, steps=4)
    assert len(calls) == 4 * 4, (calls, lengths)


def test_tied_shares():
    from redraft.integrations.draining import tied_shares

    asked = []

    def chance(i):
        asked.append(i)
        return [0.0, 0.5, 0.8, 0.9][i]

    # outside a draining batch, ahead of the slowest, and a lone slowest request: no chance is asked for
    assert tied_shares([None, None], chance) == [None, None]
    assert tied_shares([0, 1, 0, 0], chance) == [0.0, 1.0, 0.0, 0.0] and asked == []
    # three tied slowest: each one's share is the chance that the other two advance
    shares = tied_shares([0, 3, 3, 3], chance)
    assert shares[0] == 0.0 and sorted(asked) == [1, 2, 3]
    np.testing.assert_allclose(shares[1:], [0.8 * 0.9, 0.5 * 0.9, 0.5 * 0.8])
    # one of the tied has no draft: the batch's end cannot move this step, whatever the others send; nobody else
    # is asked
    asked.clear()
    assert tied_shares([2, 2, 0, 0], chance) == [0.0, 0.0, 0.0, 0.0] and asked == [0]
    # shares that are all bound to fall below the floor stop the asking early
    asked.clear()
    tiny = [0.0005, 0.0005, 0.9, 0.9]  # two chances whose product is below the floor times the smaller one
    assert tied_shares([4] * 4, lambda i: asked.append(i) or tiny[i]) == [0.0] * 4 and asked == [0, 1]


def test_tied_requests_do_not_draft_while_one_of_them_has_no_draft(tmp_path, monkeypatch):
    """Four requests come in together; three have their answers in the corpus, the fourth has nothing to draft from.
    Under the row's share each replay drafted at the cap; in a draining batch nothing it accepts could end the batch
    sooner if the fourth is the last to finish, so an untrusted draft is not sent. The same batch full (others could
    join) keeps the row-share price and drafts; so do drafts the policy trusts (the fourth may end first)."""
    import redraft.integrations.vllm_proposer as vp

    prompts = [rng_ids(80 + i, 20) for i in range(4)]
    outs = [rng_ids(90 + i, 40) for i in range(4)]
    spans = [p + o for p, o in zip(prompts[:3], outs[:3], strict=True)]
    trusting = vp.CONFIDENT_CHANCE

    def run(max_num_seqs, trusted=False):
        monkeypatch.setattr(vp, "CONFIDENT_CHANCE", trusting if trusted else 1.01)
        work = tmp_path / f"{max_num_seqs}-{trusted}"
        work.mkdir()
        prop = make_policy_proposer(work, spans, 8, OVERHEAD, redraft_ngram=0)
        prop.max_num_seqs = max_num_seqs
        batch = FakeBatch(max_num_reqs=4)
        for i in range(4):
            batch.add(i, prompts[i], outs[i])
        drafts, lengths = None, []
        for _ in range(4):
            sampled, drafts = step(prop, batch, drafts)
            lengths.append([len(d) for d in drafts])
        for i in range(4):
            ctx = list(batch.context(i))
            assert ctx == prompts[i] + outs[i][:len(ctx) - len(prompts[i])]
        return lengths

    draining, full, trusted = run(64), run(4), run(64, trusted=True)
    assert all(n == 0 for row in draining for n in row), draining
    assert all(row[:3] == [8, 8, 8] for row in full), full
    assert trusted == full, trusted


def test_share_grid_rounds_down_geometrically():
    from redraft.pricing.load import SHARE_FLOOR, grid_share, share_grid

    for share in (1.0, 0.999, 0.5, 0.3, 0.01, SHARE_FLOOR, SHARE_FLOOR / 2, 0.0):
        got = grid_share(share_grid(share))
        assert got <= share and (share < SHARE_FLOOR or got > share / 2 ** (1 / 8) - 1e-12), (share, got)
    assert grid_share(share_grid(SHARE_FLOOR / 2)) == 0.0 and grid_share(share_grid(1.0)) == 1.0
    pricing = LoadPricing(OVERHEAD, 8)
    assert pricing.costs(10, 0.999) is pricing.costs(10, 0.95)  # one grid point
    assert (pricing.costs(10, 0.5)[1:] >= load_costs(OVERHEAD, 10, 8, share=0.52)[1:]).all()  # never cheaper
    with pytest.raises(ValueError, match="share None or within 0..1"):
        pricing.costs(10, 1.5)


def test_lookup_counts_no_chance_for_a_first_token_that_cannot_pay_its_row(tmp_path):
    """A tied request whose draft would not be sent even at the whole fixed part's price gives the others no
    reason to draft: its chance is 0. The proposal it found is reused by propose on the same context only."""
    prompt, out = rng_ids(5, 20), rng_ids(6, 60)
    steep = CostCurve((0, 100), (1.0, 16.0))  # a draft row costs 15% of a step: c(1) = 1.15 at B = 2, share 1
    prop = make_policy_proposer(tmp_path, [prompt + out], 8, steep, redraft_ngram=0)
    req = prop._new_request()
    ctx = np.array(prompt + out[:3])
    for q, want in ((0.1, 0.0), (0.3, 0.3)):
        req.planner.policy.conditionals = lambda *a, q=q, **kw: np.array([q])
        assert req.lookup(ctx, 8, 2) == pytest.approx(want)
    calls = []
    original = req.planner.drafters[0].propose
    req.planner.drafters[0].propose = lambda c, d: calls.append(len(c)) or original(c, d)
    req.lookup(ctx, 8, 2)
    req.propose(ctx, 8, 2, 1.0)
    req.lookup(ctx, 8, 2)
    req.propose(ctx[:-1], 8, 2, 1.0)  # another context: searched again, not the stored proposal
    assert calls == [len(ctx), len(ctx), len(ctx) - 1]


def run_mixed(tmp_path, monkeypatch, trusted):
    """A replay (128 stored tokens) and a short novel answer (20 tokens, nothing to draft) come in together: the novel
    one has the fewest tokens at every step, yet it ends first. Returns (steps until both end, the replay's drafts)."""
    if not trusted:
        monkeypatch.setattr("redraft.integrations.vllm_proposer.CONFIDENT_CHANCE", 1.01)
    pa, oa, pb, ob = rng_ids(1, 15), rng_ids(2, 128), rng_ids(3, 15), rng_ids(4, 20)
    tmp_path.mkdir(exist_ok=True)
    prop = make_policy_proposer(tmp_path, [pa + oa], 8, OVERHEAD, redraft_ngram=0)
    prop.max_num_seqs = 16
    batch = FakeBatch(max_num_reqs=2)
    batch.add(0, pa, oa)
    batch.add(1, pb, ob)
    drafts, steps, replay = None, 0, []
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
        steps += 1
        replay.append(len(drafts[0]))
        if len(batch.reqs) > 1 and batch.done(1):  # the novel answer ends: it leaves the batch
            batch.reqs, drafts = batch.reqs[:1], drafts[:1]
    ctx = list(batch.context(0))
    assert ctx == pa + oa[:len(ctx) - len(pa)]
    return steps, replay


def test_a_trusted_replay_ahead_of_a_short_answer_keeps_drafting(tmp_path, monkeypatch):
    steps, replay = run_mixed(tmp_path / "a", monkeypatch, trusted=True)
    assert min(replay[1:10]) == 8, replay  # ahead of the slowest, but its drafts are trusted: its row's share
    assert steps <= 20, (steps, replay)
    slow, held = run_mixed(tmp_path / "b", monkeypatch, trusted=False)
    assert max(held[1:15]) == 0 and slow > steps + 5, (slow, held)  # held back until the short answer ends
