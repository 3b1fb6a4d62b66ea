"""Finished vLLM requests into a learned corpus: the proposer's side of learn-once (numpy only).

A request's span is its prompt + output as the proposer saw them (:class:`~redraft.integrations.slots.TrackedRequest`),
cut after its first EOS id. The corpus is an :class:`~redraft.corpus.online.OnlineCorpus` that other writers (servers,
other engines) share, so a span one of them already stored is not stored again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from redraft.corpus import CorpusError
from redraft.corpus.online import OnlineCorpus
from redraft.integrations.slots import RequestTracker, TrackedRequest

log = logging.getLogger("vllm.redraft")


class SpanLearner:
    """Finished requests into the learned corpus (:class:`~redraft.corpus.online.OnlineCorpus`): drafted from at
    once and, on the writing rank, appended to its journal. A span the corpus already holds is not stored again
    (:meth:`OnlineCorpus.learn`, the server's rule). A write error is logged (once) and the span is not kept;
    generation goes on.

    ``overshoot``: ids a span that did not end in EOS may carry past the request's output. vLLM's last step of a
    request cut by ``max_tokens`` can accept up to K draft ids plus the bonus id beyond the cut; vLLM drops them
    from the output, but the proposer (which is not told ``max_tokens``) sees them. Such a span whose first
    ``len - overshoot`` ids the corpus already holds is the same answer another writer stored (a replay): it is not
    stored again.
    """

    def __init__(self, corpus: OnlineCorpus, overshoot: int = 0) -> None:
        self.corpus = corpus
        self.overshoot = overshoot
        self.spans = 0
        self.warned = False

    def learn(self, spans: Sequence[np.ndarray], cut: Sequence[bool] | None = None) -> None:
        """Learn spans (int [n] each, prompt + output); ``cut[i]``: span i ended in EOS (no overshoot)."""
        for i, span in enumerate(spans):
            eos_cut = cut is not None and cut[i]
            if not eos_cut and self.overshoot and len(span) > self.overshoot and \
                    self.corpus.corpus.holds(span[:-self.overshoot]):
                continue
            try:
                self.spans += self.corpus.learn(span)
            except (OSError, CorpusError) as e:
                if not self.warned:
                    self.warned = True
                    log.warning("redraft: cannot learn into %s (%s); spans are not kept until it works again",
                                self.corpus.directory, e)


def finished_span(r: TrackedRequest, eos: frozenset[int]) -> tuple[np.ndarray, bool] | None:
    """A tracked request's prompt + output (int32 [n]), cut after its first EOS id in the output (vLLM may have
    accepted draft ids past it; it drops them from the request's output too), and whether it was cut there. None
    when it has no output yet or was learned already."""
    if r.n <= r.n_prompt or (r.data is not None and r.data.learned):
        return None
    tokens = r.tokens
    if eos:
        hits = np.flatnonzero(np.isin(tokens[r.n_prompt:], list(eos)))
        if len(hits):
            return tokens[:r.n_prompt + int(hits[0]) + 1].copy(), True
    return tokens.copy(), False


def learn_requests(learner: SpanLearner, requests: Sequence[TrackedRequest], eos: frozenset[int]) -> None:
    """Learn the spans of finished ``requests`` (those not learned yet)."""
    found = [f for f in (finished_span(r, eos) for r in requests) if f is not None]
    learner.learn([span for span, _ in found], [cut for _, cut in found])


def learn_all(tracker: RequestTracker, learner: SpanLearner, eos: frozenset[int]) -> None:
    """Learn every request ``tracker`` still holds (at shutdown), removing them from it."""
    learn_requests(learner, tracker.drain(), eos)


__all__ = ["SpanLearner", "finished_span", "learn_all", "learn_requests"]
