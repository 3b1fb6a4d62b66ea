"""Requests that start together and share a prompt prefix compute it once (in-batch prefix caching).

Agent frameworks and evaluation harnesses send bursts of requests that open alike: the same system prompt, tool
list or few-shot examples. The prefix cache (:mod:`redraft.server.prefix_cache`) serves a prefix only after a
request holding it has computed it, so requests admitted together would each prefill it. SGLang's scheduler meets
this case by running one request of such a group first so that the others find its prefix cached ("in-batch prefix
caching"); :class:`SharedPrefill` does the same with explicit roles, within one tenant:

- **announce**: the scheduler makes the step functions of every job it admits together before any of them runs
  (:meth:`redraft.server.scheduler.Scheduler._start`), and each one's prompt is announced then.
- **lead**: a request starting while an announced request of its tenant shares at least ``min_tokens`` more prompt
  tokens with it than its own cache hit computes only that shared part first (one forward), stores it in the
  prefix cache and goes on from it.
- **follow**: a request starting while a shared part it needs (``min_tokens`` beyond its own hit) is being computed
  waits step by step (:func:`redraft.runtimes.sequence.wait_step`) until it is stored, then starts from the cache:
  it waits one step for a part that fits in one, and computes none of the part's rows.

Tenants never share (as in the prefix cache). Exact: followers and the leader go on from reused KV entries, which
the engine judges like verify rows, as on any prefix-cache hit. Runs on the scheduler's loop only (one thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.runtimes.sequence import Steps, forward, wait_step
from redraft.runtimes.transformers.target import HFTarget, PrefixKV

from .prefix_cache import PrefixCache, common_prefix

# Fewest shared tokens worth a lead: below it the followers' wait of one step costs about what the rows save.
MIN_SHARED_TOKENS = 16


@dataclass
class SharedPrefillStats:
    """Counts since start: ``leads`` shared parts computed once, ``tokens`` their tokens, ``waits`` steps a
    follower waited for one."""

    leads: int = 0
    tokens: int = 0
    waits: int = 0


class SharedPrefill:
    """Who computes a prompt prefix that requests starting together share (module docstring).

    Args:
        cache: the server's prefix cache (the shared parts are stored there; its budget applies).
        min_tokens: fewest tokens a shared part must add to a request's own cache hit (>= 1).
    Attributes:
        stats: :class:`SharedPrefillStats`.
    """

    def __init__(self, cache: PrefixCache, min_tokens: int = MIN_SHARED_TOKENS) -> None:
        self.cache, self.min_tokens = cache, max(1, int(min_tokens))
        self._announced: dict[int, tuple[str, tuple[int, ...]]] = {}  # handle -> (tenant, prompt)
        self._computing: list[tuple[str, tuple[int, ...]]] = []  # shared parts being computed now
        self._handles = itertools.count()
        self.stats = SharedPrefillStats()

    def announce(self, tenant: str, prompt: Sequence[int]) -> int:
        """A request of ``tenant`` with ``prompt`` is about to start; returns its handle for :meth:`withdraw`."""
        handle = next(self._handles)
        self._announced[handle] = (tenant, tuple(int(t) for t in prompt))
        return handle

    def withdraw(self, handle: int) -> None:
        """The announced request started (or will not prefill): no later request leads for it."""
        self._announced.pop(handle, None)

    def prefill(self, tenant: str, target: HFTarget, prompt: Sequence[int], hit: PrefixKV | None,
                room: int | None = None) -> Steps[tuple[PrefixKV | None, int]]:
        """Before a request's engine starts (``yield from`` it in the request's step function): follow or lead.

        Args:
            tenant, prompt: the request's (its own announcement already withdrawn).
            target: the request's own target (empty; a leader's forward fills it).
            hit: what the prefix cache gave it (None: nothing).
            room: the tighter budget the prefix cache may use now (:meth:`PrefixCache.store`).
        Returns:
            (the prefix to start the engine from, ``Engine.steps(prefix=...)``: the cache's entry after a wait, the
            shared part after a lead, else ``hit``; how many of its tokens this request computed itself: the shared
            part's beyond ``hit`` after a lead, else 0).
        """
        ids = tuple(int(t) for t in prompt)
        while self._covering(tenant, ids, hit.length if hit is not None else 0):
            self.stats.waits += 1
            yield from wait_step(target)
            hit = self.cache.lookup(tenant, ids)
        have = hit.length if hit is not None else 0
        k = self._lead_length(tenant, ids, have)
        if not k:
            return hit, 0
        part = (tenant, ids[:k])
        self._computing.append(part)
        try:
            if hit is not None:
                target.seed(hit)
            else:
                target.reset()
            yield from forward(target, list(ids[have:k]))  # its one logits row is not used
            shared = target.snapshot(ids[:k])
            self.cache.store(tenant, shared, room)
        finally:
            self._computing.remove(part)
        self.stats.leads += 1
        self.stats.tokens += k - have
        return shared, k - have

    def _covering(self, tenant: str, ids: tuple[int, ...], have: int) -> bool:
        """Whether a shared part being computed gives ``ids`` at least ``min_tokens`` beyond ``have``."""
        return any(t == tenant and common_prefix(part, ids, limit=len(ids) - 1) >= have + self.min_tokens
                   for t, part in self._computing)

    def _lead_length(self, tenant: str, ids: tuple[int, ...], have: int) -> int:
        """The longest prefix ``ids`` shares with an announced request of ``tenant`` that each can start from (one
        prompt token left to feed for both), or 0 when it adds fewer than ``min_tokens`` to ``have``."""
        best = 0
        for t, other in self._announced.values():
            if t == tenant:
                best = max(best, common_prefix(ids, other, limit=min(len(ids), len(other)) - 1))
        return best if best >= have + self.min_tokens else 0
