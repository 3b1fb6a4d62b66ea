"""One model instance, one generation thread, a fair queue, and events from that thread to the event loop.

Requests are served one at a time (the engine decodes one sequence; its speed comes from drafts, not batching).
The queue is round-robin across tenants and first-in first-out within a tenant, so one tenant's burst cannot
starve another. Each job carries an asyncio queue: the generation thread posts ``("delta", text)`` as tokens are
accepted and then ``("done", outcome)``, ``("aborted", None)`` or ``("error", exception)`` with
``loop.call_soon_threadsafe``. A job whose ``cancel`` event is set (its client left) stops at its next step: the
runner checks it in the engine's per-step token callback and raises :class:`Cancelled`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Cancelled(Exception):
    """Raised inside a generation whose client went away; the scheduler turns it into an ``aborted`` event.

    Attributes: emitted, the tokens generated before it stopped.
    """

    def __init__(self, emitted: int = 0) -> None:
        super().__init__(f"cancelled after {emitted} tokens")
        self.emitted = emitted


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already (HTTP 503)."""


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
    """Runs jobs one at a time on a worker thread.

    Args:
        runner: ``runner(job, emit)`` generates ``job`` and returns its outcome; it calls ``emit(text)`` for each
            text delta and raises :class:`Cancelled` when ``job.cancel`` is set. Any other exception becomes an
            ``error`` event; the worker never dies of one.
        max_queue: most waiting jobs; beyond it :meth:`submit` raises :class:`QueueFull`.
        on_queue: called with the number of waiting jobs whenever it changes (metrics).
    """

    def __init__(self, runner: Callable[[Job, Callable[[str], None]], Any], *, max_queue: int = 256,
                 on_queue: Callable[[int], None] | None = None) -> None:
        self.runner, self.max_queue, self.on_queue = runner, max_queue, on_queue
        self._queues: dict[str, deque[Job]] = {}
        self._turns: deque[str] = deque()  # tenants with waiting jobs, in round-robin order
        self._cond = threading.Condition()
        self._stopping = False
        self._waiting = 0
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._work, name="redraft-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting job has waited (0 when none waits)."""
        with self._cond:
            heads = [q[0].arrived for q in self._queues.values() if q]
        return time.perf_counter() - min(heads) if heads else 0.0

    def submit(self, job: Job) -> None:
        """Queue a job. Raises QueueFull or ShuttingDown."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if self._waiting >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
            q = self._queues.setdefault(job.tenant, deque())
            if not q:
                self._turns.append(job.tenant)
            q.append(job)
            self._waiting += 1
            self._cond.notify()
        self._queue_changed()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running one at its next step, join the thread."""
        with self._cond:
            self._stopping = True
            left = [j for q in self._queues.values() for j in q]
            self._queues.clear()
            self._turns.clear()
            self._waiting = 0
            if self.current is not None:
                self.current.cancel.set()
            self._cond.notify_all()
        for j in left:
            j.post("error", ShuttingDown("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cond:
            while not self._turns and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            tenant = self._turns.popleft()
            q = self._queues[tenant]
            job = q.popleft()
            if q:
                self._turns.append(tenant)
            self._waiting -= 1
            self.current = job
        self._queue_changed()
        return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            job.started = time.perf_counter()
            try:
                if job.cancel.is_set():
                    raise Cancelled()
                job.outcome = self.runner(job, lambda text, j=job: self._emit(j, text))
                job.post("done", job.outcome)
            except Cancelled:
                job.post("aborted")
            except Exception as e:  # noqa: BLE001 - reported to the request; the worker must live on
                job.post("error", e)
            finally:
                with self._cond:
                    self.current = None

    @staticmethod
    def _emit(job: Job, text: str) -> None:
        if job.first_token is None:
            job.first_token = time.perf_counter()
        job.post("delta", text)

    def _queue_changed(self) -> None:
        if self.on_queue is not None:
            self.on_queue(self._waiting)
