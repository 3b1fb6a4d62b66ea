"""Frozen-corpus drafter (after Colibri's COLI_DRAFT_CORPUS).

At each step the longest suffix (n = max_n down to min_n) of the live context is looked up in a frozen corpus of
earlier outputs and the span that followed its most recent occurrence is proposed, up to K tokens, never across a
``-1`` span separator. Where all max_n ids match, the occurrence whose preceding context matches the live context
longest wins (up to context_n ids back; the most recent among equals), so a replayed templated prompt drafts its own
stored answer. An acceptance guard pauses the source while its proposals keep failing, so a prompt unrelated
to the corpus costs nothing. The lookup is an index query (see :mod:`redraft.corpus`), not a corpus scan.
"""

from __future__ import annotations

import sys

import numpy as np

from redraft.defaults import (
    CORPUS_K_DEFAULT,
    MAX_DRAFT_DEPTH,
    SUFFIX_CONTEXT_N,
    SUFFIX_MAX_N,
    SUFFIX_MIN_N,
    check_depth,
)
from redraft.drafters.base import AcceptanceGuard
from redraft.tree import TokenTree

K_DEFAULT, K_MAX = CORPUS_K_DEFAULT, MAX_DRAFT_DEPTH
COUNT_BRANCHES = 32  # distinct first tokens counted after a short match (more are rare: the rest count as misses)


def clamp_k(k: int, *, warn: bool = True) -> int:
    """Clamp a corpus draft depth to 1..48 (Colibri's cap) by the one depth rule
    (:func:`redraft.defaults.check_depth`), warning when it changed."""
    return check_depth("corpus K", int(k), out_of_range="warn" if warn else "clamp")


class CorpusDrafter:
    """Drafts the continuation of the live context's longest suffix found in a frozen corpus.

    Args:
        corpus: a :class:`redraft.corpus.Corpus` (anything with ``propose(context, k, min_n, max_n, context_n)``).
        k: draft depth in tokens (clamped to 1..48).
        min_n, max_n: suffix lengths tried, longest first (default 8 down to 3).
        context_n: where all max_n ids match, the match is extended back up to this many context ids and the
            occurrence with the longest matching preceding context wins (default 4096; None or <= max_n: off).
        guard: acceptance guard (default: MINACC 50% over >= 24 proposed tokens, pause 256 tokens).
        tree_branches: 0 = a single chain from the most recent occurrence; B > 0 = the B most frequent
            continuations as a token tree (needs tree verification, i.e. ``Engine(merge=True)`` or a tree budget).
        k_max: adaptive depth: while drafts are accepted whole, the next one is twice as deep, up to k_max
            (1..48); any rejection goes back to k; a match of n > max_n context ids drafts up to min(n, k_max)
            ids at once. None = always k (Colibri's behaviour). Replays are where deep drafts pay (Measurements: docs/measurements.md#redraft-drafters-frozen_corpus).
        name: the source's name (its statistics key, unique per engine); two corpora in one engine need two names.
        deep: under the cost-aware policy, how deep a draft may go when the match reaches past max_n context ids
            or covers the whole live context when that is shorter (a replay's match does: the whole context agrees
            with a stored span), past the 1..48 cap; the policy
            then verifies as much of it as the measured cost curve says pays. Shorter matches keep depth k.
            None = no such drafts (the fixed semantics).
    Raises:
        ValueError: deep < 1.
    """

    def __init__(self, corpus, k: int = K_DEFAULT, min_n: int = SUFFIX_MIN_N, max_n: int = SUFFIX_MAX_N,
                 guard: AcceptanceGuard | None = None, tree_branches: int = 0, k_max: int | None = None,
                 name: str = "corpus", context_n: int | None = SUFFIX_CONTEXT_N, deep: int | None = None) -> None:
        if deep is not None and deep < 1:
            raise ValueError(f"CorpusDrafter: deep must be >= 1 draft tokens, got {deep}")
        self.name = name
        self.deep = deep
        self.context_n = context_n
        self.corpus = corpus
        self.k = clamp_k(k)
        self.k_max = max(self.k, clamp_k(k_max)) if k_max is not None else self.k
        self.depth = self.k
        self.min_n, self.max_n = min_n, max_n
        self.guard = guard if guard is not None else AcceptanceGuard()
        self.tree_branches = tree_branches
        self.failed = False

    def bind(self, target) -> None:
        """Nothing to read from the target: drafts come from the corpus and the live context."""

    def begin(self, prompt: np.ndarray) -> None:
        """A new sequence: re-arm the guard, start again at depth k."""
        self.guard.rearm()
        self.depth = self.k

    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None:
        """A chain from the most recent occurrence (or, with ``tree_branches``, the most frequent continuations
        with their corpus counts) of the longest context suffix found; None when nothing matches, the guard
        pauses the source, or the corpus failed."""
        if self.failed or not self.guard.active or max_depth <= 0:
            return None
        k = min(self.depth, max_depth)
        if self.k_max > self.depth and self.context_n:
            k = min(self.k_max, max_depth)  # an extended match may earn a deeper draft (below)
        if self.deep is not None and self.deep > k:
            k = min(self.deep, max_depth)
        try:
            if self.tree_branches > 0:
                br = self.corpus.propose_tree(context, k, branches=self.tree_branches,
                                              min_n=self.min_n, max_n=self.max_n, context_n=self.context_n)
                if br is None or len(br.tokens) == 0:
                    return None
                return TokenTree.from_parents(br.tokens.tolist(), br.parents.tolist(), self.name,
                                              counts=br.counts.tolist(), match_length=br.match_length,
                                              occurrences=br.occurrences)
            n, ids = self.corpus.propose(context, k, min_n=self.min_n, max_n=self.max_n, context_n=self.context_n)
        except Exception as e:  # a broken corpus must never crash a generation: turn the source off
            self.failed = True
            # printed, not warnings.warn: a warnings filter (or the once-per-location default in a process that
            # runs many generations) would hide it, and the report's "corpus drafts:" line would just be missing
            print(f"redraft: warning: corpus drafts disabled: lookup failed "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return None
        if n == 0 or len(ids) == 0:
            return None
        # Adaptive depth: a match reaching past max_n (the occurrence shares n ids of preceding context, as a
        # replay's does) drafts up to n ids at once, capped by k_max: one draft id per matched id, SuffixDecoding's
        # depth cap (arXiv 2411.04975); shorter matches keep the doubling depth. Under the policy (``deep``) such
        # a match drafts up to ``deep`` ids, and the policy decides how many of them to verify; so does a match of
        # the whole live context when that is shorter (a replayed prompt under max_n ids: it cannot match longer).
        whole = self.deep is not None and n >= len(context)
        long = (self.deep if self.deep is not None else n) if n > self.max_n or whole else 0
        ids = ids[:max(self.depth, long)]
        tree = TokenTree.chain(ids.tolist(), self.name)
        # the match length is what the policy reads as evidence (its prior and its learning key). A match of the whole
        # live context is as long as the context allows, not as long as the evidence goes: a replayed 53-token prompt
        # matched 53 ids, whose rule-of-succession prior gave the answer's 128th token a 30% chance. It counts as a
        # match of context_n ids (the longest the lookup reads), and all such matches are learned under one key; a
        # context under SUFFIX_MAX_N ids (Colibri's longest suffix, a fixed floor whatever this drafter's max_n; a chat
        # prompt's template alone is longer) is not credited so: so short a context is no evidence of a replay
        whole_n = self.context_n if whole and self.context_n and n >= SUFFIX_MAX_N else 0
        tree.match_length = max(n, whole_n)
        if self.deep is not None and not long:
            self._count_first(tree, context)
        return tree

    def _count_first(self, tree: TokenTree, context: np.ndarray) -> None:
        """Under the policy, a short match's chain carries how many of the matched suffix's occurrences continue
        with its first token (SuffixDecoding's continuation frequency, arXiv 2411.04975, section 3): a suffix that
        every stored answer shares, such as the chat template's tail before an answer, is followed by as many
        different answers, and the most recent one's first token is then a 1-in-m guess, not a sure one."""
        propose_tree = getattr(self.corpus, "propose_tree", None)
        if propose_tree is None:
            return
        br = propose_tree(context, 1, branches=COUNT_BRANCHES, min_n=self.min_n, max_n=self.max_n,
                          context_n=self.context_n)
        if br is None or len(br.tokens) == 0:
            return
        first = tree.tokens[0]
        hits = [int(c) for t, c in zip(br.tokens.tolist(), br.counts.tolist(), strict=True) if t == first]
        count = max(1, hits[0] if hits else 1)
        tree.counts = [count] * len(tree)
        tree.root_count = max(count, int(br.counts.sum()))

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """Feed the guard; with k_max, double the depth after a draft accepted whole, else go back to k."""
        self.guard.record(proposed, accepted, emitted)
        if proposed:
            whole = accepted == proposed and proposed >= self.depth
            self.depth = min(2 * self.depth, self.k_max) if whole else self.k


def open_corpus(path: str, *, vocab_size: int | None, fingerprint: str | None = None, force: bool = False):
    """Open a corpus for drafting, with the run-time bad-input policy.

    An unreadable path (missing, a directory, no permission) prints one warning and returns None: the source is
    off and the run goes on. An empty corpus prints a note and returns the empty corpus (it proposes nothing).

    Raises:
        redraft.corpus.CorpusError: the file is readable but malformed (non-integer token, id outside the
            vocabulary, bad binary header, other tokenizer): refused at load, before any generation starts.
    """
    import os

    from redraft.corpus import load_corpus

    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        why = "no such file" if not os.path.exists(path) else "not a readable file"
        print(f"redraft: warning: corpus {path}: {why}; corpus drafts are off for this run", file=sys.stderr)
        return None
    corpus = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    if corpus.n_tokens == 0:
        print(f"redraft: note: corpus {path} is empty; it will propose nothing", file=sys.stderr)
    return corpus
