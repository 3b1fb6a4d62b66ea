"""The Engine with the cost-aware speculation policy (redraft.policy) on injected, synthetic cost curves.

No timing anywhere: each test hands the engine a made-up curve c(n) and checks what the policy does with it on a
tiny random-weight model. Exactness: the policy only ever cuts a proposal to a subtree closed under ancestors, so
every depth it can choose must give plain greedy's ids (a stub that cuts at each depth 0..48, and hypothesis over
planted corpora, curves, merge, n-gram, EOS and exact modes). Speed in model time: the cost of a run is
sum over forwards of c(draft tokens verified), in plain steps.
"""

from __future__ import annotations

import math

import pytest
from conftest import VOCAB, RecordingTarget, SequenceDrafter, ceil_div, draw_planted_case, plain_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.compose import build_drafters
from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.defaults import MAX_DRAFT_DEPTH, PROBE_OVERHEAD
from redraft.drafters import NgramDrafter
from redraft.policy import Selection, SpeculationPolicy
from redraft.pricing import CostCurve
from redraft.tree import TokenTree

# shaped like the 2-core development CPU's curve: one draft token costs more than three (not monotonic)
CPU_LIKE = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48), (1.0, 1.6, 2.0, 1.7, 1.75, 2.1, 2.9, 4.2, 5.5))
STEEP = CostCurve((0, 64), (1.0, 1.0 + 0.3 * 64))
FLAT = CostCurve.flat(64)
PROMPT = [9, 8, 7]
N = 110  # prompt + N fits the tiny models' 128 positions


def model_time(res, curve: CostCurve) -> float:
    """The run's verify time in plain steps: sum of c(draft tokens) over its forwards (plain greedy: forwards)."""
    return sum(curve.cost(n) for n in res.drafted_per_forward)


def policy(curve: CostCurve) -> SpeculationPolicy:
    return SpeculationPolicy(curve, max_nodes=MAX_DRAFT_DEPTH)


class CutAt:
    """A stand-in policy that verifies the first ``d`` candidate nodes whatever they are (0 = a plain step).

    Candidate nodes come parents first, so the first d always form a subtree closed under ancestors, which is all
    a real policy's selection can be; with d over 0..48 this covers every cut the policy can make.
    """

    def __init__(self, d: int) -> None:
        self.d, self.max_nodes = d, MAX_DRAFT_DEPTH
        self.observed: list[tuple[str, int, int]] = []

    def at_load(self, carried: int, share=None):
        return self

    def may_pay(self, depth: int) -> bool:
        return True

    def hopeless_chain(self, source, first_prior=None, *, max_depth=None, awaited=False) -> bool:
        return False  # every chain is cut by plan

    def plan(self, parents, sources, priors=None, *, max_depth=None, budget=None, fed=1, awaited=False) -> Selection:
        n = min(self.d, len(parents), budget or self.max_nodes)
        return Selection(list(range(n)), 1.0, 1.0)

    def observe(self, source: str, depth: int, accepted: int) -> None:
        self.observed.append((source, depth, accepted))


def planted(model, prompt, want, changes=(6, 23)) -> Corpus:
    """The model's own output in a corpus, with ids changed at ``changes``: drafts accepted up to each, then not."""
    span = list(prompt + want)
    for i in changes:
        span[len(prompt) + i] = (span[len(prompt) + i] + 1) % VOCAB
    return Corpus.from_spans([span, prompt + want[:15]], vocab_size=VOCAB)


@pytest.fixture(scope="module")
def want(tiny_llama):
    return plain_greedy(tiny_llama, PROMPT, N)


# ---- exactness at every depth the policy can choose ---------------------------------------------------------------

@pytest.mark.parametrize("d", range(0, MAX_DRAFT_DEPTH + 1))
def test_every_cut_depth_is_exact(tiny_llama, want, d):
    corpus = planted(tiny_llama, PROMPT, want)
    for merge, branches in ((False, 0), (True, 3)):
        cut = CutAt(d)
        res = Engine(tiny_llama, build_drafters(corpus, policy=True, tree_branches=branches), merge=merge,
                     policy=cut).generate(PROMPT, 60)
        assert res.output_ids == want[:60], (d, merge)
        assert max(res.drafted_per_forward) <= d
        if d == 0:
            assert res.forwards == 60
        else:
            assert res.forwards < 60 and sum(res.accepted_per_forward) > 0
        for _, depth, accepted in cut.observed:
            assert 0 <= accepted <= depth <= d


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_policy_exact_hypothesis(tiny_llama):
    """Planted corpora, random curves (flat, steep, not monotonic), merge, n-gram, EOS, exact modes: the ids are
    plain greedy's, and the policy really chose many different depths."""
    depths: set[int] = set()
    runs = {"n": 0, "accepting": 0}

    @_settings(80)
    @given(data=st.data())
    def prop(data):
        prompt, n, eos, expect, span = draw_planted_case(data, tiny_llama, 64)
        corpus = Corpus.from_spans([span], vocab_size=VOCAB)
        costs = data.draw(st.lists(st.floats(0.5, 4.0), min_size=1, max_size=5), label="curve")
        sizes = sorted(data.draw(st.sets(st.integers(1, 48), min_size=len(costs), max_size=len(costs))))
        curve = CostCurve(tuple([0] + sizes), tuple([1.0] + costs))
        merge = data.draw(st.booleans(), label="merge")
        branches = data.draw(st.sampled_from([0, 3]), label="tree branches")
        drafters = build_drafters(corpus, policy=True, ngram=data.draw(st.booleans(), label="ngram"),
                                  tree_branches=branches)
        exact = data.draw(st.sampled_from([(True, 1e-3), (True, 1.0), (False, 1e-3)]), label="exact")
        target = RecordingTarget(tiny_llama)
        res = Engine(target, drafters, eos_token_ids=eos, merge=merge, exact=exact[0], exact_margin=exact[1],
                     policy=policy(curve)).generate(prompt, n)
        assert res.output_ids == expect
        assert res.forwards == len(target.log)
        depths.update(res.draft_depth_per_forward)
        runs["n"] += 1
        runs["accepting"] += sum(res.accepted_per_forward) > 0

    prop()
    assert runs["accepting"] >= runs["n"] // 4, runs
    assert len(depths) >= 15, sorted(depths)


# ---- what the policy does with the curve --------------------------------------------------------------------------

@pytest.mark.parametrize("curve", [CPU_LIKE, STEEP, FLAT], ids=["cpu-like", "steep", "flat"])
def test_replay_drafts_deep(tiny_llama, want, curve):
    """An always-right source (a replay) is verified deep on any curve: a few forwards for 110 tokens."""
    res = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)], policy=policy(curve)).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.forwards <= ceil_div(N, MAX_DRAFT_DEPTH + 1) + 3
    assert max(res.draft_depth_per_forward) == MAX_DRAFT_DEPTH


def test_flat_curve_drafts_to_the_cap_at_once(tiny_llama, want):
    """On a flat curve an always-right source is verified as deep as allowed in every forward, from the first one:
    the cap, or the tokens still wanted after the bonus token, whichever is less."""
    res = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)], policy=policy(FLAT)).generate(PROMPT, N)
    assert res.output_ids == want
    emitted, expected = 0, []
    while emitted < N:
        expected.append(min(MAX_DRAFT_DEPTH, N - emitted - 1))
        emitted += expected[-1] + 1
    assert res.draft_depth_per_forward == expected
    assert res.accepted_per_forward == expected  # all of it accepted
    assert res.forwards == ceil_div(N, MAX_DRAFT_DEPTH + 1)


def test_corpus_replay_beats_fixed_depth(tiny_llama, want):
    """The corpus drafter proposes up to the cap under the policy, and a replay needs fewer forwards than K=8."""
    corpus = Corpus.from_spans([PROMPT + want], vocab_size=VOCAB)
    fixed = Engine(tiny_llama, build_drafters(corpus, k=8, ngram=False), max_depth=8).generate(PROMPT, N)
    pol = Engine(tiny_llama, build_drafters(corpus, ngram=False, policy=True),
                 policy=policy(CPU_LIKE)).generate(PROMPT, N)
    assert pol.output_ids == fixed.output_ids == want
    assert pol.forwards < fixed.forwards
    assert max(pol.draft_depth_per_forward) > 8


@pytest.mark.parametrize("curve", [CPU_LIKE, STEEP], ids=["cpu-like", "steep"])
def test_useless_source_costs_at_most_the_probe_budget(tiny_llama, want, curve):
    """A source that always proposes and is always wrong: as many forwards as plain greedy, and model time within
    plain's + 2 x PROBE_OVERHEAD per step + the first draft (which the prior pays for before anything is known)."""
    wrong = SequenceDrafter(PROMPT + want + [0] * 60, "wrong", shift=1)
    res = Engine(tiny_llama, [wrong], policy=policy(curve)).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.forwards == N
    first = curve.cost(res.drafted_per_forward[0])
    assert model_time(res, curve) <= N * (1 + 2 * PROBE_OVERHEAD) + first
    assert sum(d > 0 for d in res.drafted_per_forward[10:]) <= (N - 10) // 5  # mostly plain steps


def test_unrelated_corpus_costs_at_most_the_probe_budget(tiny_llama, want):
    """A corpus that matches every step (each 3-gram of the output, then garbage) and is never right."""
    spans = [want[i:i + 3] + [(t + 7) % VOCAB for t in want[i + 3:i + 12]] for i in range(len(want) - 3)]
    corpus = Corpus.from_spans(spans, vocab_size=VOCAB)
    res = Engine(tiny_llama, build_drafters(corpus, ngram=False, policy=True),
                 policy=policy(CPU_LIKE)).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.sources["corpus"].accepted == 0 and res.sources["corpus"].steps > 0
    assert res.forwards == N
    assert model_time(res, CPU_LIKE) <= N * (1 + 2 * PROBE_OVERHEAD) + CPU_LIKE.cost(res.drafted_per_forward[0])
    assert sum(d > 0 for d in res.drafted_per_forward[10:]) <= (N - 10) // 5  # mostly plain steps after the start


class Switching(SequenceDrafter):
    """Proposes the true continuation shifted (always wrong) until the context reaches ``until`` ids, then right."""

    def __init__(self, seq, until: int) -> None:
        super().__init__(seq, "switching")
        self.until = until

    def propose(self, context, max_depth):
        self.shift = 1 if len(context) < self.until else 0
        return super().propose(context, max_depth)


def test_acceptance_that_returns_reenables_drafting(tiny_llama, want):
    """Wrong for 60 tokens (the policy stops drafting), then right: drafting resumes one probe interval later
    (probes are spaced so that a useless source costs at most PROBE_OVERHEAD; one that pays is probed again at once)."""
    until = len(PROMPT) + 60
    drafter = Switching(PROMPT + want + [0] * 60, until)
    res = Engine(tiny_llama, [drafter], policy=policy(CPU_LIKE)).generate(PROMPT, N)
    assert res.output_ids == want
    emitted, switch = 0, None
    for f, n_acc in enumerate(res.accepted_per_forward):
        if switch is None and len(PROMPT) + emitted >= until:
            switch = f
        emitted += n_acc + 1
    assert sum(res.accepted_per_forward[:switch]) == 0
    assert sum(d > 0 for d in res.drafted_per_forward[switch - 20:switch]) <= 4  # mostly off while wrong
    after = res.accepted_per_forward[switch:]
    resumed = next(i for i, a in enumerate(after) if a >= 4)
    interval = math.ceil((CPU_LIKE.cost(1) - 1) / PROBE_OVERHEAD)  # a 1-token probe's wait: 20 steps here
    assert resumed <= interval + 6, after  # one probe interval, then a few probes in a row
    assert len(after) <= resumed + 5  # and the remaining tokens go in a few deep forwards


def test_policy_observes_only_what_was_emitted(tiny_llama, want):
    """EOS inside an accepted draft: the policy is told the draft depth up to the emitted tokens, not beyond."""
    eos = want[20]
    stop = want.index(eos) + 1
    seen: list[tuple[str, int, int]] = []

    class Recording(SpeculationPolicy):
        def observe(self, source, depth, accepted):
            seen.append((source, depth, accepted))
            super().observe(source, depth, accepted)

    drafter = SequenceDrafter(PROMPT + want)
    res = Engine(tiny_llama, [drafter], eos_token_ids=[eos],
                 policy=Recording(FLAT, max_nodes=MAX_DRAFT_DEPTH)).generate(PROMPT, N)
    assert res.output_ids == want[:stop]
    # one forward verified the whole draft (48 deep on the flat curve); only the `stop` emitted tokens were judged
    assert res.forwards == 1 and res.drafted_per_forward[0] > stop
    assert seen == [(drafter.name, stop, stop)]
    assert sum(a for _, _, a in seen) <= len(res.output_ids)
    assert seen[-1][1] <= stop


def test_a_streamed_prompts_forward_waits_for_an_unproven_draft(tiny_llama, want):
    """Streaming, the prompt's forward carries a draft only when its first token is likely right (prompt_chance):
    a source the policy knows nothing of (P = 0.5) waits for the next forward, so the first token is not delayed;
    once the source has been right, the next prompt's forward carries its draft. Not streaming (the whole answer is
    awaited), the price alone decides and the first forward drafts. Output identical every time."""
    def run(pol, streaming=True, shift=0):
        res = Engine(tiny_llama, [SequenceDrafter(PROMPT + want, shift=shift)], policy=pol).generate(
            PROMPT, N, streaming=streaming)
        assert res.output_ids == want
        return res.draft_depth_per_forward

    pol = policy(FLAT)
    first = run(pol)
    assert first[0] == 0 and max(first[1:]) > 0
    for _ in range(2):  # right in every forward: the level-1 estimate climbs past prompt_chance
        run(pol)
    assert run(pol)[0] > 0
    assert run(policy(FLAT), shift=1)[0] == 0
    assert run(policy(FLAT), streaming=False)[0] > 0


def test_priority_mode_falls_through_to_the_next_source(tiny_llama, want):
    """A useless first source does not block a good second one: the policy drops the first and verifies the next."""
    wrong = SequenceDrafter(PROMPT + want + [0] * 60, "wrong", shift=1)
    right = SequenceDrafter(PROMPT + want, "right")
    res = Engine(tiny_llama, [wrong, right], policy=policy(CPU_LIKE)).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.sources["right"].accepted > N // 2
    assert res.forwards <= 12


def test_ngram_proposal_carries_its_match_length():
    import numpy as np

    d = NgramDrafter(k=4, min_n=2, max_n=5)
    tree = d.propose(np.array([1, 2, 3, 9, 1, 2, 3]), 4)
    assert isinstance(tree, TokenTree) and tree.tokens == [9, 1, 2, 3] and tree.match_length == 3


def test_subtree_renumbers_and_carries_sources_and_counts():
    tree = TokenTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 2], "corpus", counts=[4, 3, 1, 1], match_length=5)
    tree.sources[3] = "ngram"
    sub = tree.subtree([0, 2, 3])
    assert sub.tokens == [5, 7, 8] and sub.parents == [-1, 0, 1] and sub.depths == [1, 2, 3]
    assert sub.sources == ["corpus", "corpus", "ngram"] and sub.counts == [4, 1, 1] and sub.match_length == 5
    assert tree.subtree([0, 1, 2, 3]) is tree and len(tree.subtree([])) == 0
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 3])


def test_candidates_keep_each_sources_priors_on_its_own_nodes():
    from redraft.policy.candidates import Candidates, proposal_priors

    corpus = TokenTree.from_parents([5, 6, 7], [-1, 0, 0], "corpus", counts=[4, 3, 1], match_length=2)
    ngram = TokenTree.chain([5, 9, 9], "ngram")
    ngram.match_length = 3
    cand = Candidates()
    cand.add(corpus, "corpus")
    cand.add(ngram, "ngram")  # shares node 5 with the corpus proposal: it stays the corpus's
    assert cand.tree.tokens == [5, 6, 7, 9, 9] and cand.tree.sources[3:] == ["ngram", "ngram"]
    assert cand.keys == ["corpus/2"] * 3 + ["ngram/2"] * 2  # learned apart, per source and match length
    assert cand.priors[:3] == pytest.approx(list(proposal_priors(corpus)))
    assert cand.priors[3:] == pytest.approx(list(proposal_priors(ngram))[1:])
    assert proposal_priors(TokenTree.chain([1, 2], "x")) is None  # no counts, no match length: nothing known


def test_policy_keys_split_sources_by_power_of_two_match_length():
    from redraft.policy.candidates import policy_key

    assert [policy_key("corpus", n) for n in (0, 1, 2, 3, 4, 7, 8, 63, 64)] == [
        "corpus", "corpus/1", "corpus/2", "corpus/2", "corpus/4", "corpus/4", "corpus/8", "corpus/32", "corpus/64"]


# per token, a forward past 32 draft tokens costs more than one of 32 (as a one-thread CPU's past 64): 32-token drafts
# are the best single forward, but a remainder of 33-64 tokens costs less in one forward than in 32 + the rest
KINK32 = CostCurve((0, 1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.6, 1.8, 1.8, 2.0, 2.2, 2.5, 5.4, 11.0))


def test_a_replays_tail_goes_in_one_forward_and_stays_exact(tiny_llama, want):
    """A replay whose remainder is cheaper in one forward than in forwards of the best single depth is verified
    whole (no short last forward: 3 forwards for 110 tokens where 32-token forwards take 4, the whole answer in the
    prefill's forward when the prompt matches past 64 ids), and drafts past 48 stay exact."""
    long_prompt = [(7 * i + 3) % VOCAB for i in range(70)]
    long_want = plain_greedy(tiny_llama, long_prompt, 56)
    for prompt, wanted, most in ((PROMPT, want, 3), (long_prompt, long_want, 1)):
        corpus = Corpus.from_spans([prompt + wanted], vocab_size=VOCAB)
        eng = Engine(tiny_llama, build_drafters(corpus, ngram=False, policy=True), max_depth=128, tree_budget=128,
                     policy=SpeculationPolicy(KINK32, max_nodes=128))
        for _ in range(2):  # a fresh policy, then one that has learned the source
            res = eng.generate(prompt, len(wanted))
            assert res.output_ids == wanted
            assert res.forwards <= most, res.draft_depth_per_forward
            assert res.accepted_per_forward == res.draft_depth_per_forward  # every drafted token accepted
    assert res.draft_depth_per_forward == [len(long_want) - 1]  # 55 draft tokens: past Colibri's cap of 48
