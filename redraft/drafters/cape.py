"""CaPE: confidence-aware proposal expansion of a greedy draft chain into a token tree.

GliDe with a CaPE (arXiv 2402.02082, section 3.2): at draft step i the draft's confidence p is its top softmax
probability. The less confident the draft, the more of its next-best tokens are worth verifying, so step i adds
``extras(p)`` alternatives as one-token siblings of the greedy token: 7 / 5 / 3 / 1 extra tokens for
p < 0.3 / < 0.6 / < 0.8 / >= 0.8 (the paper's bins; configurable here). Only the greedy token is extended, so the
tree is a greedy spine with one-token leaves hanging off each depth. The engine verifies the tree in one forward
(each node sees the prefix, its ancestors and itself; siblings share a position) and keeps the longest accepted
root-to-leaf path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redraft.tree import TokenTree


@dataclass(frozen=True)
class CapeBins:
    """Confidence bins: ``extras[b]`` siblings when p < ``thresholds[b]``, ``extras[-1]`` when p >= the last one.

    Attributes:
        thresholds: ascending probabilities in (0, 1], one fewer than ``extras``.
        extras: extra tokens (siblings) per bin, each >= 0.
    Raises:
        ValueError: lengths do not fit, thresholds not ascending or outside (0, 1], negative extras.
    """

    thresholds: tuple[float, ...] = (0.3, 0.6, 0.8)
    extras: tuple[int, ...] = (7, 5, 3, 1)

    def __post_init__(self) -> None:
        if len(self.extras) != len(self.thresholds) + 1:
            raise ValueError(f"CaPE needs one more extras count than thresholds, got {len(self.thresholds)} "
                             f"thresholds and {len(self.extras)} extras")
        if any(not 0.0 < t <= 1.0 for t in self.thresholds) or list(self.thresholds) != sorted(self.thresholds):
            raise ValueError(f"CaPE thresholds must be ascending probabilities in (0, 1], got {self.thresholds}")
        if any(e < 0 for e in self.extras):
            raise ValueError(f"CaPE extras must be >= 0, got {self.extras}")

    def extras_for(self, p: float) -> int:
        """Number of sibling alternatives for a draft step whose top probability is ``p``."""
        for t, e in zip(self.thresholds, self.extras[:-1], strict=True):
            if p < t:
                return e
        return self.extras[-1]

    @property
    def max_extras(self) -> int:
        return max(self.extras)

    @classmethod
    def parse(cls, text: str) -> CapeBins:
        """``"0.3,0.6,0.8:7,5,3,1"`` -> CapeBins (thresholds before the colon, extras after).

        Raises:
            ValueError: malformed text (the message quotes it).
        """
        try:
            th, ex = text.split(":")
            return cls(tuple(float(x) for x in th.split(",") if x.strip()), tuple(int(x) for x in ex.split(",")))
        except ValueError as e:
            raise ValueError(f"bad CaPE bins {text!r} (expected e.g. '0.3,0.6,0.8:7,5,3,1'): {e}") from e


def expand(spine: Sequence[int], alternatives: Sequence[Sequence[int]], source: str = "glide") -> TokenTree:
    """The CaPE tree for a greedy chain and each step's alternatives, linearised by depth.

    Args:
        spine: greedy draft tokens [gamma]; spine[i] is at depth i + 1.
        alternatives: per step, the sibling tokens (next-best first) to add next to ``spine[i]``.
    Returns:
        TokenTree (nodes credited to ``source``): per depth the spine node first, then its siblings, all children
        of the previous spine node (-1 = the root), so parents always precede children.
    """
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    for tok, alts in zip(spine, alternatives, strict=True):
        here = len(tokens)
        tokens.append(int(tok))
        parents.append(parent)
        for a in alts:
            if int(a) != int(tok):
                tokens.append(int(a))
                parents.append(parent)
        parent = here
    return TokenTree.from_parents(tokens, parents, source)
