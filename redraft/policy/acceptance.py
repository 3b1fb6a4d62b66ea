"""Per-source acceptance by draft position, learned online with forgetting.

For each draft source and each draft level d (1 = the token right after the root) this keeps decayed counts of
trials and successes of the event "level d accepted, given level d - 1 was". A verify forward in which the source
proposed ``D`` levels and ``a`` of them were accepted is a success at levels 1..a and, when a < D, a failure at
level a + 1; deeper levels were not tested (the draft was already rejected), so they learn nothing. Every update
first multiplies the source's counts by ``decay``, so the estimate follows the last ~1 / (1 - decay) outcomes: a
source that turns useful again is trusted again within a few forwards.

The estimate at level d is the posterior mean of a Beta prior with w pseudo-trials around a prior mean:
(successes_d + w_d * mean_d) / (trials_d + w_d). The prior counts as outcomes seen at level d before its first test,
and forgets like them: after level d was tested k times, w_d = ``prior_weight`` * decay^k, down to ``min_weight``
(0.1). Without that, a source that always fails kept an estimate of mean / (1 / (1 - decay) + 1) at level 1 (0.15
for a short match's 0.89 prior with the defaults), enough for a chance draft to look worth verifying on every
question (measured: the chat template's tail, which matches every stored answer, drafted 7-16 tokens on each novel
question's first two forwards and was never accepted). Per level, because deep levels are tested only when every
level above was accepted: their few outcomes must not overrule the prior as fast as level 1's many. A level never
tested keeps its prior whatever its weight. The prior mean of level 1 is ``prior_mean``; deeper levels
shrink toward the estimate of the level above, because deep levels are tested rarely (only when every shallower
level was accepted) and acceptance changes slowly with depth. A source's own knowledge of a particular draft
(corpus counts, match length) can replace the prior mean per node: see :mod:`redraft.policy.speculation`.
numpy only.
"""

from __future__ import annotations

import threading

import numpy as np

from redraft.defaults import ACCEPT_DECAY, ACCEPT_PRIOR, ACCEPT_PRIOR_MIN_WEIGHT, ACCEPT_PRIOR_WEIGHT


class AcceptanceTracker:
    """Decayed per-(source, level) acceptance counts.

    Args:
        max_depth: deepest level tracked (>= 1); deeper levels reuse the estimate of the deepest.
        prior_mean: prior P(accept) at level 1 for a source never seen, in [0, 1].
        prior_weight: pseudo-trials of the prior (> 0) before the source's first outcome: how many outcomes it takes
            to outweigh it (it decays with each outcome like they do).
        decay: factor in (0, 1] applied to a source's counts at each of its updates (1 = never forget).
        min_weight: the prior's weight at a level never decays below this many pseudo-trials
            (0 < min_weight <= prior_weight).
    Raises:
        ValueError: an argument outside its range.
    """

    def __init__(self, max_depth: int = 64, *, prior_mean: float = ACCEPT_PRIOR,
                 prior_weight: float = ACCEPT_PRIOR_WEIGHT, decay: float = ACCEPT_DECAY,
                 min_weight: float = ACCEPT_PRIOR_MIN_WEIGHT) -> None:
        if max_depth < 1 or not 0.0 <= prior_mean <= 1.0 or not prior_weight > 0 or not 0.0 < decay <= 1.0 \
                or not 0.0 < min_weight <= prior_weight:
            raise ValueError(f"AcceptanceTracker needs max_depth >= 1, prior_mean in [0, 1], prior_weight > 0, "
                             f"decay in (0, 1] and 0 < min_weight <= prior_weight; got {max_depth}, {prior_mean}, "
                             f"{prior_weight}, {decay}, {min_weight}")
        self.max_depth, self.prior_mean, self.prior_weight, self.decay = max_depth, prior_mean, prior_weight, decay
        self.min_weight = min_weight
        self._counts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # source -> (successes, trials), set at once
        self._tested: dict[str, np.ndarray] = {}  # times each level was tested, not decayed
        self._updates: dict[str, int] = {}  # outcomes recorded per source (what a cache of its estimates keys on)
        self._lock = threading.Lock()  # requests decoding in several threads (a batching server) share a tracker

    def counts(self, source: str) -> tuple[np.ndarray, np.ndarray]:
        """(successes, trials), float64 [max_depth] each, index d - 1 for level d (zeros for a new source)."""
        pair = self._counts.get(source)  # read without the lock: a source's pair is stored in one assignment
        if pair is None:
            with self._lock:
                pair = self._counts.setdefault(source, (np.zeros(self.max_depth), np.zeros(self.max_depth)))
        return pair

    def observe(self, source: str, proposed_depth: int, accepted: int) -> None:
        """Record one verify forward: ``proposed_depth`` levels drafted, the first ``accepted`` of them accepted.

        ``proposed_depth`` 0 records nothing (the source did not draft: no outcome, nothing forgotten).
        Raises:
            ValueError: negative numbers, or accepted > proposed_depth.
        """
        if proposed_depth < 0 or not 0 <= accepted <= proposed_depth:
            raise ValueError(f"need 0 <= accepted <= proposed_depth, got accepted {accepted} of {proposed_depth}")
        if proposed_depth == 0:
            return
        succ, trials = self.counts(source)
        with self._lock:  # one update at a time: concurrent requests' outcomes are all counted
            succ *= self.decay
            trials *= self.decay
            a = min(accepted, self.max_depth)
            succ[:a] += 1.0
            trials[:a] += 1.0
            if accepted < proposed_depth and a < self.max_depth:
                trials[a] += 1.0  # the first rejected level
            tested = self._tested.setdefault(source, np.zeros(self.max_depth, dtype=np.int64))
            tested[:a + (1 if accepted < proposed_depth else 0)] += 1
            self._updates[source] = self._updates.get(source, 0) + 1

    def updates(self, source: str) -> int:
        """How many outcomes of ``source`` were recorded: its estimates change exactly when this does."""
        return self._updates.get(source, 0)

    def upper(self, source: str) -> np.ndarray:
        """float64 [max_depth]: per level d, (successes_d + w_d) / (trials_d + w_d), an upper bound on the level's
        estimate whatever prior a node brings (its estimate puts the prior's w_d pseudo-trials on a mean of at most
        1), so no node of ``source`` at level d is judged likelier than this given its parent."""
        succ, trials = self.counts(source)
        w = self.weights(source)
        return (succ + w) / (trials + w)

    def weights(self, source: str) -> np.ndarray:
        """float64 [max_depth]: the prior's weight in pseudo-trials per level of ``source`` now,
        ``prior_weight`` * decay^(times the level was tested), at least ``min_weight``."""
        tested = self._tested.get(source)
        if tested is None:
            return np.full(self.max_depth, self.prior_weight)
        return np.maximum(self.min_weight, self.prior_weight * self.decay ** tested.astype(np.float64))

    def conditional(self, source: str, depth: int) -> np.ndarray:
        """float64 [depth]: estimated P(level d accepted | level d - 1 accepted) for d = 1..depth."""
        succ, trials = self.counts(source)
        out = np.empty(max(0, depth))
        mean, w = self.prior_mean, self.weights(source)
        tested = np.flatnonzero(trials[:min(len(out), self.max_depth)])
        last = int(tested[-1]) + 1 if len(tested) else 0  # below the deepest tested level nothing moves the mean
        for i in range(last):
            mean = (succ[i] + w[i] * mean) / (trials[i] + w[i])
            out[i] = mean
        out[last:] = mean
        return out
