"""Most-frequent continuations of a matched suffix: the branches of a corpus token tree (plain numpy data)."""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np


class Branches(NamedTuple):
    """What :meth:`Corpus.propose_tree` found: the most frequent continuations of a matched suffix (plain numpy).

    Nodes are listed parents first; the drafter turns them into a :class:`redraft.tree.TokenTree`.

    Attributes:
        tokens: int64 [N] node token ids.
        parents: int64 [N] parent node index; -1 = child of the root (the context's last token).
        counts: int64 [N] how many occurrences (of the sample, see Corpus.propose_tree) support each node.
        match_length: suffix length n that was matched.
        occurrences: occurrences of that suffix in the corpus, before any sampling.
    """

    tokens: np.ndarray
    parents: np.ndarray
    counts: np.ndarray
    match_length: int
    occurrences: int


def most_frequent_tree(conts, recency, branches: int) -> tuple[list, list, list]:
    """Choose up to `branches` root-to-leaf paths from a prefix tree of continuations, greedily by count.

    conts: int64 [M, k] continuations padded with -1 after their end, or a list of M lists of ids (ragged);
    recency: [M] corpus position of each occurrence (higher = newer). Returns (tokens, parents, counts) lists,
    parents before children.

    Best-first: the candidate node with the highest count (ties: the one with the most recent supporting
    occurrence, which is unique among siblings) is taken and extended greedily down its highest-count child to a
    leaf; the siblings passed over become candidates. Each extension adds exactly one leaf, i.e. one path.
    The prefix tree is never materialised: rows are sorted lexicographically, so a node is a row range and its
    children are the runs of the next column inside that range (numpy for large ranges, plain Python for the
    usual handful of occurrences, where numpy's per-call cost dominates).
    """
    if branches <= 0 or len(conts) == 0:
        return [], [], []
    if isinstance(conts, np.ndarray):
        if conts.shape[1] == 0:
            return [], [], []
        rows = np.lexsort(conts.T[::-1])
        children = _array_children(conts[rows], np.asarray(recency)[rows])
        M = conts.shape[0]
    else:
        order = sorted(range(len(conts)), key=conts.__getitem__)
        children = _list_children([conts[j] for j in order], [recency[j] for j in order])
        M = len(conts)
    tokens, parents, counts = [], [], []
    heap: list = []

    def expand(lo: int, hi: int, depth: int, parent: int):
        """Push the children of a node (rows [lo, hi), depth) as candidates; return the best one, unpushed."""
        kids = [(-count, -newest, a, b, depth, parent, tok) for count, newest, a, b, tok in children(lo, hi, depth)]
        if not kids:
            return None
        best = min(kids)
        for kid in kids:
            if kid is not best:
                heapq.heappush(heap, kid)
        return best

    first = expand(0, M, 0, -1)
    if first is not None:
        heapq.heappush(heap, first)
    n_paths = 0
    while heap and n_paths < branches:
        node = heapq.heappop(heap)
        while node is not None:
            neg_count, _, lo, hi, depth, parent, tok = node
            tokens.append(tok)
            parents.append(parent)
            counts.append(-neg_count)
            node = expand(lo, hi, depth + 1, len(tokens) - 1)
        n_paths += 1
    return tokens, parents, counts


def _array_children(conts: np.ndarray, recency: np.ndarray):
    """children(lo, hi, depth) -> [(count, newest, lo, hi, token)] over sorted padded rows."""
    k = conts.shape[1]

    def children(lo: int, hi: int, depth: int) -> list:
        if depth >= k:
            return []
        col = conts[lo:hi, depth]
        cuts = np.flatnonzero(col[1:] != col[:-1]) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), hi - lo]
        out = []
        for s, e in zip(starts, ends, strict=True):
            tok = int(col[s])
            if tok >= 0:  # -1: occurrences that stop here (separator or corpus end)
                out.append((e - s, int(recency[lo + s:lo + e].max()), lo + s, lo + e, tok))
        return out

    return children


def _list_children(rows: list, recency: list):
    """children(lo, hi, depth) -> [(count, newest, lo, hi, token)] over sorted ragged rows."""

    def children(lo: int, hi: int, depth: int) -> list:
        out = []
        j = lo
        while j < hi and len(rows[j]) <= depth:  # rows that ended sort first
            j += 1
        while j < hi:
            tok = rows[j][depth]
            s, newest = j, recency[j]
            j += 1
            while j < hi and rows[j][depth] == tok:
                newest = max(newest, recency[j])
                j += 1
            out.append((j - s, newest, s, j, tok))
        return out

    return children
