"""TokenTree: the one data type between drafters and the verifier.

A token tree hangs off the *root*: the last token of the live context, whose logits the verify forward computes
anyway. Each node is one drafted token with a parent (-1 = child of the root), a depth (1 = child of the root)
and the drafter that proposed it. Nodes are kept in insertion order with every parent before its children, so
the linearised order is a valid topological order for the tree attention mask (SpecInfer / Medusa style trees).
A chain (each node the child of the one before) is the common case and lets the verifier use a plain causal mask.

Every drafter returns a TokenTree (or None); the engine merges the proposals of one step into the verify tree.
A tree is built at every decode step, so construction is plain Python lists and one dict, no numpy or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTree:
    """Drafted tokens arranged as a tree below the root.

    Attributes:
        tokens: node token ids (int), length N.
        parents: parent node index per node, -1 for children of the root; parents[i] < i.
        depths: 1-based depth per node (root children have depth 1).
        sources: name of the drafter that first proposed each node ("corpus", "ngram", ...).
        counts: None, or per node how many corpus occurrences support it (frozen-corpus trees; a node added
            later by another source counts 0). What a cost-aware policy reads to guess each node's acceptance.
        match_length: suffix length n the corpus matched for this proposal (0 = not a corpus proposal).
        occurrences: occurrences of that suffix in the corpus, before any sampling (0 = unknown).
        root_count: the occurrences ``counts`` are shares of (a chain's first node is supported by ``counts[0]``
            of ``root_count`` occurrences); 0 = the sum of the root children's counts.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    counts: list[int] | None = None
    match_length: int = 0
    occurrences: int = 0
    root_count: int = 0
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def chain(cls, tokens: Sequence[int], source: str) -> TokenTree:
        """A linear draft: node i is the child of node i-1 (node 0 of the root). O(N), no per-node Python loop."""
        toks = [int(t) for t in tokens]
        n = len(toks)
        parents = list(range(-1, n - 1))
        return cls(toks, parents, list(range(1, n + 1)), [source] * n,
                   _children=dict(zip(zip(parents, toks, strict=True), range(n), strict=True)))

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int], source: str, *,
                     counts: Sequence[int] | None = None, match_length: int = 0,
                     occurrences: int = 0) -> TokenTree:
        """A tree from parallel lists (``parents[i]`` indexes ``tokens``, -1 = root, parents before children).

        Identical siblings (same parent, same token) are merged into the first one.
        Raises:
            ValueError: lengths differ, or a parent index is not smaller than its child's.
        """
        if len(tokens) != len(parents) or (counts is not None and len(counts) != len(tokens)):
            raise ValueError(f"token tree needs one parent (and count) per token, got {len(tokens)} tokens, "
                             f"{len(parents)} parents" + ("" if counts is None else f", {len(counts)} counts"))
        tree = cls(counts=[] if counts is not None else None, match_length=match_length, occurrences=occurrences)
        mapped: list[int] = []
        for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
            p = int(p)
            if p >= i:
                raise ValueError(f"token tree node {i} has parent {p}: parents must come before their children")
            mapped.append(tree.add_node(-1 if p < 0 else mapped[p], t, source,
                                        0 if counts is None else int(counts[i])))
        return tree

    # ---- queries ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """True when node i's parent is node i-1 for every node (a single linear draft)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def max_depth(self) -> int:
        """Tokens along the longest root-to-leaf path (0 for an empty tree)."""
        return max(self.depths, default=0)

    def child(self, parent: int, token: int) -> int:
        """Index of ``parent``'s child carrying ``token``, or -1 (parent -1 means the root)."""
        return self._children.get((parent, token), -1)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    # ---- growth -------------------------------------------------------------------------------------------------
    def add_node(self, parent: int, token: int, source: str, count: int = 0) -> int:
        """Add one node (or return the existing identical sibling). Returns the node index."""
        key = (parent, int(token))
        found = self._children.get(key)
        if found is not None:
            return found
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.sources.append(source)
        if self.counts is not None:
            self.counts.append(count)
        self._children[key] = idx
        return idx

    def add_chain(self, tokens: Sequence[int], source: str, *, budget: int | None = None,
                  max_depth: int | None = None) -> int:
        """Merge a linear proposal below the root, sharing any prefix already present.

        Args:
            tokens: proposed ids in order, the first one follows the root.
            budget: stop adding once the tree has this many nodes.
            max_depth: never add nodes deeper than this.
        Returns:
            number of new nodes added.
        """
        n = len(tokens)
        return self.add_subtree(tokens, range(-1, n - 1), source, budget=budget, max_depth=max_depth)

    def add_subtree(self, tokens: Sequence[int], parents: Sequence[int], source: str, *,
                    budget: int | None = None, max_depth: int | None = None,
                    counts: Sequence[int] | None = None) -> int:
        """Merge a proposal that is itself a tree (``parents`` indexes into ``tokens``, -1 = root, parents first).

        Nodes beyond the budget or depth limit are dropped together with their descendants.
        Returns the number of new nodes added.
        """
        mapped: list[int] = []
        added = 0
        for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
            parent = -1 if p < 0 else mapped[p]
            if parent == -2:  # ancestor was dropped
                mapped.append(-2)
                continue
            depth = 1 if parent < 0 else self.depths[parent] + 1
            existing = self._children.get((parent, int(t)))
            if existing is None:
                if (budget is not None and len(self.tokens) >= budget) or (max_depth is not None and depth > max_depth):
                    mapped.append(-2)
                    continue
                existing = self.add_node(parent, t, source, 0 if counts is None else counts[i])
                added += 1
            mapped.append(existing)
        return added

    def merge(self, other: TokenTree, source: str, *, budget: int | None = None,
              max_depth: int | None = None) -> int:
        """Merge the proposal ``other`` below the root, its new nodes credited to ``source``.

        Shared prefixes are kept once, under their first source; nodes beyond ``budget`` (total nodes) or
        ``max_depth`` are dropped with their descendants. Counts travel when ``other`` has them; the first
        proposal's match_length / occurrences / root_count are kept. Returns the number of new nodes added.
        """
        n = len(other.tokens)
        if not self.tokens and (budget is None or n <= budget) and (max_depth is None or other.max_depth <= max_depth):
            # the usual step: one proposal that fits; copy its lists instead of re-adding node by node
            self.tokens, self.parents, self.depths = list(other.tokens), list(other.parents), list(other.depths)
            self.sources, self._children = [source] * n, dict(other._children)
            self.counts = None if other.counts is None else list(other.counts)
            self.match_length, self.occurrences = other.match_length, other.occurrences
            self.root_count = other.root_count
            return n
        if other.counts is not None and self.counts is None:
            self.counts = [0] * len(self.tokens)
        if not self.match_length:
            self.match_length, self.occurrences = other.match_length, other.occurrences
            self.root_count = other.root_count
        return self.add_subtree(other.tokens, other.parents, source, budget=budget, max_depth=max_depth,
                                counts=other.counts)

    # ---- cleaning (what the verifier can take) ------------------------------------------------------------------
    def within_vocab(self, vocab_size: int) -> TokenTree:
        """This tree without nodes whose id is outside [0, vocab_size), nor their descendants.

        An id the model cannot embed would crash the verify forward (a corpus built without a vocabulary check
        can hold one). Returns ``self`` when every id is valid (the usual case: one min/max pass).
        """
        if not self.tokens or (min(self.tokens) >= 0 and max(self.tokens) < vocab_size):
            return self
        out = TokenTree(counts=[] if self.counts is not None else None, match_length=self.match_length,
                        occurrences=self.occurrences)
        mapped: dict[int, int] = {}
        for i in range(len(self.tokens)):
            t, p = self.tokens[i], self.parents[i]
            if 0 <= t < vocab_size and (p < 0 or p in mapped):
                mapped[i] = out.add_node(-1 if p < 0 else mapped[p], t, self.sources[i],
                                         0 if self.counts is None else self.counts[i])
        return out

    def first_path(self) -> TokenTree:
        """The first root-to-leaf path as a chain (each step takes the first-listed child); ``self`` if a chain.

        Sliding-window models verify chains only (a tree mask would have to repeat each layer's window).
        """
        if self.is_chain:
            return self
        nodes, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                nodes.append(i)
                node = i
        out = TokenTree.chain([self.tokens[i] for i in nodes], "")
        out.sources = [self.sources[i] for i in nodes]
        if self.counts is not None:
            out.counts = [self.counts[i] for i in nodes]
        out.match_length, out.occurrences = self.match_length, self.occurrences
        return out

    def subtree(self, nodes: Sequence[int]) -> TokenTree:
        """The kept ``nodes`` (ascending indices, every kept node's parent kept) as a new tree, renumbered.

        What a speculation policy verifies out of a candidate tree; sources, counts, match length and occurrences
        travel. ``self`` when every node is kept (the common case for a policy that keeps the whole draft).
        Raises:
            ValueError: a kept node whose parent is not kept (the result would not be a tree).
        """
        if len(nodes) == len(self.tokens):
            return self
        index = {int(n): j for j, n in enumerate(nodes)}
        out = TokenTree(counts=[] if self.counts is not None else None, match_length=self.match_length,
                        occurrences=self.occurrences)
        for n in index:
            p = self.parents[n]
            if p >= 0 and p not in index:
                raise ValueError(f"token tree subtree: node {n} is kept but its parent {p} is not")
            out.add_node(-1 if p < 0 else index[p], self.tokens[n], self.sources[n],
                         0 if self.counts is None else self.counts[n])
        return out
