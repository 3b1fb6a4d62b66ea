"""Draft sources: n-gram lookup, the acceptance guard, the corpus drafter's failure policy, K clamping."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import VOCAB, plain_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.compose import build_drafters
from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.drafters import AcceptanceGuard, CorpusDrafter, NgramDrafter
from redraft.drafters.frozen_corpus import K_MAX, clamp_k
from redraft.tree import TokenTree


def arr(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def ref_ngram(ctx: list[int], k: int, min_n: int, max_n: int) -> list[int] | None:
    """Brute force: longest n first; the most recent earlier occurrence whose continuation is non-empty; k tokens
    of its continuation, which past the end of ctx repeats the distance between that occurrence and the end."""
    L = len(ctx)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = ctx[L - n:]
        for end in range(L - 1, n - 1, -1):  # occurrence ctx[end-n:end], continuation starts at end < L
            if ctx[end - n:end] == suffix:
                ext = list(ctx)
                while len(ext) < end + k:
                    ext.append(ext[len(ext) - (L - end)])
                return ext[end:end + k]
    return None


# ---- NgramDrafter ------------------------------------------------------------------------------------------------

def test_ngram_most_recent_occurrence():
    d = NgramDrafter(k=3, min_n=2, max_n=4)
    ctx = [1, 2, 3, 4, 9, 8, 1, 2, 3, 4, 7, 5, 6, 1, 2, 3, 4]
    p = d.propose(arr(ctx), 8)
    assert isinstance(p, TokenTree) and p.is_chain and p.sources == ["ngram"] * 3
    assert list(p.tokens) == [7, 5, 6]  # the later of the two earlier occurrences


def test_ngram_longest_n_first():
    d = NgramDrafter(k=2, min_n=2, max_n=3)
    # "B C D" (n=3) occurs only early, followed by 50; "C D" (n=2) occurs more recently, followed by 60
    ctx = [10, 20, 30, 50, 51, 20 + 100, 20, 30, 60, 61, 62, 10, 20, 30]
    assert list(d.propose(arr(ctx), 8).tokens) == [50, 51]
    d2 = NgramDrafter(k=2, min_n=2, max_n=2)
    assert list(d2.propose(arr(ctx), 8).tokens) == [60, 61]


def test_ngram_never_proposes_an_empty_continuation():
    d = NgramDrafter(k=4, min_n=3, max_n=8)
    assert d.propose(arr([1, 2, 3, 4, 5]), 8) is None  # the suffix occurs only as itself
    d = NgramDrafter(k=4, min_n=3, max_n=8)
    p = d.propose(arr([5, 5, 5, 5]), 8)
    assert list(p.tokens) == [5, 5, 5, 5]  # overlapping occurrence: read through the draft, k tokens, never 0
    d = NgramDrafter(k=4, min_n=1, max_n=3)
    assert d.propose(arr([7]), 8) is None
    assert d.propose(arr([]), 8) is None


def test_ngram_respects_k_and_max_depth():
    ctx = list(range(20)) + list(range(5))
    d = NgramDrafter(k=6, min_n=3, max_n=5)
    assert list(d.propose(arr(ctx), 8).tokens) == [5, 6, 7, 8, 9, 10]
    d = NgramDrafter(k=6, min_n=3, max_n=5)
    assert list(d.propose(arr(ctx), 2).tokens) == [5, 6]
    assert d.propose(arr(ctx), 0) is None


def test_ngram_begin_resets_the_index():
    d = NgramDrafter(k=3, min_n=2, max_n=2)
    assert list(d.propose(arr([1, 2, 3, 1, 2]), 8).tokens) == [3, 1, 2]
    d.begin(arr([4, 5]))
    # a new, unrelated sequence: the old context's n-grams must be gone
    assert d.propose(arr([9, 9, 1, 2]), 8) is None


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramDrafter(min_n=0)
    with pytest.raises(ValueError):
        NgramDrafter(min_n=5, max_n=3)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(seq=st.lists(st.integers(0, 4), min_size=1, max_size=60), k=st.integers(1, 10),
       min_n=st.integers(1, 4), span=st.integers(0, 5), steps=st.lists(st.integers(1, 5), max_size=12))
def test_ngram_matches_brute_force_incrementally(seq, k, min_n, span, steps):
    """The incremental index agrees with a brute-force scan at every step of a growing context."""
    max_n = min_n + span
    d = NgramDrafter(k=k, min_n=min_n, max_n=max_n)
    d.begin(arr(seq[:1]))
    L = 1
    for s in steps + [len(seq)]:
        L = min(len(seq), L + s)
        ctx = seq[:L]
        p = d.propose(arr(ctx), 48)
        want = ref_ngram(ctx, k, min_n, max_n) if L > min_n else None
        assert (None if p is None else list(p.tokens)) == want
        if p is not None:
            assert 1 <= len(p) <= k


def test_ngram_paused_guard_proposes_nothing():
    g = AcceptanceGuard(0.5, window=4, pause=10)
    d = NgramDrafter(k=3, min_n=1, guard=g)
    ctx = arr([1, 2, 1, 2, 1, 2])
    assert d.propose(ctx, 8) is not None
    d.observe(4, 0, 1)
    assert not g.active and d.propose(ctx, 8) is None
    d.observe(0, 0, 10)
    assert g.active and d.propose(ctx, 8) is not None


# ---- AcceptanceGuard ---------------------------------------------------------------------------------------------

def test_guard_needs_24_proposed_tokens():
    g = AcceptanceGuard(0.5)
    assert g.window == 24 and g.pause == 256
    g.record(23, 0, 1)
    assert g.active  # 0% acceptance but only 23 proposed
    g.record(1, 0, 1)
    assert not g.active and g.pauses == 1


def test_guard_threshold_is_strictly_below_minacc():
    g = AcceptanceGuard(0.5)
    g.record(24, 12, 13)  # exactly 50%: not below
    assert g.active
    g.record(2, 0, 1)     # 12/26 < 50%
    assert not g.active


def test_guard_counts_accumulate_over_steps():
    g = AcceptanceGuard(0.5)
    for _ in range(3):
        g.record(8, 5, 6)  # 62.5%
    assert g.active and g.proposed == 24 and g.accepted == 15
    for _ in range(3):
        g.record(8, 0, 1)  # 15/48 < 50%
    assert not g.active


def test_guard_pauses_for_256_emitted_tokens_then_rearms():
    g = AcceptanceGuard(0.5)
    g.record(24, 0, 1)
    assert not g.active
    for _ in range(255):
        g.record(0, 0, 1)
        assert not g.active
    g.record(0, 0, 1)  # the 256th emitted token
    assert g.active
    assert g.proposed == 0 and g.accepted == 0  # fresh counts
    g.record(23, 0, 1)
    assert g.active
    g.record(1, 0, 1)
    assert not g.active and g.pauses == 2


def test_guard_pause_counts_multi_token_steps():
    g = AcceptanceGuard(0.5)
    g.record(30, 3, 4)
    for _ in range(25):
        g.record(0, 0, 10)  # 250 tokens
    assert not g.active
    g.record(0, 0, 9)       # 259 >= 256
    assert g.active


def test_guard_minacc_zero_never_pauses_and_bad_values_raise():
    g = AcceptanceGuard(0.0)
    g.record(1000, 0, 1)
    assert g.active
    for bad in (-0.1, 1.5, 50):
        with pytest.raises(ValueError):
            AcceptanceGuard(bad)


# ---- CorpusDrafter -----------------------------------------------------------------------------------------------

class BrokenCorpus:
    n_tokens = 10

    def __init__(self):
        self.calls = 0

    def propose(self, context, k, min_n=3, max_n=8, context_n=None):
        self.calls += 1
        raise OSError("disk gone")


def test_corpus_drafter_turns_off_with_a_warning(capsys):
    corpus = BrokenCorpus()
    d = CorpusDrafter(corpus, k=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warnings filter cannot hide it: it is a line on stderr
        assert d.propose(arr([1, 2, 3, 4]), 8) is None
    assert d.failed
    assert d.propose(arr([1, 2, 3, 4, 5]), 8) is None
    assert corpus.calls == 1  # never asked again
    assert capsys.readouterr().err.splitlines() == [  # once, one line
        "redraft: warning: corpus drafts disabled: lookup failed (OSError: disk gone)"]


def test_broken_corpus_does_not_break_generation(tiny_llama, capsys):
    prompt = [1, 2, 3, 4, 5]
    want = plain_greedy(tiny_llama, prompt, 20)
    drafters = [CorpusDrafter(BrokenCorpus(), k=8), NgramDrafter(k=8, min_n=1)]
    res = Engine(tiny_llama, drafters, max_depth=8).generate(prompt, 20)
    assert res.output_ids == want
    assert sum("corpus drafts disabled" in line for line in capsys.readouterr().err.splitlines()) == 1


def test_corpus_drafter_proposes_from_a_real_corpus():
    corpus = Corpus.from_spans([[1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 3, 4, 5, 30, 31]], vocab_size=VOCAB)
    d = CorpusDrafter(corpus, k=2)
    p = d.propose(arr([0, 3, 4, 5]), 8)
    assert list(p.tokens) == [30, 31]  # most recent occurrence of (3, 4, 5)
    p = d.propose(arr([9, 9, 2, 3, 4, 5]), 8)
    assert list(p.tokens) == [6, 7]  # longer match (2, 3, 4, 5) wins
    assert list(d.propose(arr([0, 3, 4, 5]), 1).tokens) == [30]  # max_depth caps K
    assert d.propose(arr([50, 51, 52]), 8) is None
    assert d.propose(arr([3, 4, 5]), 0) is None


def test_corpus_drafter_guard_pauses_and_begin_rearms():
    corpus = Corpus.from_spans([[1, 2, 3, 4, 5, 6, 7, 8, 9]], vocab_size=VOCAB)
    d = CorpusDrafter(corpus, k=8, guard=AcceptanceGuard(0.5))
    ctx = arr([1, 2, 3])
    for _ in range(4):
        assert d.propose(ctx, 8) is not None
        d.observe(6, 0, 1)
    assert d.propose(ctx, 8) is None  # 24 proposed, 0 accepted: paused
    d.begin(ctx)
    assert d.propose(ctx, 8) is not None


def test_corpus_drafter_tree_branches_uses_propose_tree():
    corpus = Corpus.from_spans([[1, 2, 3, 4, 5], [1, 2, 3, 7, 8], [1, 2, 3, 4, 6]], vocab_size=VOCAB)
    d = CorpusDrafter(corpus, k=3, tree_branches=3)
    p = d.propose(arr([1, 2, 3]), 8)
    assert isinstance(p, TokenTree) and not p.is_chain and len(p.parents) == len(p.tokens)
    assert all(q < i for i, q in enumerate(p.parents))
    children_of_root = {t for t, q in zip(p.tokens, p.parents, strict=True) if q == -1}
    assert children_of_root == {4, 7}
    # what the corpus knows travels on the tree: counts per node, the matched suffix length, its occurrences
    assert p.match_length == 3 and p.occurrences == 3 and p.sources == ["corpus"] * len(p)
    assert {t: c for t, q, c in zip(p.tokens, p.parents, p.counts, strict=True) if q == -1} == {4: 2, 7: 1}


def test_corpus_drafter_chain_carries_the_match_length():
    corpus = Corpus.from_spans([[9, 1, 2, 3, 4, 5], [1, 2, 3, 7]], vocab_size=VOCAB)
    p = CorpusDrafter(corpus, k=3).propose(arr([9, 1, 2, 3]), 8)
    assert p.is_chain and p.tokens == [4, 5] and p.match_length == 4 and p.counts is None


# ---- clamp_k and build_drafters ----------------------------------------------------------------------------------

@pytest.mark.parametrize("k,want", [(0, 1), (-5, 1), (49, 48), (1000, 48)])
def test_clamp_k_warns_and_clamps(capsys, k, want):
    assert clamp_k(k) == want
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and f"K={k}" in err and f"using {want}" in err


@pytest.mark.parametrize("k", [1, 8, 48])
def test_clamp_k_in_range_is_silent(capsys, k):
    assert clamp_k(k) == k
    assert capsys.readouterr().err == ""


def test_clamp_k_silent_when_asked(capsys):
    assert clamp_k(99, warn=False) == K_MAX
    assert capsys.readouterr().err == ""


def test_corpus_drafter_clamps_k(capsys):
    assert CorpusDrafter(BrokenCorpus(), k=100).k == 48
    assert "warning" in capsys.readouterr().err


def test_build_drafters_priority_and_settings():
    corpus = Corpus.from_spans([[1, 2, 3, 4]], vocab_size=VOCAB)
    ds = build_drafters(corpus, k=12, minacc=0.25)
    assert [d.name for d in ds] == ["corpus", "ngram"]
    assert ds[0].k == 12 and ds[1].k == 12
    assert ds[0].guard.minacc == 0.25 and ds[0].guard.pause == 256
    # the n-gram guard is looser (it pays at low acceptance) but never stricter than the corpus one
    assert ds[1].guard.minacc == 0.2 and ds[1].guard.pause == 64
    assert build_drafters(None, minacc=0.1)[0].guard.minacc == 0.1
    assert ds[0].guard is not ds[1].guard
    assert [d.name for d in build_drafters(None)] == ["ngram"]
    assert build_drafters(None, ngram=False) == []
    assert [d.name for d in build_drafters(corpus, ngram=False)] == ["corpus"]
    assert build_drafters(None, k=8, ngram_k=3)[0].k == 3


def test_corpus_priority_over_ngram_in_the_engine(tiny_llama):
    """With both sources proposing, the corpus (first) wins the step unless merge=True."""
    prompt = [1, 2, 3, 1, 2, 3]
    want = plain_greedy(tiny_llama, prompt, 20)
    corpus = Corpus.from_spans([prompt + want], vocab_size=VOCAB)
    res = Engine(tiny_llama, build_drafters(corpus, k=8, minacc=0.0), max_depth=8).generate(prompt, 20)
    assert res.output_ids == want
    assert res.sources["corpus"].accepted > 0
    assert res.sources["ngram"].proposed == 0  # the corpus always had a proposal


# ---- adaptive corpus depth ---------------------------------------------------------------------------------------

def test_adaptive_depth_grows_on_whole_acceptance_and_resets(tiny_llama):
    prompt = [40, 41, 42, 43]
    want = plain_greedy(tiny_llama, prompt, 60)
    corpus = Corpus.from_spans([prompt + want], vocab_size=VOCAB)
    fixed = Engine(tiny_llama, [CorpusDrafter(corpus, k=4)], max_depth=32).generate(prompt, 60)
    drafter = CorpusDrafter(corpus, k=4, k_max=32)
    adaptive = Engine(tiny_llama, [drafter], max_depth=32).generate(prompt, 60)
    assert fixed.output_ids == adaptive.output_ids == want
    assert adaptive.forwards < fixed.forwards
    # depths at least double while drafts are accepted whole (4, 8, 16, ... up to what is left to draft), and a
    # match reaching past 8 context ids drafts as many ids as it matched: 4 (5 ids matched), 9, 19, then 24 left
    depths = [d for d in adaptive.drafted_per_forward if d]
    assert depths == [4, 9, 19, 24]
    emitted = 1
    for prev, d in zip(depths, depths[1:], strict=False):
        emitted += prev + 1
        assert d >= min(2 * prev, 32, 60 - emitted - 1)
    no_extension = Engine(tiny_llama, [CorpusDrafter(corpus, k=4, k_max=32, context_n=None)], max_depth=32)
    assert no_extension.generate(prompt, 60).drafted_per_forward[:4] == [4, 8, 16, 28]  # doubling alone
    drafter.observe(proposed=8, accepted=3, emitted=4)
    assert drafter.depth == 4


def test_adaptive_depth_respects_cap_and_default_off():
    corpus = Corpus.from_spans([[1, 2, 3, 4]], vocab_size=VOCAB)
    assert CorpusDrafter(corpus, k=8).k_max == 8
    assert CorpusDrafter(corpus, k=8, k_max=100).k_max == K_MAX
    d = CorpusDrafter(corpus, k=8, k_max=16)
    for _ in range(5):
        d.observe(proposed=d.depth, accepted=d.depth, emitted=d.depth + 1)
    assert d.depth == 16


def test_corpus_guard_window_is_three_drafts():
    corpus = Corpus.from_spans([[1, 2, 3, 4]], vocab_size=VOCAB)
    assert build_drafters(corpus, k=8)[0].guard.window == 24  # Colibri's contract at the default K
    assert build_drafters(corpus, k=4)[0].guard.window == 24
    assert build_drafters(corpus, k=32)[0].guard.window == 96
    assert build_drafters(corpus, k=8, k_max=48)[0].guard.window == 144


def test_a_short_match_shared_by_several_answers_gives_its_chain_a_low_first_prior():
    """Under the policy, a chain after a suffix that three stored spans share, each continuing differently, credits
    its first token with 1 of 3 occurrences (SuffixDecoding's counts, with one share kept for a continuation not
    seen yet: 1/4); a suffix found once gives it 1/2 of the match-length prior; without the policy nothing is
    counted."""
    from redraft.policy.candidates import proposal_priors
    from redraft.policy.priors import succession_priors

    shared = [40, 41, 42, 43, 44]
    corpus = Corpus.from_spans([shared + [1, 2, 3], shared + [4, 5, 6], shared + [7, 8, 9]], vocab_size=VOCAB)
    context = np.array([60, 61] + shared, dtype=np.int64)
    tree = CorpusDrafter(corpus, k=3, deep=64).propose(context, 3)
    assert tree.tokens == [7, 8, 9] and tree.counts == [1, 1, 1] and tree.root_count == 3
    succ = succession_priors(tree.parents, tree.match_length)
    assert np.allclose(proposal_priors(tree), [succ[0] / 4, succ[1], succ[2]])  # deeper: given the first
    once = CorpusDrafter(Corpus.from_spans([shared + [1, 2, 3]], vocab_size=VOCAB), k=3, deep=64).propose(context, 3)
    once_succ = succession_priors(once.parents, once.match_length)
    assert once.root_count == 1 and np.allclose(proposal_priors(once), [once_succ[0] / 2, *once_succ[1:]])
    fixed = CorpusDrafter(corpus, k=3).propose(context, 3)
    assert fixed.counts is None and fixed.root_count == 0
