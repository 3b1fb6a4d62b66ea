"""Draft sources. Each proposes tokens for the verifier; none of them can change the output, only its speed."""

from __future__ import annotations

from redraft.defaults import (
    CORPUS_K_DEFAULT,
    CORPUS_MINACC,
    CORPUS_WINDOW,
    MAX_DRAFT_DEPTH,
    NGRAM_MINACC,
    NGRAM_PAUSE,
    POLICY_NGRAM_MIN_N,
    POLICY_SUFFIX_MAX_N,
    SUFFIX_MAX_N,
    SUFFIX_MIN_N,
)
from redraft.drafters.base import AcceptanceGuard, Drafter
from redraft.drafters.frozen_corpus import CorpusDrafter
from redraft.drafters.ngram import NgramDrafter

__all__ = ["AcceptanceGuard", "Drafter", "CorpusDrafter", "NgramDrafter", "build_drafters"]


def build_drafters(corpus=None, *, k: int = CORPUS_K_DEFAULT, minacc: float = CORPUS_MINACC, ngram: bool = True,
                   ngram_k: int | None = None, tree_branches: int = 0, k_max: int | None = None,
                   glide=None, corpus_name: str = "corpus", policy: bool = False) -> list[Drafter]:
    """The default draft sources in priority order: frozen corpus first, then n-gram lookup over the live context.

    Args:
        corpus: a loaded :class:`redraft.corpus.Corpus` or None.
        k: corpus draft depth (clamped to 1..48).
        minacc: corpus acceptance guard threshold as a fraction (0.5 = 50%); the n-gram guard uses the lower of
            this and NGRAM_MINACC, pausing for NGRAM_PAUSE tokens.
        ngram: include the n-gram drafter.
        ngram_k: n-gram draft depth (default: same as k).
        tree_branches: > 0 makes the corpus propose its most frequent continuations as a token tree.
        k_max: adaptive corpus depth (see :class:`CorpusDrafter`); None = fixed depth k.
        glide: a :class:`~redraft.drafters.glide.GlideDrafter` or None; lowest priority, it fills the steps where
            the corpus and the n-gram source have nothing.
        corpus_name: the corpus source's name (its statistics key).
        policy: drafters for an engine with a :class:`~redraft.policy.SpeculationPolicy`: the corpus and n-gram
            sources propose up to the depth cap (48) and never pause themselves; the policy chooses how much of
            each draft to verify and when a source drafts at all (``k``, ``minacc``, ``ngram_k`` and ``k_max`` are
            ignored: they are the fixed semantics). The corpus matches suffixes up to POLICY_SUFFIX_MAX_N tokens
            and the n-gram source from POLICY_NGRAM_MIN_N: their match lengths tell the policy what to trust.
    """
    corpus_max_n, ngram_min_n = SUFFIX_MAX_N, SUFFIX_MIN_N
    if policy:
        k, ngram_k, k_max, minacc = MAX_DRAFT_DEPTH, MAX_DRAFT_DEPTH, None, 0.0
        corpus_max_n, ngram_min_n = POLICY_SUFFIX_MAX_N, POLICY_NGRAM_MIN_N
    drafters: list = []
    if corpus is not None:
        # Colibri judges after 24 tokens = three K=8 drafts; deeper drafts get the same three drafts, or one early
        # miss in a 32-token draft would pause a replay for the rest of the answer
        window = max(CORPUS_WINDOW, 3 * max(k, k_max or k))
        drafters.append(CorpusDrafter(corpus, k=k, guard=AcceptanceGuard(minacc, window=window),
                                      tree_branches=tree_branches, k_max=k_max, max_n=corpus_max_n,
                                      name=corpus_name))
    if ngram:
        guard = AcceptanceGuard(min(minacc, NGRAM_MINACC), pause=NGRAM_PAUSE)
        drafters.append(NgramDrafter(k=ngram_k or min(max(k, 1), MAX_DRAFT_DEPTH), guard=guard, min_n=ngram_min_n))
    if glide is not None:
        drafters.append(glide)
    return drafters
