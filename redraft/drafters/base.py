"""The drafter protocol and the acceptance guard shared by the lookup drafters."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from redraft.tree import TokenTree


class Drafter(Protocol):
    """Anything that proposes tokens. Called once per decode step, in priority order.

    ``propose`` sees the live context (prompt + output so far, a read-only int64 array [L]) and the deepest
    draft that can still pay (never more than ``max_depth`` tokens along any path). ``observe`` reports, after
    the verify forward, how many of this drafter's nodes were proposed and accepted and how many tokens the step
    emitted (accepted + bonus), which is what the guard counts.
    """

    name: str

    def begin(self, prompt: np.ndarray) -> None: ...

    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None: ...

    def observe(self, proposed: int, accepted: int, emitted: int) -> None: ...


class AcceptanceGuard:
    """Turns a draft source off while its proposals keep failing (after Colibri's COLI_CORPUS_MINACC).

    Once at least ``window`` draft tokens were proposed since the source was (re)armed, an acceptance rate below
    ``minacc`` pauses it for ``pause`` emitted tokens; then it re-arms with fresh counts. Rejected drafts make the
    verify forward wider for nothing, so a source that does not pay must stop costing.
    """

    def __init__(self, minacc: float = 0.5, window: int = 24, pause: int = 256) -> None:
        if not 0.0 <= minacc <= 1.0:
            raise ValueError(f"minacc must be a fraction in [0, 1], got {minacc}")
        self.minacc, self.window, self.pause = minacc, window, pause
        self.rearm()
        self.pauses = 0

    def rearm(self) -> None:
        self.proposed = self.accepted = 0
        self.paused_for = 0

    @property
    def active(self) -> bool:
        return self.paused_for <= 0

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
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
