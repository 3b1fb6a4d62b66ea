"""Runs of one id and periodic stretches are drafted at full depth (issue 11, item 5).

The most recent occurrence of a self-overlapping suffix sits at the end of its run, so Colibri's rule alone drafts
one id there, or jumps past the run. The corpus aligns on the context's run and prefers occurrences with k ids to
follow; the n-gram drafter reads a continuation that runs into the live tail through the draft itself.
"""

from unittest.mock import patch

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_corpus import ref_periodic_tail, ref_propose

from redraft.corpus import Corpus, index
from redraft.drafters import NgramDrafter

NOISE = st.lists(st.integers(0, 40), min_size=1, max_size=30)  # ids that never occur in a planted span
FRESH = 999  # an id that occurs nowhere in a corpus


def test_issue_inputs():
    assert Corpus.from_spans([[7] * 100]).propose(np.array([7] * 10), 8)[1].tolist() == [7] * 8
    assert Corpus.from_spans([[7] * 100 + [1, 2, 3]]).propose(np.array([7] * 10), 8)[1].tolist() == [7] * 8
    assert NgramDrafter(k=8).propose(np.array([9, 9] + [7] * 40), 8).tokens == [7] * 8


def test_run_aligned_with_the_context_is_followed_to_its_end():
    c = Corpus.from_spans([[5] + [7] * 100 + [1, 2, 3]])
    assert c.propose(np.array([5] + [7] * 96), 8)[1].tolist() == [7, 7, 7, 7, 1, 2, 3]  # replay: the true ending
    # a run longer than any in the corpus: the longest part it has, i.e. the end of the corpus run
    assert c.propose(np.array([7] * 120), 8)[1].tolist() == [1, 2, 3]


def test_span_end_prefers_an_older_occurrence_with_k_ids():
    c = Corpus.from_spans([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9, 1, 2, 3, 40]])
    assert c.propose(np.array([1, 2, 3]), 8)[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert c.propose(np.array([1, 2, 3]), 1)[1].tolist() == [40]  # Colibri's rule where it yields k


def test_colibri_rule_kept_where_it_yields_k():
    c = Corpus.from_spans([[7] * 30 + [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert c.propose(np.array([7] * 10), 8)[1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


@st.composite
def planted(draw):
    """A span made of a unit of distinct ids repeated, and a context that ends with a prefix of it."""
    unit = draw(st.lists(st.integers(100, 160), min_size=1, max_size=12, unique=True))
    reps = draw(st.integers(1, 12))
    span = unit * reps
    assume(len(span) >= 4)
    j = draw(st.integers(3, len(span) - 1))
    return span, j


@settings(max_examples=300, deadline=None, derandomize=True)
@given(planted(), st.lists(NOISE, max_size=4), st.lists(NOISE, max_size=4), st.lists(st.integers(1, 200), max_size=3),
       st.integers(1, 48), st.booleans(), st.integers(0, 8))
def test_corpus_draft_is_the_planted_continuation(plant, before, after, cuts, k, fresh, split):
    """Context ends with span[:j]: the draft is span[j:j + min(k, ids left in the span)].

    Noise spans use other ids. Truncated copies span[:m] may sit anywhere when the span has one period; a
    periodic span's copies are older than it (a newer, shorter copy at an earlier phase could yield k ids by
    Colibri's rule, which is kept). Some spans are appended after the build, as separate index segments.
    """
    span, j = plant
    copies = [span[:max(1, m % len(span))] for m in cuts]
    periodic = len(span) > len(set(span))
    spans = before + copies + [span] + after if periodic else before + copies[:1] + [span] + copies[1:] + after
    split = min(split, len(spans))
    c = Corpus.from_spans(spans[:split])
    for s in spans[split:]:
        c.append(s)
    context = ([FRESH] if fresh else []) + span[:j]
    n, ids = c.propose(np.array(context), k)
    left = len(span) - j
    assert ids.tolist() == span[j:j + min(k, left)]
    assert (n, ids.tolist()) == ref_propose(spans, context, k)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 4), max_size=30), max_size=8), st.lists(st.integers(0, 4), min_size=3,
       max_size=5, unique=True), st.lists(st.integers(0, 4), min_size=12, max_size=12), st.integers(0, 8),
       st.integers(1, 12))
def test_stream_search_after_the_most_recent_occurrence_is_exact(spans, context, more, where, k):
    """With every range treated as large, the bounded search of the stream finds the most recent occurrence with
    k ids to follow (one is planted; distinct context ids: no periodic tail, so no alignment)."""
    assert ref_periodic_tail(context, 3) is None
    spans = spans[:where] + [context + more] + spans[where:]
    want = ref_propose(spans, context, k)
    assert len(want[1]) == k
    with patch.object(index, "SCAN_ROWS", 0), patch.object(index, "SCAN_WINDOW", 10**6):
        n, ids = Corpus.from_spans(spans).propose(np.array(context), k)
    assert (n, ids.tolist()) == want


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 3), max_size=25), max_size=8), st.lists(st.integers(0, 3), min_size=3,
       max_size=12), st.integers(1, 12))
def test_sampled_search_proposes_a_real_continuation(spans, context, k):
    """With no room to search (large ranges, no window), the draft is still the continuation of an occurrence of
    the longest suffix, as long as the reference's when that has k ids in the most recent occurrence."""
    want_n, want = ref_propose(spans, context, k)
    with patch.object(index, "SCAN_ROWS", 0), patch.object(index, "SCAN_WINDOW", 0):
        n, ids = Corpus.from_spans(spans).propose(np.array(context), k)
    assert n == want_n
    if n:
        stream = [t for s in spans if s for t in s + [-1]]
        conts = set()
        for e in range(n, len(stream)):
            if stream[e - n:e] == context[-n:] and stream[e] != -1:
                cont = stream[e:e + k]
                conts.add(tuple(cont[:cont.index(-1)] if -1 in cont else cont))
        assert tuple(ids.tolist()) in conts


def test_large_range_uses_the_stream_next_to_the_newest_occurrence():
    old = [list(range(1, 21))] * 300  # > SCAN_ROWS occurrences of (1, 2, 3)
    c = Corpus.from_spans(old + [[0, 1, 2, 3, 4]])
    assert c.propose(np.array([99, 1, 2, 3]), 8)[1].tolist() == list(range(4, 12))
    far = Corpus.from_spans(old + [list(range(30, 30 + 3 * index.SCAN_WINDOW))] + [[0, 1, 2, 3, 4]])
    assert far.propose(np.array([99, 1, 2, 3]), 8)[1].tolist() == list(range(4, 12))  # found by the sample


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(100, 160), min_size=4, max_size=30, unique=True), NOISE, NOISE, st.integers(3, 40),
       st.integers(1, 48))
def test_ngram_draft_continues_the_planted_span(span, noise, gap, j, k):
    """Live context noise + span + gap + span[:j]: the draft starts with span[j:j + min(k, ids left)] and has k ids."""
    j = min(j, len(span) - 1)
    ctx = noise + span + gap + span[:j]
    p = NgramDrafter(k=k).propose(np.array(ctx), 48)
    left = len(span) - j
    assert len(p.tokens) == k
    assert p.tokens[:min(k, left)] == span[j:j + min(k, left)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(100, 160), min_size=1, max_size=12, unique=True), NOISE, st.integers(0, 60),
       st.integers(1, 48))
def test_ngram_draft_continues_a_live_periodic_run(unit, noise, extra, k):
    """A run of period p at least max_n + p long at the end of the context: k ids continuing the period."""
    length = 8 + len(unit) + extra
    run = [unit[i % len(unit)] for i in range(length)]
    p = NgramDrafter(k=k).propose(np.array(noise + run), 48)
    assert p.tokens == [unit[(length + i) % len(unit)] for i in range(k)]
