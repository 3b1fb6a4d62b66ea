"""The drafter protocol (everything the engine and the tools rely on) and the acceptance guard.

A drafter is anything with the members of :class:`Drafter`. The engine, per generation:

1. ``bind(target)``: hands over the :class:`~redraft.runtimes.transformers.target.HFTarget` it verifies with, before every generation.
   Drafters that read nothing from the target ignore it; GliDe reads the verified KV cache through
   :meth:`HFTarget.verified_kv <redraft.runtimes.transformers.target.HFTarget.verified_kv>` (never the cache internals).
2. ``begin(prompt)``: a new sequence starts; drop per-sequence state, re-arm the guard.
3. Per decode step, in priority order: ``propose(context, max_depth)`` -> a fresh :class:`~redraft.tree.TokenTree`
   or None. Then one verify forward, then ``observe(proposed, accepted, emitted)`` for every drafter.

The engine reads ``name`` (the key of its per-source statistics) and ``guard`` (``guard.pauses`` counts how often
the source paused itself; reported per source). Nothing else is read, set or patched from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from redraft.defaults import CORPUS_MINACC, CORPUS_PAUSE, CORPUS_WINDOW
from redraft.tree import TokenTree

if TYPE_CHECKING:
    from redraft.runtimes.transformers.target import HFTarget


class Drafter(Protocol):
    """Anything that proposes tokens. Called once per decode step, in priority order.

    Attributes:
        name: source name in the engine's statistics (``GenerationResult.sources``); unique per engine.
        guard: the source's :class:`AcceptanceGuard`, or None for a source that never pauses itself.
    """

    name: str
    guard: AcceptanceGuard | None

    def bind(self, target: HFTarget) -> None:
        """Called by the engine with its target before every generation (a drafter may serve several engines)."""

    def begin(self, prompt: np.ndarray) -> None:
        """A new sequence: ``prompt`` is its ids, read-only int64 [L]."""

    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None:
        """Draft after ``context`` (prompt + output so far, read-only int64 [L]; its last id is the root).

        Never deeper than ``max_depth`` tokens along any path (the engine clamps anyway). The engine takes
        ownership of the returned tree (it may become the verify tree), so return a fresh one each call, or None
        (nothing to propose, paused).
        """

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """After the verify forward: this source's proposed nodes and accepted tokens, and the tokens emitted.

        All three count only what the output reached: when the step's output was cut (EOS, stop string, token
        or context limit, an exact-mode near-tie), drafted nodes deeper than the tokens emitted are not counted
        as proposed, and accepted <= emitted. ``emitted`` is what a paused guard counts down.
        """


class AcceptanceGuard:
    """Turns a draft source off while its proposals keep failing (after Colibri's COLI_CORPUS_MINACC).

    Once at least ``window`` draft tokens were proposed since the source was (re)armed, an acceptance rate below
    ``minacc`` pauses it for ``pause`` emitted tokens; then it re-arms with fresh counts. Rejected drafts make the
    verify forward wider for nothing, so a source that does not pay must stop costing.

    Args:
        minacc: acceptance threshold as a fraction in [0, 1] (default 50%, Colibri's).
        window: draft tokens proposed before the guard judges (default 24).
        pause: emitted tokens the source stays off (default 256).
    Attributes:
        proposed, accepted: draft tokens since the last (re)arm.
        paused_for: emitted tokens left in the current pause (<= 0: active).
        pauses: pauses so far, never reset (the engine reports the increase per generation).
    Raises:
        ValueError: minacc outside [0, 1].
    """

    def __init__(self, minacc: float = CORPUS_MINACC, window: int = CORPUS_WINDOW, pause: int = CORPUS_PAUSE) -> None:
        if not 0.0 <= minacc <= 1.0:
            raise ValueError(f"minacc must be a fraction in [0, 1], got {minacc}")
        self.minacc, self.window, self.pause = minacc, window, pause
        self.rearm()
        self.pauses = 0

    def rearm(self) -> None:
        """Start judging afresh: zero the counts and end any pause."""
        self.proposed = self.accepted = 0
        self.paused_for = 0

    @property
    def active(self) -> bool:
        """False while paused: the source proposes nothing."""
        return self.paused_for <= 0

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        """One verify step of this source (the arguments of :meth:`Drafter.observe`)."""
        if not self.active:
            self.paused_for -= emitted
            if self.paused_for <= 0:
                self.rearm()
            return
        self.proposed += proposed
        self.accepted += accepted
        if self.proposed >= self.window and self.accepted < self.minacc * self.proposed:
            self.paused_for = self.pause
            self.pauses += 1
