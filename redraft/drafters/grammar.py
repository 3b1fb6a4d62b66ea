"""Grammar drafts: the tokens a grammar forces, proposed before the model runs.

Where the output's grammar (a JSON schema, a tool call) allows exactly one continuation (a key, a separator, a
closing brace, the tool-call wrapper), those tokens are known before the model computes anything. SGLang calls
this jump-forward decoding; Colibri verifies such grammar drafts in the same forward as its corpus drafts, with
priority grammar > corpus > n-gram. Here they are an ordinary draft source: the verify forward checks them like
any other proposal, so the output is the constrained model's, only reached in fewer forwards.

The forced tokens are llguidance's fast-forward tokens (``LLMatcher.compute_ff_tokens``): the forced bytes in the
tokenizer's own spelling. The masked model may split the same bytes differently (``{"`` against ``{`` ``"``); a
draft then stops being accepted where the spellings part, and the guard pauses the source if that keeps happening.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from redraft.defaults import GRAMMAR_MINACC, GRAMMAR_PAUSE, GRAMMAR_WINDOW
from redraft.drafters.base import AcceptanceGuard
from redraft.tree import TokenTree


class GrammarDrafter:
    """Proposes the tokens a grammar forces after the live context.

    Args:
        constraint: the generation's :class:`redraft.grammar.Constraint` (the same one its sampling parameters
            carry; the drafter keeps a matcher of its own).
        guard: acceptance guard; default GRAMMAR_MINACC over GRAMMAR_WINDOW tokens, pausing GRAMMAR_PAUSE tokens.
    """

    name = "grammar"

    def __init__(self, constraint, guard: AcceptanceGuard | None = None) -> None:
        self.constraint = constraint
        self.guard: AcceptanceGuard | None = (guard if guard is not None
                                              else AcceptanceGuard(GRAMMAR_MINACC, GRAMMAR_WINDOW, GRAMMAR_PAUSE))
        self._matcher: Any = None
        self._prompt_length = 0
        self._consumed: list[int] = []

    def bind(self, target) -> None:
        """Nothing to read from the target: drafts come from the grammar alone."""

    def begin(self, prompt: np.ndarray) -> None:
        """A new sequence: a fresh matcher at the start of the output, the guard re-armed."""
        self._matcher = self.constraint.matcher()
        self._prompt_length = len(prompt)
        self._consumed = []
        if self.guard is not None:
            self.guard.rearm()

    def _follow(self, output: list[int]) -> None:
        """Bring the matcher to the end of ``output`` (the output so far), rolling back where it diverged."""
        same = 0
        for a, b in zip(self._consumed, output, strict=False):
            if a != b:
                break
            same += 1
        if same < len(self._consumed):
            drop = len(self._consumed) - same
            if not self._matcher.rollback(drop):
                self._matcher = self.constraint.matcher()
                same = 0
            del self._consumed[same:]
        if len(output) > same:
            self._matcher.consume_tokens(output[same:])
            self._consumed.extend(output[same:])

    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None:
        """A chain of the tokens the grammar forces after ``context`` (up to ``max_depth``); None when the next
        token is a free choice, the grammar is complete or left, or the source is paused."""
        if self._matcher is None or (self.guard is not None and not self.guard.active) or max_depth <= 0:
            return None
        self._follow(context[self._prompt_length:].tolist())
        m = self._matcher
        if m.is_error() or m.is_stopped():
            return None
        forced = m.compute_ff_tokens()[:max_depth]
        return TokenTree.chain([int(t) for t in forced], self.name) if forced else None

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """Feed the guard (see :meth:`redraft.drafters.base.Drafter.observe`)."""
        if self.guard is not None:
            self.guard.record(proposed, accepted, emitted)
