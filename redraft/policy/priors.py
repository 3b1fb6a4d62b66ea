"""What a draft source knows about its own draft, as per-node prior acceptance probabilities.

A prior for node i is the source's estimate of P(node i accepted | its parent accepted). Siblings' priors are
shares of their parent and sum to at most 1. The policy blends them with what it learned online about the source
(:mod:`redraft.policy.speculation`), so they need not be calibrated, only ordered sensibly.

- Corpus counts (SuffixDecoding, arXiv 2411.04975, section 3): a node's probability is the fraction of the matched
  suffix's occurrences that continue with it, count(node) / count(parent); a path's score is the product of these.
  At the first level the m occurrences of the matched suffix leave room for a continuation none of them had:
  count / (m + 1), PPM's escape method A (Cleary and Witten 1984). A suffix seen once (the chat template's tail
  before the one stored answer) is a guess about the next answer's first token, 1/2, not a certainty.
- Match length: the matched occurrence agreed with the live context on the last n tokens, and on d - 1 more when
  the node sits at depth d below accepted ancestors. Laplace's rule of succession over those n + d - 1 agreeing
  tokens gives (n + d) / (n + d + 1) for the next one: a longer match makes a deeper draft more credible.
  SuffixDecoding also caps the draft at a multiple of the match length (:func:`depth_limit`); here matches are at
  most the lookup's max_n (8) long, so the cap is offered as an option, not applied by default.
numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def node_depths(parents: Sequence[int]) -> np.ndarray:
    """int64 [N]: 1-based depth per node (parents[i] < i, -1 = child of the root)."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return depths


def count_priors(parents: Sequence[int], counts: Sequence[float] | np.ndarray,
                 root_count: float | None = None) -> np.ndarray:
    """float64 [N]: count(node) / count(parent), clipped to [0, 1] (SuffixDecoding's continuation frequency); a
    child of the root gets count / (root_count + 1) (PPM's escape: a continuation not seen yet keeps 1 share).

    Args:
        parents: parent index per node (-1 = child of the root), parents first.
        counts: occurrences supporting each node (> 0 where known).
        root_count: occurrences of the matched suffix itself (the root's count); default the sum of the root
            children's counts.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if len(counts) != len(parents):
        raise ValueError(f"count_priors: {len(counts)} counts for {len(parents)} nodes")
    if root_count is None:
        root_count = float(sum(c for c, p in zip(counts, parents, strict=True) if p < 0))
    denom = np.array([root_count + 1.0 if p < 0 else counts[p] for p in parents], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(denom > 0, counts / np.where(denom > 0, denom, 1.0), 0.0)
    return np.clip(share, 0.0, 1.0)


def succession_priors(parents: Sequence[int], match_length: int,
                      depths: Sequence[int] | None = None) -> np.ndarray:
    """float64 [N]: (n + d) / (n + d + 1) for a node at depth d after a match of n tokens (rule of succession);
    ``depths``: the nodes' depths when the caller holds them (a :class:`~redraft.tree.TokenTree`'s), else they are
    computed from ``parents``."""
    n = max(0, int(match_length))
    d = node_depths(parents) if depths is None else np.asarray(depths, dtype=np.int64)
    return (n + d) / (n + d + 1.0)


def depth_limit(match_length: int, factor: float, offset: float = 0.0) -> int:
    """SuffixDecoding's cap on the draft depth: floor(factor * match length + offset), at least 0."""
    return max(0, math.floor(factor * max(0, int(match_length)) + offset))


def source_priors(parents: Sequence[int], *, counts: Sequence[float] | None = None,
                  match_length: int | None = None, root_count: float | None = None,
                  depths: Sequence[int] | None = None) -> np.ndarray | None:
    """A source's per-node priors from what it knows; None when it knows nothing (no counts, no match length).

    With both, the prior is the product: the share of occurrences continuing this way times the chance the
    matched occurrence still tracks the live context. ``depths``: the nodes' depths, when the caller holds them.
    """
    prior = None
    if counts is not None:
        prior = count_priors(parents, counts, root_count)
    if match_length is not None and match_length > 0:
        succ = succession_priors(parents, match_length, depths)
        prior = succ if prior is None else prior * succ
    return prior
