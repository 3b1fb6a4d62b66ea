"""Corpus.propose_tree: most frequent continuations as Branches (plain numpy arrays)."""

from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.corpus import Branches, Corpus
from redraft.corpus import corpus as corpus_mod


def tree_of(spans, context, k, branches=4, **kw):
    return Corpus.from_spans(spans).propose_tree(np.asarray(context), k, branches=branches, **kw)


def depths(t: Branches) -> np.ndarray:
    """int64 [N]: 1 for children of the root."""
    out = np.zeros(len(t.parents), dtype=np.int64)
    for j, p in enumerate(t.parents.tolist()):
        out[j] = 1 if p < 0 else out[p] + 1
    return out


def paths(t: Branches) -> list[list[int]]:
    """Root-to-leaf token lists, in node order of their leaves."""
    parents = t.parents.tolist()
    has_child = set(p for p in parents if p >= 0)
    out = []
    for j in range(len(parents)):
        if j in has_child:
            continue
        path, node = [], j
        while node >= 0:
            path.append(int(t.tokens[node]))
            node = parents[node]
        out.append(path[::-1])
    return out


def assert_well_formed(t: Branches, k: int, branches: int):
    assert t.tokens.dtype == t.parents.dtype == t.counts.dtype == np.int64
    assert len(t.tokens) == len(t.parents) == len(t.counts)
    for j, p in enumerate(t.parents.tolist()):
        assert -1 <= p < j  # parents first
        if p >= 0:
            assert t.counts[p] >= t.counts[j]
    assert len(paths(t)) <= branches
    assert all(len(p) <= k for p in paths(t))
    assert int(depths(t).max()) <= k


def test_counts_and_order_by_frequency():
    spans = [[1, 2, 3, 7, 8], [1, 2, 3, 7, 9], [1, 2, 3, 7, 9], [1, 2, 3, 5, 6]]
    t = tree_of(spans, [1, 2, 3], 2)
    assert_well_formed(t, 2, 4)
    assert t.match_length == 3 and t.occurrences == 4
    assert paths(t) == [[7, 9], [5, 6], [7, 8]]
    assert t.tokens.tolist() == [7, 9, 5, 6, 8]
    assert t.parents.tolist() == [-1, 0, -1, 2, 0]
    assert t.counts.tolist() == [3, 2, 1, 1, 1]


def test_tie_break_prefers_most_recent_occurrence():
    spans = [[1, 2, 3, 40], [1, 2, 3, 50], [1, 2, 3, 40], [1, 2, 3, 50]]
    t = tree_of(spans, [1, 2, 3], 1, branches=1)
    assert t.tokens.tolist() == [50] and t.counts.tolist() == [2]
    spans2 = [[1, 2, 3, 50], [1, 2, 3, 40]]
    t2 = tree_of(spans2, [1, 2, 3], 1, branches=2)
    assert t2.tokens.tolist() == [40, 50]


def test_separators_end_branches():
    spans = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9]]
    t = tree_of(spans, [1, 2, 3], 8)
    assert paths(t) == [[4, 5, 6]]  # the first occurrence stops at its span end; nothing reads into [9]
    assert t.counts.tolist() == [2, 1, 1]


def test_branch_and_depth_limits():
    spans = [[0, 0, 1, t, t + 1, t + 2, t + 3] for t in range(10, 80, 10)]
    for branches in (1, 2, 3):
        for k in (1, 2, 4):
            t = tree_of(spans, [0, 0, 1], k, branches=branches)
            assert_well_formed(t, k, branches)
            assert len(paths(t)) == branches
            assert all(len(p) == k for p in paths(t))


def test_longest_suffix_rule_and_no_match():
    spans = [[5, 1, 2, 3, 6], [1, 2, 3, 7], [1, 2, 3, 7]]
    t = tree_of(spans, [5, 1, 2, 3], 4)
    assert t.match_length == 4 and paths(t) == [[6]]
    assert tree_of(spans, [8, 8, 8], 4) is None
    assert tree_of(spans, [2, 3], 4) is None
    assert Corpus.from_spans([]).propose_tree(np.array([1, 2, 3]), 4) is None


def test_tree_spans_appended_segments():
    c = Corpus.from_spans([[1, 2, 3, 7], [1, 2, 3, 7]])
    c.append([1, 2, 3, 8])
    c.append([1, 2, 3, 8, 1])
    c.append([1, 2, 3, 8, 2])
    t = c.propose_tree(np.array([1, 2, 3]), 2, branches=2)
    assert t.tokens.tolist()[:1] == [8] and t.counts[0] == 3
    # 8 (count 3) first, extended by the newer of the tied 8-1 / 8-2; then 7 (count 2).
    assert paths(t) == [[8, 2], [7]]


def test_many_occurrences_are_sampled_and_bounded():
    rng = np.random.default_rng(0)
    spans = [[1, 2, 3] + rng.integers(10, 60, 6).tolist() for _ in range(3000)]
    c = Corpus.from_spans(spans)
    t = c.propose_tree(np.array([1, 2, 3]), 6, branches=4)
    assert t.occurrences == 3000
    assert_well_formed(t, 6, 4)
    assert len(paths(t)) <= 4
    assert int(t.counts[t.parents == -1].sum()) <= 1025  # a sample, not all 3000


def test_propose_and_tree_agree_on_n():
    spans = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6]]
    c = Corpus.from_spans(spans)
    n, ids = c.propose(np.array([2, 3, 4]), 4)
    t = c.propose_tree(np.array([2, 3, 4]), 4)
    assert t.match_length == n
    assert ids.tolist() in paths(t)


@pytest.mark.parametrize("branches,k", [(0, 3), (2, 0)])
def test_degenerate_limits(branches, k):
    assert tree_of([[1, 2, 3, 4]], [1, 2, 3], k, branches=branches) is None


@settings(max_examples=60, deadline=None)
@given(spans=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=8),
       context=st.lists(st.integers(0, 3), min_size=2, max_size=6), k=st.integers(1, 6), branches=st.integers(1, 5))
def test_python_and_numpy_tree_builders_agree(spans, context, k, branches):
    c = Corpus.from_spans(spans)
    small = c.propose_tree(np.array(context), k, branches=branches, min_n=2)
    with patch.object(corpus_mod, "TREE_SMALL", 0):
        big = c.propose_tree(np.array(context), k, branches=branches, min_n=2)
    if small is None:
        assert big is None
        return
    assert_well_formed(small, k, branches)
    for field in ("tokens", "parents", "counts"):
        assert getattr(small, field).tolist() == getattr(big, field).tolist()
