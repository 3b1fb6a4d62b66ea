"""One model instance, one scheduler loop, a fair queue, and events from it to the event loop.

The loop (one thread) admits jobs, advances every running job by one target forward per step and hands each job's
events to its request's event loop. A job is a step function (:mod:`redraft.runtimes.sequence`: the runner's
generator, suspended wherever it waits for a forward); each step the loop gives all running jobs' forwards to the
step batcher, which packs them into one forward (:mod:`redraft.runtimes.transformers.batching`), or runs them one after another
without one. ``max_running=1`` serves requests one at a time. The queue is round-robin across tenants and first-in
first-out within a tenant, so one tenant's burst cannot starve another. A job is admitted when a place is free and
its KV reservation (``Job.kv_tokens``: prompt + max_tokens) fits in the server's
:class:`~redraft.server.admission.KVBudget`; the job at the head of the round-robin waits until it does (no job jumps
ahead of it, so a long request is never starved by short ones).

Each job carries an asyncio queue: the loop posts ``("delta", text)`` as tokens are accepted (after
``("logprobs", entries)`` when the request asked for log-probabilities) and then
``("done", outcome)``, ``("aborted", None)`` or ``("error", exception)`` with ``loop.call_soon_threadsafe``. A job
whose ``cancel`` event is set (its client left) stops before its next step: the loop raises
:class:`~redraft.runtimes.transformers.batching.SequenceCancelled` where it waits (the runner turns it into :class:`Cancelled`)
and releases the job's KV reservation at once. The HTTP side only enqueues and reads events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redraft.runtimes.sequence import Sequence, Steps
from redraft.runtimes.transformers.batching import SequenceCancelled

from .admission import KVBudget, retry_after


class Cancelled(Exception):
    """Raised inside a generation whose client went away; the scheduler turns it into an ``aborted`` event.

    Attributes: emitted, the tokens generated before it stopped.
    """

    def __init__(self, emitted: int = 0) -> None:
        super().__init__(f"cancelled after {emitted} tokens")
        self.emitted = emitted


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already (HTTP 429). ``retry_after``: seconds until a place is expected to
    free (>= 1)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The scheduler no longer takes jobs (HTTP 503)."""


@dataclass
class Job:
    """One request waiting for or using the model.

    Attributes:
        tenant: whose request it is (the round-robin key).
        payload: what the runner needs (opaque here).
        loop, events: the event loop of the request and the queue its handler reads events from.
        cancel: set by the handler when the client leaves; the generation stops at its next step.
        arrived, started, first_token: ``time.perf_counter()`` stamps (started/first_token None until then).
        outcome: what the runner returned, once it finished (None until then, or when it failed).
        kv_tokens: the KV tokens the job reserves while it runs (prompt + max_tokens; 0 = no reservation).
        generated: the tokens generated so far (set by the runner as they are accepted; what a request the client
            left reports).
    """

    tenant: str
    payload: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    outcome: Any = None
    kv_tokens: int = 0
    generated: int = 0

    @property
    def queue_seconds(self) -> float:
        return (self.started if self.started is not None else time.perf_counter()) - self.arrived

    def post(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's event loop (from any thread); a closed loop means nobody listens."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            self.cancel.set()


class Scheduler:
    """Runs up to ``max_running`` jobs at once, all on one loop thread, one forward per step (module docstring).

    Args:
        runner: ``runner(job, emit)`` returns the job's step function (a generator of
            :class:`~redraft.runtimes.sequence.ForwardCall`, returning the job's outcome); it calls ``emit(text)`` for
            each text delta and raises :class:`Cancelled` when ``job.cancel`` is set or a
            :class:`~redraft.runtimes.transformers.batching.SequenceCancelled` is raised where it waits. Any other exception
            becomes an ``error`` event; the loop never dies of one.
        max_queue: most waiting jobs; beyond it :meth:`submit` raises :class:`QueueFull`.
        max_running: most jobs running at once (>= 1).
        budget: the server's :class:`~redraft.server.admission.KVBudget` (None: no KV admission); a job starts only
            once its ``kv_tokens`` are reserved there, and releases them when it ends.
        on_queue: called with the number of waiting jobs whenever it changes (metrics).
        batcher: a :class:`~redraft.runtimes.transformers.batching.StepBatcher` that packs each step's forwards into one, or None:
            each running job's forward runs alone, one after another.
    Raises:
        ValueError: max_running < 1.
    """

    SERVICE_DECAY = 0.8  # weight of the previous mean in the running mean of service times (Retry-After)
    IDLE_WAIT_S = 0.25  # an idle loop also wakes this often to drop waiting jobs whose client left
    # A long prompt arriving at an idle server waits this long for company before its whole prefill runs alone:
    # requests sent together (a burst of clients) then share chunked steps instead of all waiting behind it.
    ARRIVAL_WAIT_S = 0.05

    def __init__(self, runner: Callable[[Job, Callable[[str], None]], Steps[Any]], *, max_queue: int = 256,
                 max_running: int = 1, budget: KVBudget | None = None,
                 on_queue: Callable[[int], None] | None = None, batcher=None) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.runner, self.max_queue, self.on_queue = runner, max_queue, on_queue
        self.max_running, self.budget, self.batcher = max_running, budget, batcher
        self._queues: dict[str, deque[Job]] = {}
        self._turns: deque[str] = deque()  # tenants with waiting jobs, in round-robin order
        self._cond = threading.Condition()
        self._stopping = False
        self._waiting = 0
        self._running: list[Job] = []  # in the order they started
        self._service_s: float | None = None  # running mean of seconds from start to end
        self._thread = threading.Thread(target=self._loop, name="redraft-scheduler", daemon=True)

    def start(self) -> None:
        """Start the scheduler loop's thread."""
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs waiting to start (a job whose client left is dropped from the queue at once)."""
        with self._cond:
            purged = self._purge_cancelled()
        if purged:
            self._queue_changed()
        return self._waiting

    def _purge_cancelled(self) -> int:
        """Drop waiting jobs whose ``cancel`` is set (their client left) and tell their handlers; returns how many.
        Called under the lock: a client that leaves while queued frees its place at once, not when the queue
        reaches it."""
        dropped = 0
        for tenant in list(self._queues):
            q = self._queues[tenant]
            keep = deque(j for j in q if not j.cancel.is_set())
            for j in q:
                if j.cancel.is_set():
                    j.post("aborted")
            dropped += len(q) - len(keep)
            if keep:
                self._queues[tenant] = keep
            else:
                del self._queues[tenant]
                self._turns.remove(tenant)
        self._waiting -= dropped
        return dropped

    @property
    def running(self) -> int:
        """Jobs running now."""
        return len(self._running)

    @property
    def current(self) -> Job | None:
        """The running job that started first, or None."""
        with self._cond:
            return self._running[0] if self._running else None

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting job has waited (0 when none waits)."""
        with self._cond:
            heads = [q[0].arrived for q in self._queues.values() if q]
        return time.perf_counter() - min(heads) if heads else 0.0

    def retry_after(self) -> int:
        """Seconds until a queue place is expected to free (``Retry-After``, >= 1): the running job expected to end
        first, from the recent mean service time (:func:`~redraft.server.admission.retry_after`)."""
        now = time.perf_counter()
        with self._cond:
            elapsed = [now - j.started for j in self._running if j.started is not None]
        return retry_after(self._service_s, elapsed)

    def submit(self, job: Job) -> None:
        """Queue a job. Raises QueueFull or ShuttingDown."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self._purge_cancelled()
            full = self._waiting >= self.max_queue
            if not full:
                q = self._queues.setdefault(job.tenant, deque())
                if not q:
                    self._turns.append(job.tenant)
                q.append(job)
                self._waiting += 1
                self._cond.notify_all()
        if full:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later",
                            self.retry_after())
        self._queue_changed()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running ones before their next step, join the loop."""
        with self._cond:
            self._stopping = True
            left = [j for q in self._queues.values() for j in q]
            self._queues.clear()
            self._turns.clear()
            self._waiting = 0
            for j in self._running:
                j.cancel.set()
            self._cond.notify_all()
        for j in left:
            j.post("error", ShuttingDown("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _admit(self, free: int) -> list[Job]:
        """Up to ``free`` jobs to start now, each taken off the queue with its KV reserved (a cancelled job is handed
        out unreserved, to be aborted); waits while there is nothing to run. Empty when stopping."""
        taken: list[Job] = []
        with self._cond:
            while not self._stopping:
                if self._purge_cancelled():
                    self._cond.notify_all()
                while len(taken) < free and (job := self._admissible()) is not None:
                    self._take(job)
                    taken.append(job)
                if taken or self._running:
                    break
                self._cond.wait(self.IDLE_WAIT_S)
        if taken:
            self._queue_changed()
        return taken

    def _take(self, job: Job) -> None:
        """Move the admissible head job from the queue to the running ones (under the lock)."""
        tenant = self._turns.popleft()
        q = self._queues[tenant]
        q.popleft()
        if q:
            self._turns.append(tenant)
        else:
            del self._queues[tenant]
        self._waiting -= 1
        job.started = time.perf_counter()
        self._running.append(job)

    def _admissible(self) -> Job | None:
        """The job at the head of the round-robin when it may start now (cancelled, or its KV reserved)."""
        if not self._turns:
            return None
        job = self._queues[self._turns[0]][0]
        if job.cancel.is_set():
            job.kv_tokens = 0  # nothing to reserve: it is aborted at once
            return job
        if self.budget is None:
            return job
        job.kv_tokens = min(job.kv_tokens, self.budget.capacity)  # callers refuse larger ones; never wait forever
        return job if self.budget.try_reserve(job.kv_tokens) else None

    def _loop(self) -> None:
        """Admit, step, deliver: until :meth:`stop`."""
        running: list[tuple[Job, Sequence]] = []
        while True:
            idle = not running
            self._start(running, self._admit(self.max_running - len(running)))
            if idle and self._lone_long_prefill(running) and self._await_arrival(self.ARRIVAL_WAIT_S):
                self._start(running, self._admit(self.max_running - len(running)))
            stopping = self._stopping
            for job, seq in running:
                if stopping or job.cancel.is_set():
                    seq.fail(SequenceCancelled("the request was cancelled"))
            live = [seq for _, seq in running if not seq.done]
            if live:
                self._step(live)
            still = []
            for job, seq in running:
                if seq.done:
                    self._deliver(job, seq)
                else:
                    still.append((job, seq))
            running = still
            if stopping and not running:
                return

    def _start(self, running: list[tuple[Job, Sequence]], jobs: list[Job]) -> None:
        """Start each admitted job's sequence (up to its first forward) into ``running``; a cancelled one ends.
        Every job's step function is made before the first one runs, so the runner knows which jobs start together
        (requests that share a prompt prefix compute it once: :mod:`redraft.server.shared_prefill`)."""
        made = []
        for job in jobs:
            if job.cancel.is_set():
                job.post("aborted")
                self._finished(job)
                continue
            made.append((job, Sequence(self.runner(job, lambda text, j=job: self._emit(j, text)))))
        for job, seq in made:
            running.append((job, seq.start()))

    def _lone_long_prefill(self, running: list[tuple[Job, Sequence]]) -> bool:
        """Whether the only running sequence asks for a forward the batcher would chunk beside others (more rows
        than ``max_batch_tokens``): alone it runs whole, and requests arriving meanwhile wait for all of it. A batcher
        that never chunks a prefill (``chunks_prefill`` False: llama.cpp's) runs it whole either way."""
        if self.batcher is None or not self.batcher.chunks_prefill or len(running) != 1:
            return False
        call = running[0][1].call
        return call is not None and len(call.ids) > self.batcher.max_batch_tokens

    def _await_arrival(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a job to queue; whether one did."""
        deadline = time.perf_counter() + seconds
        with self._cond:
            while not self._turns and not self._stopping and (left := deadline - time.perf_counter()) > 0:
                self._cond.wait(left)
            return bool(self._turns)

    def _step(self, live: list[Sequence]) -> None:
        """One forward per running job: packed into one by the batcher, or each alone."""
        if self.batcher is not None:
            self.batcher.step(live)
            return
        for seq in live:
            try:
                logits = seq.call.run_alone()
            except Exception as e:  # noqa: BLE001 - raised inside that job
                seq.fail(e)
            else:
                seq.advance(logits)

    def _deliver(self, job: Job, seq: Sequence) -> None:
        """Post an ended job's last event and release what it held."""
        try:
            if seq.error is None:
                job.outcome = seq.result
                job.post("done", job.outcome)
            elif isinstance(seq.error, (Cancelled, SequenceCancelled)):
                job.post("aborted")
            else:
                job.post("error", seq.error)
        finally:
            self._finished(job)

    def _finished(self, job: Job) -> None:
        if self.budget is not None and job.kv_tokens:
            self.budget.release(job.kv_tokens)
        took = time.perf_counter() - (job.started or time.perf_counter())
        with self._cond:
            self._running.remove(job)
            m = self._service_s
            self._service_s = took if m is None else self.SERVICE_DECAY * m + (1 - self.SERVICE_DECAY) * took
            self._cond.notify_all()

    @staticmethod
    def _emit(job: Job, text: str) -> None:
        if job.first_token is None:
            job.first_token = time.perf_counter()
        job.post("delta", text)

    def _queue_changed(self) -> None:
        if self.on_queue is not None:
            self.on_queue(self._waiting)
