"""Exact mode's near-tie handling for one generation: which rows to trust, how to recompute the others, and when
drafting stops paying.

Plain decoding feeds the prompt in one forward, then one token per forward. A forward shaped like that on a KV cache
built like that computes plain decoding's row bit for bit, so its choice is trusted as is (ties included). Any other
row (a verify row, or one token on a cache verify forwards wrote) differs from plain decoding's by rounding
(:mod:`redraft.decoding.exactness`) and is trusted only when its top-2 gap clears the near-tie threshold. The first
row that does not is settled the way plain decoding computes it:

- a draft-free recompute of that token alone on the cache as it is (one forward) when the row was a verify row whose
  gap is above the threshold of such draft-free rows: the verify forward's own rounding may have made it look close;
- otherwise a rebuild of the cache as plain decoding built it, one token per forward from the last position where
  the two caches agree (:attr:`ExactMode.plain_len`), before the token is recomputed alone. Only this makes the row
  bit-exact, and it is paid only where the draft-free row would still be a near-tie.

Cost (both counted in target forwards): drafting saved ``emitted - 1`` forwards per verify forward; settling spent
every forward that emitted nothing (a verify forward voided by a near-tie in its first row, the rebuild's forwards).
Drafting stops only while settling has cost more than drafting saved: then it pauses for as many emitted tokens as
the deficit (at most ``pause_cap``), so an answer whose drafts pay keeps drafting after a near-tie, and where nearly
every row is a near-tie (16-bit dtypes) the pauses grow with each one and exact mode costs about plain decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from redraft.decoding.exactness import gap_noise, near_tie_threshold
from redraft.decoding.sampling import TokenChooser
from redraft.decoding.step import Step
from redraft.defaults import EXACT_PAY_PAUSE, EXACT_SAFETY, EXACT_SETTLE_SAFETY
from redraft.runtimes.sequence import Steps, forward
from redraft.runtimes.transformers.target import HFTarget


class ExactMode:
    """Near-tie settling and its payoff for one generation (see the module docstring).

    Args:
        target: the engine's target model (its KV cache is cropped and rebuilt here).
        margin: None = per-row thresholds from the dtype's measured noise: the bound on top-2 gaps' change, or on
            each logit's change where logits processors reshape the rows
            (:func:`redraft.decoding.exactness.near_tie_threshold` with EXACT_SAFETY for verify rows and
            EXACT_SETTLE_SAFETY for draft-free rows on a cache drafting wrote); a number = that fixed top-2 gap in
            logit units for every row.
        pause_cap: longest drafting pause in emitted tokens (0 = drafting never pauses).
    Attributes:
        plain_len: cached positions whose KV entries plain decoding computed the same way.
        settling: the next forward recomputes a near-tie row: it carries no draft.
        saved, spent: forwards drafting saved and settling spent so far.
        paused_for: emitted tokens left in the current drafting pause.
        near_ties: rows not trusted; settle_forwards: forwards run to settle them (recomputes and rebuilds).
    """

    def __init__(self, target: HFTarget, margin: float | None = None, pause_cap: int | None = None) -> None:
        self.target = target
        self.margin = margin
        self.pause_cap = EXACT_PAY_PAUSE if pause_cap is None else pause_cap
        self.plain_len = 0
        self.settling = False
        self.rebuild = False  # the tied row needs plain decoding's cache: a draft-free row would still be a near-tie
        self.saved = self.spent = self.paused_for = 0
        self.near_ties = self.settle_forwards = 0
        # a runtime whose verify rows are plain decoding's bit for bit (a batch-invariant llama.cpp build): a row
        # without logits processors is always trusted, with no pass over its logits
        numerics = getattr(target, "numerics", None)
        self.invariant = margin is None and numerics is not None and gap_noise(numerics) == 0.0

    @property
    def may_draft(self) -> bool:
        """Whether the next forward may carry a draft."""
        return not self.settling and self.paused_for <= 0

    def judge(self, step: Step, chooser: TokenChooser) -> int:
        """How many of ``step.new`` to keep: all of them, or those before the first row exact mode does not trust.

        Returns:
            0..len(step.new); below len(step.new) the step is cut before a near-tie (``settling`` is then True).
        """
        self.settle_forwards += self.settling
        self.settling = self.rebuild = False
        n_past, n_pend, drafted = step.n_past, step.n_fed, len(step.draft.tree) > 0
        plain_shaped = getattr(self.target, "last_forward_plain", True)  # False: packed beside other sequences' rows
        if not drafted and plain_shaped and n_past == self.plain_len and (n_past == 0 or n_pend == 1):
            self.plain_len = n_past + n_pend  # fed as plain decoding feeds, on the cache plain decoding holds
            return len(step.new)
        verify_like = drafted or not plain_shaped  # rows computed in another shape than plain decoding's
        untrusted = self._untrusted(step, chooser, verify_like)
        tied = next((j for j, bad in enumerate(untrusted) if bad), None)
        if tied is None:
            return len(step.new)
        self.near_ties += 1
        self.settling = True
        row = step.rows[tied]
        # a draft-free row would be judged by the settling threshold: where this row's gap is under it already,
        # only plain decoding's cache settles the token (a recompute on this cache would be a near-tie again)
        gaps = not chooser.processors
        self.rebuild = not verify_like or step.margin(row) < float(self._threshold(step, [row], False, gaps)[0])
        return tied

    def settle(self, step: Step, kept: int, committed: Sequence[int], n_prompt: int
               ) -> Steps[tuple[list[int], int]]:
        """After :meth:`judge` cut ``step`` before a near-tie: prepare the forward that recomputes it (a step
        function: the cache rebuild's forwards are asked for, each alone).

        Args:
            step: the judged step; ``kept`` tokens of its ``new`` were committed (their KV entries kept by the engine,
                the last one's dropped so it is fed again alone).
            committed: prompt + output ids, the kept tokens included.
            n_prompt: prompt length.
        Returns:
            (the tokens the next forward feeds, forwards run here to rebuild the cache; each emitted nothing).
        """
        if kept == 0:
            self.target.crop(step.n_past)
            self.spend(1)  # the forward that found the near-tie emitted nothing
        n_ctx = len(committed)
        if not self.rebuild:  # the cache holds every committed token's entry but the last kept one's
            return [int(t) for t in committed[self.target.length:n_ctx]], 0
        self.target.crop(self.plain_len)
        feed = [] if self.plain_len or n_ctx == n_prompt else [list(committed[:n_prompt])]
        feed += [[int(t)] for t in committed[max(self.plain_len, n_prompt):n_ctx - 1]]
        with self.target.solo():
            for ids in feed:
                yield from forward(self.target, ids)
        self.plain_len = self.target.length
        self.settle_forwards += len(feed)
        self.spend(len(feed))
        # the prompt when its own entries went too (none computed as plain decoding computes them), else the last token
        return [int(t) for t in committed[self.target.length:n_ctx]], len(feed)

    def scope(self):
        """The context the next forward runs in: alone, in plain decoding's shape, while it recomputes a near-tie
        row (:meth:`HFTarget.solo`); else no constraint."""
        return self.target.solo() if self.settling else contextlib.nullcontext()

    def emitted(self, n: int) -> None:
        """A forward emitted ``n`` tokens: it saved ``n - 1`` forwards; a drafting pause runs down by ``n``."""
        self.saved += max(n - 1, 0)
        self.paused_for = max(self.paused_for - n, 0)

    def spend(self, forwards: int) -> None:
        """Settling ran ``forwards`` that emitted nothing; while that outweighs what drafting saved, pause drafting."""
        self.spent += forwards
        deficit = self.spent - self.saved
        if deficit > 0 and self.pause_cap > 0:
            self.paused_for = max(self.paused_for, min(deficit, self.pause_cap))

    def _threshold(self, step: Step, rows: list[int], drafted: bool, gaps: bool):
        """Near-tie threshold (FloatTensor [len(rows)]) of these rows of ``step.logits``; ``gaps``: bound the change
        of top-2 gaps (no logits processors) rather than of each logit."""
        if self.margin is not None:
            return step.logits.new_full((len(rows),), self.margin).float()
        # the rows of a chain's accepted path are the first ones: a view, not a gathered copy of [len(rows), V]
        logits = step.logits[:len(rows)] if rows == list(range(len(rows))) else step.logits[rows]
        return near_tie_threshold(logits, self.target.numerics, EXACT_SAFETY if drafted else EXACT_SETTLE_SAFETY, gaps)

    def _untrusted(self, step: Step, chooser: TokenChooser, drafted: bool) -> list[bool]:
        """Per token of ``step.new``: True where its row's top-2 gap is under the near-tie threshold."""
        rows = step.rows
        if self.invariant and not chooser.processors:
            return [False] * len(rows)
        if self.margin is not None:
            return [step.margin(r) < self.margin for r in rows]
        need = self._threshold(step, rows, drafted, not chooser.processors)
        if not chooser.processors:
            return [step.margin(r) < float(m) for r, m in zip(rows, need, strict=True)]
        # Logits processors (penalties, biases, masks) reshape each logit monotonically, so a choice holds for every
        # row within the noise iff it holds for the worst one: its logit lowered by half the threshold, the others
        # raised by it (a penalty's factor then scales the noise of exactly the logits it scales). The threshold here
        # bounds each logit's change: a penalty is not invariant to a shift of every logit, which gap changes ignore.
        chosen = [step.choices[r] for r in rows]
        worst = step.logits[rows].double() + (need.double() / 2).unsqueeze(-1)
        worst[range(len(rows)), chosen] -= need.double()
        got, gaps = chooser.choose(worst, [step.row_pos[r] for r in rows],
                                   [step.extra[r] for r in rows] if step.extra else None)
        return [g != c or float(m) <= 0.0 for g, c, m in zip(got, chosen, gaps, strict=True)]
