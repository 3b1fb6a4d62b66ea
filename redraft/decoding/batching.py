"""Continuous batching: one target forward per step over the rows of every running sequence (iteration-level
scheduling, as vLLM, SGLang and Orca schedule), with chunked prefill.

Each running sequence's :meth:`Engine.generate` runs unchanged in its own thread, on its own
:class:`BatchedTarget` (an :class:`HFTarget` with its own KV cache) whose ``forward`` hands the rows to the
:class:`StepBatcher` and blocks until its step has run. The batcher's step loop (one thread) runs a step when every
registered sequence is waiting in ``forward`` or when the oldest waiting one has waited ``gather_s`` (a slow drafter
does not stall the others), packing the waiting rows into ONE forward (:mod:`redraft.decoding.packing`: the linear
layers over every row at once, attention sequence by sequence over each one's own cache):

- every step is priced in units of a row's matrix products, a row after L cached tokens costing 1 + w L
  (:mod:`redraft.decoding.stepcost`, w learned from the steps' own times), and may cost what ``max_batch_tokens``
  rows at depth 0 cost;
- smallest requests first, each whole while the step stays within that (a deep verify tree may thus be chunked);
- then at most one chunk of ONE request that did not fit (a long prompt's prefill): the rows that the rest of the
  step's cost pays for, at least ``min_chunk``, so fewer deeper into the prompt, where each row attends to more
  cached keys: every chunk's step costs about what the first one's does. Its thread stays blocked until its last
  chunk; earlier chunks need no logits. So a long prompt delays running streams by at most one chunk's forward.
- A step that carries one sequence's whole forward only runs exactly :meth:`HFTarget.forward` on its cache (a lone
  sequence, never chunked while it is the only one registered, decodes bit for bit as without the batcher); so do forwards asked for under :meth:`BatchedTarget.solo`
  (exact mode's recomputes), which are never packed. Anything else is not plain decoding's shape:
  ``last_forward_plain`` is then False and exact mode judges its rows like verify rows.
- Sliding-window models run every forward alone (a packed row's own mask would have to repeat each layer's window).

A ``cancel`` event set while a sequence waits (or between chunks) takes its rows out of the batch at once and raises
:class:`SequenceCancelled` in its thread; its cache is freed.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque

import torch

from redraft.decoding.packing import Block, causal_positions, enable_packed_attention, packed_forward
from redraft.decoding.stepcost import StepCostFit, key_weight, row_cost, rows_within
from redraft.decoding.target import HFTarget

CANCEL_POLL_S = 0.005  # how often a waiting sequence looks at its cancel event


class SequenceCancelled(Exception):
    """The sequence's cancel event was set while it waited for a step; its rows left the batch, its cache is freed."""


class _Request:
    """One ``forward`` call waiting for the batcher (possibly over several steps when chunked)."""

    __slots__ = ("target", "ids", "positions", "mask", "n_logits", "solo", "n_cached", "done_rows", "pieces", "skipped",
                 "arrived", "in_flight", "finished", "result", "error", "plain", "carried", "order", "given")

    def __init__(self, target: BatchedTarget, ids, positions, mask, n_logits: int, solo: bool, order: int) -> None:
        self.target, self.ids, self.n_logits, self.solo, self.order = target, list(ids), int(n_logits), solo, order
        s = len(self.ids)
        self.given = (positions, mask)  # as the caller passed them: a lone whole forward runs HFTarget.forward on them
        self.n_cached = target.length
        self.positions = (positions.reshape(-1).cpu() if positions is not None
                          else causal_positions(self.n_cached, s))
        self.mask = None if mask is None else mask.cpu()
        self.done_rows = 0
        self.pieces: list[torch.Tensor] = []
        self.arrived = time.monotonic()
        self.in_flight = False
        self.finished = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.plain = True
        self.carried = 1
        self.skipped = 0  # steps planned while it waited and did not get a place in them

    @property
    def rows_left(self) -> int:
        return len(self.ids) - self.done_rows

    def chunk(self, rows: int) -> tuple[Block, list[int], range]:
        """The next ``rows`` rows as a packing block, their ids, and which of them need logits (local indices)."""
        a, b, s = self.done_rows, self.done_rows + rows, len(self.ids)
        n = self.n_cached + a  # the cache holds the earlier chunks
        mask = None if self.mask is None else self.mask[..., a:b, :self.n_cached + b]
        first_logit = max(a, s - self.n_logits)
        return Block(n, self.positions[a:b], mask), self.ids[a:b], range(first_logit - a, max(b - a, first_logit - a))


class StepBatcher:
    """Runs the target forwards of several sequences as one forward per step (module docstring).

    Args:
        model: the transformers causal LM (eval mode) every sequence decodes with.
        max_batch_tokens: most rows in one packed step (>= 1), and a step costs at most what that many rows cost
            at depth 0 (:mod:`redraft.decoding.stepcost`); a forward with more rows is chunked over steps.
        min_chunk: fewest rows of a chunk (>= 1; a step may exceed ``max_batch_tokens`` by up to this much).
        gather_s: longest wait, in seconds, for every running sequence to ask for its next forward before a step
            runs with those that did.
    Attributes (read-only, for metrics): running (registered sequences), kv_tokens (their cached tokens, summed),
        steps (forwards run), rows (rows carried by them), forward_seconds (wall seconds in them), step_log (recent steps: per step a tuple of
        (sequence number, rows) per participant), step_seconds (the same steps' forward seconds).
    Raises:
        ValueError: max_batch_tokens < 1, min_chunk < 1 or gather_s < 0, or a model whose attention implementation
            has no mask function in transformers (:func:`redraft.decoding.packing.enable_packed_attention`).
    """

    def __init__(self, model, *, max_batch_tokens: int = 512, min_chunk: int = 32, gather_s: float = 0.02) -> None:
        if max_batch_tokens < 1 or min_chunk < 1 or gather_s < 0:
            raise ValueError(f"StepBatcher needs max_batch_tokens >= 1, min_chunk >= 1 and gather_s >= 0; got "
                             f"{max_batch_tokens}, {min_chunk}, {gather_s}")
        enable_packed_attention(model)  # the model's own attention, unchanged unless a forward is packed
        self.model = model
        self.cost_fit = StepCostFit(key_weight(model))  # from the FLOP count's weight to the host's, learned
        self.max_batch_tokens, self.min_chunk, self.gather_s = int(max_batch_tokens), int(min_chunk), float(gather_s)
        self.steps = self.rows = 0
        self.forward_seconds = 0.0
        self.last_step_rows = 0
        self._last_end = 0.0  # time.monotonic() when the last step ended
        self.step_log: deque[tuple[tuple[int, int], ...]] = deque(maxlen=4096)
        self.step_seconds: deque[float] = deque(maxlen=4096)  # each logged step's forward, in step_log's order
        self._cv = threading.Condition()
        self._targets: set[BatchedTarget] = set()
        self._pending: list[_Request] = []
        self._order = itertools.count()
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle and stats --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop thread (idempotent)."""
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="redraft-step-batcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the step loop; forwards still waiting fail with RuntimeError."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def running(self) -> int:
        return len(self._targets)

    @property
    def kv_tokens(self) -> int:
        with self._cv:
            return sum(t.length for t in self._targets)

    def sequence(self, cancel: threading.Event | None = None) -> BatchedTarget:
        """A new, empty per-sequence target registered with this batcher (call its ``close()`` when done)."""
        return BatchedTarget(self, cancel)

    # ---- called from sequence threads -----------------------------------------------------------------------------

    def register(self, target: BatchedTarget) -> int:
        with self._cv:
            self._targets.add(target)
            self._cv.notify_all()
        return next(self._numbers)

    def unregister(self, target: BatchedTarget) -> None:
        with self._cv:
            self._targets.discard(target)
            self._pending = [r for r in self._pending if r.target is not target or r.in_flight]
            self._cv.notify_all()

    def submit(self, target: BatchedTarget, ids, positions, mask, n_logits: int, solo: bool) -> torch.Tensor:
        """Queue one forward and block until it ran (see :meth:`BatchedTarget.forward`)."""
        if not self.alive:
            raise RuntimeError("StepBatcher is not running: call start() first")
        cancel = target.cancel
        if cancel is not None and cancel.is_set():
            raise SequenceCancelled("the sequence was cancelled")
        req = _Request(target, ids, positions, mask, n_logits, solo, next(self._order))
        with self._cv:
            self._pending.append(req)
            self._cv.notify_all()
        while not req.finished.wait(CANCEL_POLL_S if cancel is not None else 0.1):
            if cancel is not None and cancel.is_set():
                with self._cv:
                    if not req.in_flight and not req.finished.is_set():
                        self._pending.remove(req)
                        self._cv.notify_all()
                        raise SequenceCancelled("the sequence was cancelled while it waited for a step")
            if not self.alive and not req.finished.is_set():
                with self._cv:
                    if req in self._pending and not req.in_flight:
                        self._pending.remove(req)
                raise RuntimeError("StepBatcher stopped while a forward waited")
        if req.error is not None:
            raise req.error
        if cancel is not None and cancel.is_set():  # set while its step ran: the rows are dropped with the cache
            raise SequenceCancelled("the sequence was cancelled during its step")
        target.last_forward_plain, target.carried_rows = req.plain, req.carried
        return req.result

    # ---- the step loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                work = None
                while work is None:
                    if self._stopping:
                        for r in self._pending:
                            r.error = RuntimeError("StepBatcher stopped while a forward waited")
                            r.finished.set()
                        self._pending.clear()
                        return
                    work, wait = self._plan()
                    if work is None:
                        self._cv.wait(wait)
                for req, _ in work:
                    req.in_flight = True
            try:
                self._run(work)
                err = None
            except BaseException as e:  # delivered to every participant; the loop keeps serving
                err = e
            with self._cv:
                for req, _ in work:
                    req.in_flight = False
                    if err is not None:
                        req.error = err
                    if err is not None or req.rows_left == 0:
                        if req in self._pending:
                            self._pending.remove(req)
                        req.finished.set()
                self._last_end = time.monotonic()
                self._cv.notify_all()

    def _plan(self) -> tuple[list[tuple[_Request, int]] | None, float | None]:
        """The next step as [(request, rows)], or (None, seconds to wait). Called under the lock."""
        pending = self._pending
        if not pending:
            return None, None
        solo = next((r for r in pending if r.solo or r.target.sliding_window is not None), None)
        if solo is not None:
            return [(solo, solo.rows_left)], None
        if len(pending) == 1 and len(self._targets) <= 1:  # the only sequence: nothing to chunk for, run it whole
            return [(pending[0], pending[0].rows_left)], None
        waiting = {r.target for r in pending}
        # the deadline counts from the later of the oldest request's arrival and the last step's end: a forward that
        # arrived during a step must not make the next one start before the others could ask again
        oldest = max(min(r.arrived for r in pending), self._last_end)
        left = self.gather_s - (time.monotonic() - oldest)
        if len(waiting) < len(self._targets) and left > 0:
            return None, left
        fit = self.cost_fit
        step = plan_step(pending, fit.weight, fit.participant_rows, self.max_batch_tokens, self.min_chunk)
        placed = {id(r) for r, _ in step}
        for r in pending:
            r.skipped = 0 if id(r) in placed else r.skipped + 1
        return step, None

    @torch.inference_mode()
    def _run(self, work: list[tuple[_Request, int]]) -> None:
        """:meth:`_forward`, timed into ``forward_seconds`` and into the key weight's fit."""
        parts = [(req.n_cached + req.done_rows, rows) for req, rows in work]
        t0 = time.perf_counter()
        try:
            self._forward(work)
        finally:
            seconds = time.perf_counter() - t0
            self.forward_seconds += seconds
            self.step_seconds.append(seconds)
        self.cost_fit.observe(parts, seconds)

    def _forward(self, work: list[tuple[_Request, int]]) -> None:
        """Run one step's forward and deliver each participant's rows (called without the lock)."""
        total = sum(rows for _, rows in work)
        self.steps += 1
        self.rows += total
        self.last_step_rows = total
        self.step_log.append(tuple((req.target.number, rows) for req, rows in work))
        if len(work) == 1 and work[0][0].done_rows == 0 and work[0][1] == len(work[0][0].ids):
            req = work[0][0]  # alone and whole: plain decoding's own forward
            t = req.target
            req.result = HFTarget.forward(t, req.ids, *req.given, req.n_logits)
            req.done_rows, req.plain, req.carried = len(req.ids), True, 1
            return
        parts = [req.chunk(rows) for req, rows in work]
        owners = [req.target for req, _ in work]
        for t in owners:
            if t.cache is None:
                t.reset()
        logits = packed_forward(self.model, [t.cache for t in owners], [p[0] for p in parts], [p[1] for p in parts],
                                [p[2] for p in parts], cache_kwarg=owners[0].cache_kwarg)
        for (req, rows), got in zip(work, logits, strict=True):
            req.target.length += rows
            req.done_rows += rows
            if len(got):
                req.pieces.append(got)
            req.plain = False
            req.carried = total - rows + 1
            if req.rows_left == 0:
                req.result = torch.cat(req.pieces) if req.pieces else torch.empty(0, req.target.vocab_size)
                req.pieces = []


def plan_step(pending, weight: float, extra: float, max_batch_tokens: int, min_chunk: int) -> list:
    """Which waiting forwards a step carries, and how many rows of each (the module docstring's rules).

    Args:
        pending: the waiting forwards; each has ``rows_left``, ``n_cached`` + ``done_rows`` (its depth), ``order``
            (arrival) and ``skipped`` (steps planned since it last had a place).
        weight: w, a cached key's cost per row (:mod:`redraft.decoding.stepcost`).
        extra: what each participant beyond the first costs beyond its rows, in rows.
        max_batch_tokens: the step's rows at most, and its cost at most theirs at depth 0.
        min_chunk: the fewest rows a chunk gets (the step may exceed both bounds by up to this much).
    Returns:
        [(request, rows)] in arrival order: smallest requests whole while both bounds allow, then at most one chunk
        of the request that waited most steps without a place (the oldest among equals): a long prompt's prefill
        takes it step after step, so a verify tree that did not fit beside it gets the next one instead of waiting the
        whole prefill out.
    """
    budget = row_cost(weight, 0, max_batch_tokens)
    rows_left = max_batch_tokens
    step: list = []
    rest = []
    for r in sorted(pending, key=lambda r: (r.rows_left, r.order)):
        depth = r.n_cached + r.done_rows
        left = budget - (extra if step else 0.0)  # a participant beyond the first costs beyond its rows
        if r.rows_left <= min(rows_left, rows_within(weight, depth, left)):
            step.append((r, r.rows_left))
            budget = left - row_cost(weight, depth, r.rows_left)
            rows_left -= r.rows_left
        else:
            rest.append(r)
    if rest:
        big = max(rest, key=lambda r: (r.skipped, -r.order))
        rows = min(rows_left, rows_within(weight, big.n_cached + big.done_rows, budget - (extra if step else 0.0)))
        step.append((big, min(big.rows_left, max(rows, min_chunk))))
    step.sort(key=lambda p: p[0].order)
    return step


class BatchedTarget(HFTarget):
    """One sequence's target inside a :class:`StepBatcher`: an :class:`HFTarget` (its own KV cache; reset, seed,
    snapshot, crop, keep and verified_kv unchanged) whose ``forward`` runs as part of the batcher's next step.

    Args:
        batcher: the started :class:`StepBatcher` (the sequence registers with it at once).
        cancel: an event that, once set, makes a waiting ``forward`` raise :class:`SequenceCancelled`.
    Attributes:
        carried_rows: rows the last step carried for other sequences, plus 1 for this sequence's root row (1 when it
            ran alone): the load ``B`` of :mod:`redraft.policy.load`.
        last_forward_plain: whether the last forward ran exactly as :meth:`HFTarget.forward` alone (plain decoding's
            shape); False after a packed or chunked forward.
        number: the sequence's number in the batcher's ``step_log``.
    """

    def __init__(self, batcher: StepBatcher, cancel: threading.Event | None = None) -> None:
        super().__init__(batcher.model)
        self.batcher, self.cancel = batcher, cancel
        # until its first step: the load the batcher carries now (none when no other sequence is running)
        self.carried_rows = batcher.last_step_rows + 1 if batcher.running else 1
        self.last_forward_plain = True
        self._solo = 0
        self.closed = False
        self.number = batcher.register(self)

    def forward(self, ids: list[int], positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                n_logits: int = 1) -> torch.Tensor:
        """As :meth:`HFTarget.forward` (same arguments, shapes and result), run within the batcher's next step.

        Raises:
            SequenceCancelled: the cancel event was set while this forward waited (its cache is then freed).
            RuntimeError: the batcher is not running, or the sequence was closed.
        """
        if self.closed:
            raise RuntimeError("forward on a closed BatchedTarget")
        if self.cache is None:
            self.reset()
        try:
            return self.batcher.submit(self, ids, positions, mask, n_logits, solo=self._solo > 0)
        except SequenceCancelled:
            self.close()
            raise

    @contextlib.contextmanager
    def solo(self):
        """Within this context every forward runs alone, as :meth:`HFTarget.forward` (never packed or chunked)."""
        self._solo += 1
        try:
            yield self
        finally:
            self._solo -= 1

    def close(self) -> None:
        """Leave the batcher and free the KV cache (idempotent; call it in a ``finally``)."""
        self.closed = True
        self.batcher.unregister(self)
        self.cache = None
        self.length = 0
