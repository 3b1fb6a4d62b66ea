"""Which drafters a step asks: asking costs time too, and a drafter whose drafts keep being dropped is asked less.

The policy prices each proposal against its verify cost, so a useless draft costs nothing but the asking: the
drafter's lookup, the candidates and the plan. On a GPU that is noise; on a CPU it is not. Timed in the engine's
loop on llama.cpp (bundled Q4_1, 2 threads, Xeon with AMX, ~4-5 ms steps), asking the n-gram drafter and planning
took ~100 us a step right after a decode (cold caches make each Python call several times its warm cost): ~2-3% of
every step on novel text, where most of its proposals are dropped, against plain decoding's 0.

:class:`AskBudget` bounds that like the policy bounds a dropped source's probes (``probe_overhead``): once a drafter's
last ``fruitless`` asks all came to nothing (no proposal, or none of its nodes kept), it is asked only every k-th step, k =
ceil(ask share / ``overhead``), where the ask share is what asking has cost per step lately over a plain step's time
(both measured in the loop: :class:`~redraft.pricing.loop.LoopPrices` gives the plain step). So a drafter that drafts
nothing costs at most ``overhead`` of a step for its asking, and one that is right again is asked every step from its
first kept draft on. A draft is missed at most k - 1 steps; a prompt's forward always asks (a replay starts there).
Where asking is cheap (share below ``overhead``), k = 1: every step asks. numpy-free.
"""

from __future__ import annotations

import math

from redraft.defaults import ASK_FRUITLESS, ASK_OVERHEAD

SMOOTHING = 0.1  # weight of the newest step in the ask share


class AskBudget:
    """Per drafter (by index in priority order), whether this step asks it (module docstring).

    Args:
        overhead: the share of a plain step a fruitless drafter's asking may cost (> 0).
        fruitless: asks that came to nothing in a row before a drafter is asked less (>= 1).
    Attributes:
        share: the asking's cost per step over a plain step, smoothed (None until both were measured).
    Raises:
        ValueError: overhead <= 0 or fruitless < 1.
    """

    def __init__(self, overhead: float = ASK_OVERHEAD, fruitless: int = ASK_FRUITLESS) -> None:
        if not overhead > 0 or fruitless < 1:
            raise ValueError(f"AskBudget needs overhead > 0 and fruitless >= 1, got {overhead}, {fruitless}")
        self.overhead, self.fruitless = overhead, fruitless
        self.share: float | None = None
        self._streak: dict[int, int] = {}  # asks in a row that came to nothing, per drafter
        self._waited: dict[int, int] = {}  # steps since a fruitless drafter was last asked

    def interval(self) -> int:
        """k: a fruitless drafter is asked every k-th step (1 until the ask share is known)."""
        if self.share is None:
            return 1
        return max(1, math.ceil(self.share / self.overhead - 1e-9))

    def ask(self, drafter: int) -> bool:
        """Whether this step asks ``drafter``; a step that does not counts towards its next ask."""
        if self._streak.get(drafter, 0) < self.fruitless:
            return True
        waited = self._waited.get(drafter, 0) + 1
        if waited >= self.interval():
            self._waited[drafter] = 0
            return True
        self._waited[drafter] = waited
        return False

    def outcome(self, drafter: int, kept: bool) -> None:
        """``drafter`` was asked: ``kept`` whether any of its nodes went into the step's draft (False too when it
        proposed nothing: a corpus lookup that finds no match costs its time all the same)."""
        self._streak[drafter] = 0 if kept else self._streak.get(drafter, 0) + 1

    def timed(self, seconds: float, plain_seconds: float | None) -> None:
        """A step in which every drafter was asked and nothing was kept spent ``seconds`` drafting and planning
        (a kept draft's planning is part of its own price, which the loop measures); ``plain_seconds``: a plain step
        of the loop now (None: not known yet)."""
        if plain_seconds is None or not plain_seconds > 0 or not seconds >= 0:
            return
        share = seconds / plain_seconds
        self.share = share if self.share is None else (1 - SMOOTHING) * self.share + SMOOTHING * share
