"""Which request sits in which row of vLLM's batch, told from the token ids alone.

vLLM's ``custom_class`` proposer is called with per-row arrays and no request ids. Rows are not request identities:
vLLM's persistent batch (vllm/v1/worker/gpu_input_batch.py, ``add_request``, ``condense``, ``swap_states``) reuses
a finished request's row for a new one, slides the last rows down into freed ones, reorders rows, and drops a
request that is not scheduled this step (it comes back later, possibly in another row). A request is therefore
recognised by its tokens: row i *continues* a tracked request when its context
``token_ids_cpu[i, :num_tokens_no_spec[i]]`` is exactly that request's known ids followed by the ids sampled for
row i this step (``_bookkeeping_sync`` in gpu_model_runner.py writes them there before the proposer runs).
Anything else in a row is a new request. Two requests with the same ids so far are interchangeable here: what the
proposer keeps per request (draft sources, guard counts) depends on nothing else.

A tracked request missing from a call is *parked*, not dropped: it may be preempted or unscheduled for a while.
It expires (is handed back for learning) after ``park_calls`` calls without it, or when more than ``max_parked``
requests are parked (oldest first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class TrackedRequest:
    """One request as the proposer has seen it.

    Attributes:
        n_prompt: ids before the first sampled id at first sight (the prompt, for a request seen from its start).
        data: whatever the owner attaches (the proposer's per-request draft sources); None when new.
        first_call, last_call: numbers of the first and the last call that saw it.
    """

    def __init__(self, context: np.ndarray, n_prompt: int, call: int) -> None:
        self._buf = np.array(context, dtype=np.int32)
        self.n = len(self._buf)
        self.n_prompt = n_prompt
        self.data: Any = None
        self.first_call = self.last_call = call

    @property
    def tokens(self) -> np.ndarray:
        """Known ids, prompt + output so far: int32 [n] (a view; copy before keeping it)."""
        return self._buf[:self.n]

    def continued_by(self, context: np.ndarray, n_sampled: int) -> bool:
        """True when ``context`` (int [L]) is this request's known ids plus ``n_sampled`` new ones."""
        n = len(context) - n_sampled
        return n == self.n and np.array_equal(context[:n], self._buf[:n])

    def extend(self, ids: np.ndarray) -> None:
        """Append ids (int [m]); the buffer grows by doubling so a request costs O(its length) in all."""
        m = len(ids)
        if self.n + m > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.n + m), dtype=np.int32)
            grown[:self.n] = self._buf[:self.n]
            self._buf = grown
        self._buf[self.n:self.n + m] = ids
        self.n += m


class RequestTracker:
    """Maps the rows of each ``propose`` call to :class:`TrackedRequest` objects (see the module doc).

    Args:
        park_calls: calls a missing request is kept before it expires.
        max_parked: most parked requests kept; beyond it the oldest expire at once.
    """

    def __init__(self, park_calls: int = 64, max_parked: int = 1024) -> None:
        self.park_calls, self.max_parked = park_calls, max_parked
        self.calls = 0
        self._rows: dict[int, TrackedRequest] = {}  # row -> request, as of the last call
        self._parked: dict[int, TrackedRequest] = {}  # id(request) -> request, oldest first

    def match(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
              token_ids_cpu: np.ndarray) -> list[TrackedRequest | None]:
        """The request in each row: ``len(sampled_token_ids)`` entries, None for a row still in prefill.

        Args (vLLM's ``propose`` arguments, see ``RedraftProposer.propose``):
            sampled_token_ids: per row, the ids sampled this step (empty: nothing sampled, e.g. a prefill chunk).
            num_tokens_no_spec: int32 [max_num_reqs]; row i's context length, sampled ids included.
            token_ids_cpu: int32 [max_num_reqs, max_model_len]; row i's context in ``[i, :num_tokens_no_spec[i]]``.
        Matched requests are extended by the sampled ids; a row with sampled ids that continues no tracked request
        starts a new one. Tracked requests missing from this call are parked.
        """
        self.calls += 1
        n_rows = len(sampled_token_ids)
        out: list[TrackedRequest | None] = [None] * n_rows
        claimed: set[int] = set()
        contexts = [token_ids_cpu[i, :int(num_tokens_no_spec[i])] for i in range(n_rows)]
        unmatched = []
        for i in range(n_rows):  # the common case: a request stays in its row
            r = self._rows.get(i)
            if r is not None and r.continued_by(contexts[i], len(sampled_token_ids[i])):
                out[i] = r
                claimed.add(id(r))
            else:
                unmatched.append(i)
        if unmatched:  # moved rows, returning parked requests
            by_length: dict[int, list[TrackedRequest]] = {}
            for r in [*self._rows.values(), *self._parked.values()]:
                if id(r) not in claimed:
                    by_length.setdefault(r.n, []).append(r)
            for i in unmatched:
                m = len(sampled_token_ids[i])
                for r in by_length.get(len(contexts[i]) - m, ()):
                    if id(r) not in claimed and r.continued_by(contexts[i], m):
                        out[i] = r
                        claimed.add(id(r))
                        break
                if out[i] is None and m:
                    out[i] = TrackedRequest(contexts[i], len(contexts[i]) - m, self.calls)
        for r in self._rows.values():
            if id(r) not in claimed:
                self._parked[id(r)] = r
        for key in claimed:
            self._parked.pop(key, None)
        self._rows = {}
        for i, r in enumerate(out):
            if r is None:
                continue
            if len(contexts[i]) > r.n:
                r.extend(contexts[i][r.n:])
            r.last_call = self.calls
            self._rows[i] = r
        return out

    def expired(self) -> list[TrackedRequest]:
        """Parked requests that expire now (removed from the tracker), oldest first."""
        gone = [r for r in self._parked.values() if self.calls - r.last_call > self.park_calls]
        excess = len(self._parked) - len(gone) - self.max_parked
        if excess > 0:
            gone += [r for r in self._parked.values() if r not in gone][:excess]
        for r in gone:
            del self._parked[id(r)]
        return gone

    def drain(self) -> list[TrackedRequest]:
        """Every tracked request, parked and in rows (removed from the tracker): for a flush at shutdown."""
        rest = [*self._parked.values(), *self._rows.values()]
        self._parked, self._rows = {}, {}
        return rest
