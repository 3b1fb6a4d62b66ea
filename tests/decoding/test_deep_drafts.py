"""Drafts deeper than Colibri's 48 tokens under the cost-aware policy: still plain greedy's ids, and only there.

Tiny random-weight models (128 positions), injected cost curves (a flat one: every depth pays), no timing. Fixed
depths (``--k``, an Engine without a policy) keep the 1..48 contract.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MAX_POS, VOCAB, SequenceDrafter, plain_greedy

from redraft.compose import SpeculationConfig, build_drafters
from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.defaults import MAX_DRAFT_DEPTH, POLICY_MAX_DEPTH
from redraft.drafters import CorpusDrafter
from redraft.policy import SpeculationPolicy
from redraft.pricing import CostCurve
from redraft.pricing.measure import measure_cost_curve
from redraft.runtimes.transformers.target import as_target

FLAT = CostCurve.flat(POLICY_MAX_DEPTH)
PROMPT = [9, 8, 7]
CORPUS_DEPTH = 8  # Colibri's default K
N = 110  # prompt + N fits the tiny models' 128 positions


def deep_policy(curve: CostCurve = FLAT) -> SpeculationPolicy:
    return SpeculationPolicy(curve, max_nodes=POLICY_MAX_DEPTH)


def deep_engine(model, drafters, policy: SpeculationPolicy) -> Engine:
    """An Engine as build_engine makes one under the policy: depth and chain budget up to POLICY_MAX_DEPTH."""
    return Engine(model, drafters, max_depth=POLICY_MAX_DEPTH, tree_budget=POLICY_MAX_DEPTH, policy=policy)


@pytest.fixture(scope="module")
def want(tiny_llama):
    return plain_greedy(tiny_llama, PROMPT, N)


def test_always_right_drafter_at_depth_100_is_exact_in_one_forward(tiny_llama, want):
    oracle = SequenceDrafter(PROMPT + want)
    engine = deep_engine(tiny_llama, [oracle], deep_policy())
    first = engine.generate(PROMPT, N)  # a new source: its prior (P = 0.5 a level) keeps it within ~50 levels
    assert first.output_ids == want and max(first.draft_depth_per_forward) > MAX_DRAFT_DEPTH
    res = engine.generate(PROMPT, N)
    assert res.output_ids == want
    # learned always right, and the flat curve says every depth pays: the prompt and the whole 109-token draft in
    # one forward, + the bonus token
    assert max(res.draft_depth_per_forward) == N - 1 > MAX_DRAFT_DEPTH
    assert res.forwards == 1 and res.accepted_per_forward == [N - 1]


@pytest.mark.parametrize("wrong_at", [0, 47, 48, 70, 100])
def test_deep_draft_wrong_at_one_position_stays_exact(tiny_llama, want, wrong_at):
    seq = PROMPT + want
    seq[len(PROMPT) + wrong_at] = (seq[len(PROMPT) + wrong_at] + 1) % VOCAB
    policy = deep_policy()
    deep_engine(tiny_llama, [SequenceDrafter(PROMPT + want)], policy).generate(PROMPT, N)  # the policy learns the source is right: it drafts all 109 levels next
    res = deep_engine(tiny_llama, [SequenceDrafter(seq)], policy).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.draft_depth_per_forward[0] == N - 1
    assert res.accepted_per_forward[0] == wrong_at  # accepted up to the wrong id, the target's token is the bonus


def test_without_a_policy_depth_stays_within_48(tiny_llama, want):
    oracle = SequenceDrafter(PROMPT + want)
    e = Engine(tiny_llama, [oracle], max_depth=100)
    assert e.max_depth == MAX_DRAFT_DEPTH
    res = e.generate(PROMPT, N)
    assert res.output_ids == want and max(res.draft_depth_per_forward) == MAX_DRAFT_DEPTH


def test_config_caps_depth_at_48_for_fixed_settings_and_512_under_the_policy():
    assert SpeculationConfig().max_depth == POLICY_MAX_DEPTH == SpeculationConfig().policy_nodes
    assert SpeculationConfig().budget == POLICY_MAX_DEPTH  # a chain under the policy: its depth alone limits it
    assert SpeculationConfig(k=8).max_depth == 8 and SpeculationConfig(k=48).max_depth == MAX_DRAFT_DEPTH
    assert SpeculationConfig(policy=False).max_depth == CORPUS_DEPTH  # Colibri's default K
    with pytest.raises(ValueError, match="k=49"):
        SpeculationConfig(k=49)


def long_prompt(n: int = 66) -> list[int]:
    return [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, n)]


@pytest.mark.parametrize("planted", [None, 20, 55])
def test_corpus_replay_drafts_past_48_under_the_policy_and_stays_exact(tiny_llama, planted):
    prompt = long_prompt()
    n = MAX_POS - len(prompt) - 2
    want = plain_greedy(tiny_llama, prompt, n)
    span = prompt + want
    if planted is not None:
        span[len(prompt) + planted] = (span[len(prompt) + planted] + 1) % VOCAB
    corpus = Corpus.from_spans([span], vocab_size=VOCAB)
    drafters = build_drafters(corpus, policy=True, ngram=False)
    res = deep_engine(tiny_llama, drafters, deep_policy()).generate(prompt, n)
    assert res.output_ids == want
    # the whole context matches the stored span (66 > 64 ids): the first draft is the rest of the answer
    assert res.draft_depth_per_forward[0] == n - 1 > MAX_DRAFT_DEPTH
    assert res.accepted_per_forward[0] == (n - 1 if planted is None else planted)


def test_chance_matches_stay_within_48(tiny_llama):
    """A match no longer than the lookup's suffix length (not a replay) drafts at most 48 ids, as before."""
    span = list(range(1, 90))
    drafter = CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), k=MAX_DRAFT_DEPTH, max_n=64,
                            deep=POLICY_MAX_DEPTH)
    tree = drafter.propose(np.array([50, 1, 2, 3, 4], dtype=np.int64), POLICY_MAX_DEPTH)
    assert tree is not None and tree.match_length == 4 and len(tree) == MAX_DRAFT_DEPTH
    with pytest.raises(ValueError, match="deep"):
        CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), deep=0)


def test_a_whole_context_match_counts_as_the_longest_match_the_lookup_reads():
    """A replayed prompt matched whole is as long a match as the context allows, not as the evidence goes: from
    SUFFIX_MAX_N ids on it is credited as a match of context_n ids (its prior and its learning key), so a replay's
    first draft is trusted to its end; a shorter whole context, or a match inside a longer context, keeps its n."""
    from redraft.defaults import SUFFIX_CONTEXT_N, SUFFIX_MAX_N
    from redraft.policy.candidates import policy_key

    span = list(range(1, VOCAB))
    drafter = CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), k=MAX_DRAFT_DEPTH, max_n=64,
                            deep=POLICY_MAX_DEPTH)
    whole = drafter.propose(np.array(span[:SUFFIX_MAX_N + 2], dtype=np.int64), POLICY_MAX_DEPTH)
    assert whole.match_length == SUFFIX_CONTEXT_N and len(whole) == len(span) - SUFFIX_MAX_N - 2
    assert policy_key("corpus", whole.match_length) == "corpus/4096"
    short = drafter.propose(np.array(span[:SUFFIX_MAX_N - 1], dtype=np.int64), POLICY_MAX_DEPTH)
    assert short.match_length == SUFFIX_MAX_N - 1
    inside = drafter.propose(np.array([90, 91] + span[:20], dtype=np.int64), POLICY_MAX_DEPTH)
    assert inside.match_length == 20
    fixed = CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), k=MAX_DRAFT_DEPTH, max_n=64)
    assert fixed.propose(np.array(span[:20], dtype=np.int64), POLICY_MAX_DEPTH).match_length == 20


def test_a_whole_short_context_match_is_a_replay(tiny_llama, want):
    """A live context shorter than the lookup's suffix length, matched whole (a replayed prompt under 64 ids),
    drafts past 48 as a match past 64 ids does; the first forward then verifies the whole answer, exactly."""
    span = list(range(1, 90))
    drafter = CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), k=MAX_DRAFT_DEPTH, max_n=64,
                            deep=POLICY_MAX_DEPTH)
    tree = drafter.propose(np.array([1, 2, 3, 4], dtype=np.int64), POLICY_MAX_DEPTH)
    assert tree is not None and tree.match_length == 4 and len(tree) == 85  # the rest of the span
    fixed = CorpusDrafter(Corpus.from_spans([span], vocab_size=VOCAB), k=MAX_DRAFT_DEPTH, max_n=64)
    assert len(fixed.propose(np.array([1, 2, 3, 4], dtype=np.int64), POLICY_MAX_DEPTH)) == MAX_DRAFT_DEPTH
    drafters = build_drafters(Corpus.from_spans([PROMPT + want], vocab_size=VOCAB), policy=True, ngram=False)
    res = deep_engine(tiny_llama, drafters, deep_policy()).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.draft_depth_per_forward == res.accepted_per_forward == [N - 1]


def test_cost_curve_leaves_out_sizes_past_the_context(tiny_llama):
    curve = measure_cost_curve(as_target(tiny_llama), (0, 1, 64, 126, 127, 512), prefix=8, repeats=1)
    assert curve.sizes == (0, 1, 64, 126)  # 1 + n tokens after one cached id must fit 128 positions


def test_curve_at_matches_cost_everywhere():
    curve = CostCurve((0, 1, 3, 48), (1.0, 1.6, 1.5, 3.4))
    ns = list(range(0, 200, 7)) + [48, 49, 512]
    assert curve.at(ns).tolist() == pytest.approx([curve.cost(n) for n in ns])


def test_a_draft_on_a_long_prefill_costs_what_it_adds_to_that_forward():
    """On the forward that carries the prompt, n draft tokens cost c(m + n) - c(m) on top of a plain step: past the
    curve's flat start a chance draft that c(n) alone would verify does not pay, a replay's does."""
    curve = CostCurve((0, 1, 4, 32, 64, 128, 512), (1.0, 1.2, 1.3, 1.6, 4.0, 8.0, 32.0))  # flat start, then linear
    pol = deep_policy(curve)
    costs = pol.step_costs(101)  # 100 prompt tokens before the root
    assert costs[0] == 1.0 and costs[32] == pytest.approx(1.0 + curve.cost(132) - curve.cost(100))
    assert pol.step_costs(1) is pol.costs
    chain = list(range(-1, 31))  # a 32-token chain, each token right with P 0.8 given its parent
    priors = [0.8] * 32
    alone = len(pol.plan(chain, ["corpus/4"] * 32, priors))  # 14 with c(n) alone
    on_prefill = len(deep_policy(curve).plan(chain, ["corpus/4"] * 32, priors, fed=101))  # 7: 1 + 0.0625 n
    assert 0 < on_prefill < alone
    sure = [0.999] * 32
    assert len(deep_policy(curve).plan(chain, ["corpus/512"] * 32, sure, fed=101)) == 32  # a replay's draft: all
