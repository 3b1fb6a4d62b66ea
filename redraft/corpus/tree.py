"""Most-frequent continuations of a matched suffix, as a small token tree (plain numpy data)."""

from __future__ import annotations

from dataclasses import dataclass, field
import heapq

import numpy as np


@dataclass
class DraftTree:
    """A token tree proposed from a corpus; no torch.

    tokens:  int64 [N] node token ids.
    parents: int64 [N] parent node index; -1 = child of the root (the context's last token).
    counts:  int64 [N] how many (sampled, see Corpus.propose_tree) occurrences support the node.
    Nodes are listed so that a parent always comes before its children.
    n_matched: suffix length n that was matched; n_occurrences: occurrences of that suffix in the corpus
    (before any sampling).
    """

    tokens: np.ndarray
    parents: np.ndarray
    counts: np.ndarray
    n_matched: int = 0
    n_occurrences: int = 0
    depth: np.ndarray = field(default=None, repr=False)  # int64 [N], 1 for children of the root

    def __post_init__(self):
        if self.depth is None:
            depth = np.zeros(len(self.parents), dtype=np.int64)
            for j, p in enumerate(self.parents.tolist()):
                depth[j] = 1 if p < 0 else depth[p] + 1
            self.depth = depth

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf token lists, in node order of their leaves."""
        parents = self.parents.tolist()
        has_child = set(p for p in parents if p >= 0)
        out = []
        for j in range(len(parents)):
            if j in has_child:
                continue
            path, node = [], j
            while node >= 0:
                path.append(int(self.tokens[node]))
                node = parents[node]
            out.append(path[::-1])
        return out


def most_frequent_tree(conts: np.ndarray, recency: np.ndarray, branches: int) -> tuple[list, list, list]:
    """Choose up to `branches` root-to-leaf paths from a prefix tree of continuations, greedily by count.

    conts: int64 [M, k] continuations, -1 after the end of each; recency: int64 [M] corpus position of each
    occurrence (higher = newer). Returns (tokens, parents, counts) lists, parents before children.

    Best-first: the candidate node with the highest count (ties: the one with the most recent supporting
    occurrence, which is unique among siblings) is taken and extended greedily down its highest-count child to a
    leaf; the siblings passed over become candidates. Each extension adds exactly one leaf, i.e. one path.
    The prefix tree is never materialised: rows are sorted lexicographically, so a node is a row range and its
    children are the runs of the next column inside that range.
    """
    if conts.shape[0] == 0 or conts.shape[1] == 0 or branches <= 0:
        return [], [], []
    order = np.lexsort(conts.T[::-1])
    conts, recency = conts[order], recency[order]
    k = conts.shape[1]
    tokens, parents, counts = [], [], []
    heap: list = []

    def push_children(lo: int, hi: int, depth: int, parent: int) -> tuple | None:
        """Push children of the node covering rows [lo, hi) at `depth`; return the best child (not pushed)."""
        if depth >= k:
            return None
        col = conts[lo:hi, depth]
        cuts = np.flatnonzero(col[1:] != col[:-1]) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [hi - lo]))
        kids = []
        for s, e in zip(starts.tolist(), ends.tolist()):
            if col[s] < 0:
                continue  # occurrences that stop here (separator or corpus end)
            newest = int(recency[lo + s:lo + e].max())
            kids.append((-(e - s), -newest, lo + s, lo + e, depth, parent))
        if not kids:
            return None
        best = min(kids)
        for kid in kids:
            if kid is not best:
                heapq.heappush(heap, kid)
        return best

    first = push_children(0, conts.shape[0], 0, -1)
    if first is not None:
        heapq.heappush(heap, first)
    n_paths = 0
    while heap and n_paths < branches:
        node = heapq.heappop(heap)
        while node is not None:
            neg_count, _, lo, hi, depth, parent = node
            tokens.append(int(conts[lo, depth]))
            parents.append(parent)
            counts.append(-neg_count)
            node = push_children(lo, hi, depth + 1, len(tokens) - 1)
        n_paths += 1
    return tokens, parents, counts
