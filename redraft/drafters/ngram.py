"""N-gram (prompt lookup) drafter over the live context.

Like Hugging Face's prompt lookup decoding and vLLM's ngram proposer: find an earlier occurrence of the context's
last n tokens (n = max_n down to min_n, longest first, most recent occurrence first) and propose the tokens that
followed it. Unlike a per-step scan, an incremental hash index of the n-grams seen so far makes each step cost
O(new tokens x n sizes), independent of the context length.

When the most recent occurrence ends fewer than k tokens before the end of the context (a run such as 7 7 7 ...,
or any short period), its continuation runs into the tokens being drafted, so it is read through the draft itself:
an overlapping copy, as in LZ77 decoding. The draft then has k tokens and repeats the last period, which is what
the most recent occurrence with k tokens to follow would propose once the run is long enough, without reaching
back to an older repetition that may have ended differently.
"""

from __future__ import annotations

import numpy as np

from redraft.defaults import CORPUS_K_DEFAULT, SUFFIX_MAX_N, SUFFIX_MIN_N
from redraft.drafters.base import AcceptanceGuard
from redraft.tree import TokenTree


class NgramDrafter:
    """Prompt-lookup drafts from the live context (prompt + output so far).

    Args:
        k: maximum draft length in tokens.
        min_n, max_n: suffix lengths tried, longest first.
        guard: acceptance guard; None disables it.
    """

    name = "ngram"

    def __init__(self, k: int = CORPUS_K_DEFAULT, min_n: int = SUFFIX_MIN_N, max_n: int = SUFFIX_MAX_N,
                 guard: AcceptanceGuard | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.guard = guard if guard is not None else AcceptanceGuard()
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed_to = 0

    def bind(self, target) -> None:
        """Nothing to read from the target: drafts come from the live context alone."""

    def begin(self, prompt: np.ndarray) -> None:
        """A new sequence: forget the indexed n-grams, re-arm the guard."""
        self._last = {}
        self._indexed_to = 0
        self.guard.rearm()

    def _index(self, ctx: list[int], upto: int) -> None:
        # Record, for every n-gram ending at position e-1 with e < upto, the position e right after it;
        # later occurrences overwrite earlier ones, so lookups return the most recent.
        for e in range(max(self._indexed_to, self.min_n), upto):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._last[tuple(ctx[e - n:e])] = e
        self._indexed_to = max(self._indexed_to, upto)

    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None:
        """A chain: what followed the most recent earlier occurrence of the context's longest suffix (up to k ids).

        None when no suffix of min_n..max_n ids occurs earlier with a non-empty continuation, or when paused.
        """
        if not self.guard.active or max_depth <= 0:
            return None
        L = len(context)
        if L <= self.min_n:
            return None
        ctx = context.tolist()  # a few microseconds for chat-sized contexts; slicing lists beats numpy here
        # Only occurrences whose continuation is non-empty: the n-gram must end before the last position.
        self._index(ctx, L)
        k = min(self.k, max_depth)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(ctx[L - n:]))
            if start is not None and start < L:
                return TokenTree.chain(overlapping_copy(ctx, start, k), self.name)
        return None

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """Feed the guard (see :meth:`redraft.drafters.base.Drafter.observe`)."""
        self.guard.record(proposed, accepted, emitted)


def overlapping_copy(ctx: list[int], start: int, k: int) -> list[int]:
    """k tokens from ctx[start:], continued past the end of ctx with period len(ctx) - start (0 <= start < len)."""
    draft = ctx[start:start + k]
    period = len(ctx) - start
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
