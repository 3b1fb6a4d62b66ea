"""redraft.corpus lookup contract: longest suffix, most recent, separators, limits, append; against brute force."""

from unittest.mock import patch

import numpy as np
import pytest
from conftest import stream_of
from hypothesis import given, settings
from hypothesis import strategies as st
from pydivsufsort import divsufsort

from redraft.corpus import Corpus, index, load_corpus


def ref_periodic_tail(context, n, period_cap=64, run_cap=1024):
    """Brute force of the context's periodic tail run: (run ids oldest first, the id continuing it back) or None."""
    ctx = list(context)[-run_cap:]
    L = len(ctx)
    for p in range(1, min(period_cap, L - n) + 1):
        if ctx[L - n - p:L - p] == ctx[L - n:]:
            r = p
            while r < L and ctx[L - 1 - r] == ctx[L - 1 - r + p]:
                r += 1
            return ctx[L - r:], ctx[L - r + p - 1]
    return None


def ref_propose(spans, context, k, min_n=3, max_n=8, context_n=4096):
    """Brute force after the contract: scan every n from max(max_n, context_n) down (a match past max_n is the
    longer preceding context), every position from the newest.

    Among the occurrences of the longest suffix: the most recent if it has k ids to follow; else, when the context
    ends in a periodic run, those preceded by the same run length (then by the longest part of it); then the most
    recent with k ids to follow, else the longest continuation, most recent first.
    """
    stream = stream_of(spans)
    context = [int(t) for t in context]

    def cont(end):
        out = []
        for t in stream[end + 1:end + 1 + k]:
            if t == -1:
                break
            out.append(t)
        return out

    for n in range(min(max(max_n, context_n or 0), len(context)), min_n - 1, -1):
        pat = context[-n:]
        # `end` = last matched position, needs a next id; newest first
        ends = [end for end in range(len(stream) - 2, n - 2, -1)
                if stream[end - n + 1:end + 1] == pat and stream[end + 1] != -1]
        if not ends:
            continue
        if len(cont(ends[0])) >= k:
            return n, cont(ends[0])
        tail = ref_periodic_tail(context, min(n, max_n))
        if tail is not None and len(tail[0]) < n:
            tail = None  # matched past the run: aligned already

        def align(end, tail=tail):
            if tail is None:
                return 0
            run, more = tail
            m = 0
            while m < len(run) and end - m >= 0 and stream[end - m] == run[-1 - m]:
                m += 1
            exact = m == len(run) and (end - m < 0 or stream[end - m] != more)
            return 2 * m + exact

        best = max(ends, key=lambda e: (align(e), len(cont(e)), e))
        return n, cont(best)
    return 0, []


def check(corpus, spans, context, k, min_n=3, max_n=8):
    n, ids = corpus.propose(np.asarray(context, dtype=np.int64), k, min_n=min_n, max_n=max_n)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert (n, ids.tolist()) == ref_propose(spans, context, k, min_n, max_n)


def test_longest_suffix_wins():
    spans = [[1, 2, 3, 4, 50, 51], [9, 9, 2, 3, 4, 60, 61]]
    c = Corpus.from_spans(spans)
    # "1 2 3 4" (n=4) only in the older span beats the newer "2 3 4" (n=3).
    n, ids = c.propose(np.array([7, 1, 2, 3, 4]), 8)
    assert n == 4 and ids.tolist() == [50, 51]
    n, ids = c.propose(np.array([8, 2, 3, 4]), 8)
    assert n == 3 and ids.tolist() == [60, 61]


def test_newer_beats_older():
    c = Corpus.from_spans([[5, 6, 7, 1], [5, 6, 7, 2], [0, 5, 6, 7, 3, 4]])
    n, ids = c.propose(np.array([5, 6, 7]), 4)
    assert n == 3 and ids.tolist() == [3, 4]


def test_separator_stops_proposal_and_empty_continuation_is_skipped():
    c = Corpus.from_spans([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3]])
    # The newest "1 2 3" ends its span (empty continuation): the older one wins.
    n, ids = c.propose(np.array([1, 2, 3]), 8)
    assert n == 3 and ids.tolist() == [4, 5, 6, 7]
    c2 = Corpus.from_spans([[1, 2, 3, 4], [5, 6]])
    n, ids = c2.propose(np.array([1, 2, 3]), 8)
    assert ids.tolist() == [4]  # stops at the separator, never reads into [5, 6]


def test_match_never_spans_a_separator():
    c = Corpus.from_spans([[7, 1, 2], [3, 4, 5]])
    # "2 3 4" exists only across the boundary; "3 4" alone is shorter than min_n.
    assert c.propose(np.array([1, 2, 3, 4]), 8)[0] == 0
    n, ids = c.propose(np.array([1, 2, 3, 4]), 8, min_n=2)
    assert n == 2 and ids.tolist() == [5]


def test_length_at_most_k():
    c = Corpus.from_spans([list(range(100))])
    for k in (1, 2, 5, 48):
        n, ids = c.propose(np.array([0, 1, 2]), k)
        assert n == 3 and ids.tolist() == list(range(3, 3 + k))
    assert c.propose(np.array([0, 1, 2]), 0)[0] == 0


def test_no_proposal_cases():
    c = Corpus.from_spans([[1, 2, 3, 4, 5]])
    assert c.propose(np.array([7, 8, 9]), 4)[0] == 0  # absent suffix
    assert c.propose(np.array([2, 3]), 4)[0] == 0  # shorter than min_n
    assert c.propose(np.array([3, 4, 5]), 4)[0] == 0  # only occurrence is at the corpus end
    empty = Corpus.from_spans([])
    n, ids = empty.propose(np.array([1, 2, 3]), 4)
    assert n == 0 and ids.dtype == np.int64 and len(ids) == 0
    assert Corpus.from_spans([[], []]).n_tokens == 0


def test_max_n_and_min_n_are_honoured():
    c = Corpus.from_spans([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 6, 7, 8, 20]])
    n, ids = c.propose(np.arange(1, 9), 4, min_n=2, max_n=4, context_n=None)
    assert n == 4 and ids.tolist() == [9, 10, 11]
    n, ids = c.propose(np.arange(1, 9), 4, min_n=2, max_n=4)  # all 4 match: extended over the whole context
    assert n == 8 and ids.tolist() == [9, 10, 11]
    n, ids = c.propose(np.array([0, 7, 8]), 1, min_n=2, max_n=2)
    assert n == 2 and ids.tolist() == [20]


def test_context_ids_beyond_the_token_width_do_not_match():
    c = Corpus.from_spans([[1, 2, 3, 4]])
    assert c.propose(np.array([1, 2, 3, 70000]), 4)[0] == 0
    assert c.propose(np.array([70000, 1, 2, 3]), 4) [1].tolist() == [4]


def test_context_as_list_and_int32():
    c = Corpus.from_spans([[1, 2, 3, 4]])
    assert c.propose([1, 2, 3], 2)[1].tolist() == [4]
    assert c.propose(np.array([1, 2, 3], dtype=np.int32), 2)[1].tolist() == [4]


def test_wide_ids_use_uint32_symbols():
    spans = [[70000, 70001, 70002, 5, 100000], [1, 70001, 70002, 5, 7]]
    c = Corpus.from_spans(spans, vocab_size=150000)
    assert c.stats()["token_width"] == 4
    check(c, spans, [70001, 70002, 5], 3)
    check(c, spans, [70000, 70001, 70002, 5], 3)


def test_append_then_lookup_prefers_new_span():
    c = Corpus.from_spans([[1, 2, 3, 4, 5]])
    c.append([9, 1, 2, 3, 40])
    # k = 1: the newest occurrence yields k ids, so recency decides (a deeper k prefers the longer continuation)
    assert c.propose(np.array([1, 2, 3]), 1)[1].tolist() == [40]
    assert c.propose(np.array([0, 1, 2, 3]), 1)[1].tolist() == [40]
    c.append([])  # no-op
    assert c.n_spans == 2 and c.n_tokens == 10


def test_append_longer_match_in_base_still_wins():
    c = Corpus.from_spans([[1, 2, 3, 4, 5, 6]])
    c.append([3, 4, 5, 99])
    n, ids = c.propose(np.array([2, 3, 4, 5]), 4)
    assert n == 4 and ids.tolist() == [6]


def test_append_many_keeps_few_segments_and_matches_rebuild():
    rng = np.random.default_rng(1)
    spans = [rng.integers(0, 5, rng.integers(1, 30)).tolist() for _ in range(60)]
    c = Corpus.from_spans(spans[:10])
    for s in spans[10:]:
        c.append(s)
    assert c.stats()["segments"] <= 1 + 8
    assert c.n_tokens == sum(map(len, spans)) and c.n_spans == 60
    for _ in range(50):
        ctx = rng.integers(0, 5, 9).tolist()
        check(c, spans, ctx, 6)
    c.compact()
    assert c.stats()["segments"] == 1
    for _ in range(50):
        ctx = rng.integers(0, 5, 9).tolist()
        check(c, spans, ctx, 6)


def test_with_span_leaves_the_snapshot_unchanged():
    """OnlineCorpus publishes with_span's result while other threads read the old corpus: the old one must not
    change, the new one must equal append() on a copy (same lookups, same segments)."""
    base = Corpus.from_spans([[1, 2, 3, 4, 5]])
    old = base.with_span([7, 1, 2, 3, 40])
    new = old.with_span([8, 1, 2, 3, 41])
    assert (old.n_spans, new.n_spans, base.n_spans) == (2, 3, 1)
    assert base.propose(np.array([1, 2, 3]), 1)[1].tolist() == [4]
    assert old.propose(np.array([1, 2, 3]), 1)[1].tolist() == [40]
    assert new.propose(np.array([1, 2, 3]), 1)[1].tolist() == [41]
    appended = Corpus.from_spans([[1, 2, 3, 4, 5]])
    for s in ([7, 1, 2, 3, 40], [8, 1, 2, 3, 41]):
        appended.append(s)
    assert new.stats()["segments"] == appended.stats()["segments"]
    assert [s.tolist() for s in new.span_list()] == [s.tolist() for s in appended.span_list()]


def test_append_to_empty_corpus():
    c = Corpus.from_spans([])
    c.append([1, 2, 3, 4])
    c.append([1, 2, 3, 5])
    assert c.propose(np.array([1, 2, 3]), 4)[1].tolist() == [5]


def test_append_checks_vocab():
    from redraft.corpus import CorpusError

    c = Corpus.from_spans([[1, 2, 3]], vocab_size=10)
    with pytest.raises(CorpusError, match="id 10 at position 1"):
        c.append([1, 10])
    with pytest.raises(CorpusError, match="id -1"):
        c.append([-1])


spans_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=25), min_size=0, max_size=8)


@settings(max_examples=150, deadline=None)
@given(spans=spans_strategy, context=st.lists(st.integers(0, 4), min_size=0, max_size=12),
       k=st.integers(1, 10), min_n=st.integers(1, 4), extra=st.integers(0, 5))
def test_propose_matches_brute_force(spans, context, k, min_n, extra):
    c = Corpus.from_spans(spans)
    check(c, spans, context, k, min_n=min_n, max_n=min_n + extra)


@settings(max_examples=60, deadline=None)
@given(spans=spans_strategy, more=spans_strategy, context=st.lists(st.integers(0, 3), min_size=3, max_size=10))
def test_append_matches_brute_force(spans, more, context):
    c = Corpus.from_spans(spans)
    for s in more:
        c.append(s)
    check(c, spans + more, context, 5, min_n=2, max_n=6)


def test_text_round_trip_keeps_lookups(tmp_path):
    spans = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 9]]
    p = tmp_path / "corpus.txt"
    p.write_text("1 2 3 4 -1 5 6\n7 -1\n\n-1 -1 1 2 3 9\n")
    c = load_corpus(p)
    assert c.n_tokens == 11 and c.n_spans == 3 and c.path == str(p)
    assert [s.tolist() for s in c.span_list()] == spans
    check(c, spans, [1, 2, 3], 4)


@settings(max_examples=80, deadline=None)
@given(spans=spans_strategy, context=st.lists(st.integers(0, 4), min_size=0, max_size=12), k=st.integers(1, 10))
def test_propose_matches_brute_force_with_libdivsufsort(spans, context, k):
    # Small streams are sorted in numpy; force the libdivsufsort path that big corpora take.
    with patch.object(index, "SMALL", 0):
        c = Corpus.from_spans(spans)
    check(c, spans, context, k, min_n=2, max_n=6)


@settings(max_examples=100, deadline=None)
@given(sym=st.lists(st.integers(0, 3), min_size=1, max_size=200), wide=st.booleans())
def test_prefix_doubling_equals_libdivsufsort(sym, wide):
    arr = np.array(sym, dtype=">u4" if wide else ">u2")
    raw = divsufsort(arr.view(np.uint8))
    ref = raw[raw % arr.itemsize == 0] // arr.itemsize
    assert index.prefix_doubling_sa(arr).tolist() == ref.tolist()


def test_large_random_corpus_against_brute_force():
    rng = np.random.default_rng(7)
    spans = [rng.integers(0, 6, rng.integers(50, 400)).tolist() for _ in range(60)]  # > SMALL symbols
    c = Corpus.from_spans(spans)
    assert c.n_tokens + c.n_spans - 1 > index.SMALL
    flat = [t for s in spans for t in s]
    for _ in range(40):
        p = int(rng.integers(10, len(flat)))
        ctx = flat[p - 10:p] if rng.random() < 0.7 else rng.integers(0, 6, 10).tolist()
        check(c, spans, ctx, 8)
