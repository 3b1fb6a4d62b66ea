"""TokenTree: the one data type between drafters and the verifier.

A token tree hangs off the *root*: the last token of the live context, whose logits the verify forward computes
anyway. Each node is one drafted token with a parent (-1 = child of the root), a depth (1 = child of the root)
and the drafter that proposed it. Nodes are kept in insertion order with every parent before its children, so
the linearised order is a valid topological order for the tree attention mask (SpecInfer / Medusa style trees).
A chain (each node the child of the one before) is the common case and lets the verifier use a plain causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class TokenTree:
    """Drafted tokens arranged as a tree below the root.

    Attributes:
        tokens: node token ids, length N.
        parents: parent node index per node, -1 for children of the root; parents[i] < i.
        depths: 1-based depth per node (root children have depth 1).
        sources: name of the drafter that first proposed each node ("corpus", "ngram", ...).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """True when node i's parent is node i-1 for every node (a single linear draft)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def child(self, parent: int, token: int) -> int:
        """Index of ``parent``'s child carrying ``token``, or -1 (parent -1 means the root)."""
        return self._children.get((parent, token), -1)

    def add_node(self, parent: int, token: int, source: str) -> int:
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
        parent, added = -1, 0
        for d, t in enumerate(tokens, start=1):
            if max_depth is not None and d > max_depth:
                break
            existing = self._children.get((parent, int(t)))
            if existing is None:
                if budget is not None and len(self.tokens) >= budget:
                    break
                existing = self.add_node(parent, t, source)
                added += 1
            parent = existing
        return added

    def add_subtree(self, tokens: Sequence[int], parents: Sequence[int], source: str, *,
                    budget: int | None = None, max_depth: int | None = None) -> int:
        """Merge a proposal that is itself a tree (``parents`` indexes into ``tokens``, -1 = root, parents first).

        Nodes beyond the budget or depth limit are dropped together with their descendants.
        Returns the number of new nodes added.
        """
        mapped: list[int] = []
        added = 0
        for t, p in zip(tokens, parents):
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
                existing = self.add_node(parent, t, source)
                added += 1
            mapped.append(existing)
        return added

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
