"""Draft sources. Each proposes tokens for the verifier; none of them can change the output, only its speed."""

from __future__ import annotations

from redraft.drafters.base import AcceptanceGuard, Drafter, Proposal
from redraft.drafters.corpus import CorpusDrafter
from redraft.drafters.ngram import NgramDrafter

__all__ = ["AcceptanceGuard", "Drafter", "Proposal", "CorpusDrafter", "NgramDrafter", "build_drafters"]


def build_drafters(corpus=None, *, k: int = 8, minacc: float = 0.5, ngram: bool = True,
                   ngram_k: int | None = None, tree_branches: int = 0, k_max: int | None = None) -> list:
    """The default draft sources in priority order: frozen corpus first, then n-gram lookup over the live context.

    Args:
        corpus: a loaded :class:`redraft.corpus.Corpus` or None.
        k: corpus draft depth (clamped to 1..48).
        minacc: acceptance guard threshold as a fraction (0.5 = 50%).
        ngram: include the n-gram drafter.
        ngram_k: n-gram draft depth (default: same as k).
        tree_branches: > 0 makes the corpus propose its most frequent continuations as a token tree.
        k_max: adaptive corpus depth (see :class:`CorpusDrafter`); None = fixed depth k.
    """
    drafters: list = []
    if corpus is not None:
        drafters.append(CorpusDrafter(corpus, k=k, guard=AcceptanceGuard(minacc), tree_branches=tree_branches,
                                      k_max=k_max))
    if ngram:
        drafters.append(NgramDrafter(k=ngram_k or min(max(k, 1), 48), guard=AcceptanceGuard(minacc)))
    return drafters
