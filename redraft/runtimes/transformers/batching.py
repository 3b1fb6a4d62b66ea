"""Continuous batching: one target forward per step over the rows of every running sequence (iteration-level
scheduling, as vLLM, SGLang and Orca schedule), with chunked prefill.

Each running sequence is a step function (:mod:`redraft.runtimes.sequence`: an :meth:`Engine.steps` generation, a
server request) on its own :class:`~redraft.runtimes.transformers.target.HFTarget` (its own KV cache), suspended where it asked
for a forward. :meth:`StepBatcher.step` takes every running sequence's waiting :class:`ForwardCall`, packs their rows
into ONE forward (:mod:`redraft.runtimes.transformers.packing`: the linear layers over every row at once, attention sequence by
sequence over each one's own cache) and resumes each sequence whose forward is complete, which drafts and asks for
its next forward. One loop calls it (a server's scheduler, :func:`run_together`); no thread per sequence.

- every step is priced in units of a row's matrix products, a row after L cached tokens costing 1 + w L
  (:mod:`redraft.pricing.stepcost`, w learned from the steps' own times), and may cost what ``max_batch_tokens``
  rows at depth 0 cost;
- smallest forwards first, each whole while the step stays within that (a deep verify tree may thus be chunked);
- then at most one chunk of ONE forward that did not fit (a long prompt's prefill): the rows that the rest of the
  step's cost pays for, at least ``min_chunk``, so fewer deeper into the prompt, where each row attends to more
  cached keys: every chunk's step costs about what the first one's does. Its sequence stays suspended until its last
  chunk; earlier chunks need no logits. So a long prompt delays running streams by at most one chunk's forward.
- A step of one sequence alone runs exactly its target's ``forward`` (a lone sequence, never chunked, decodes bit for
  bit as :func:`redraft.runtimes.sequence.drive` runs it); so do forwards asked for under :meth:`HFTarget.solo`
  (exact mode's recomputes), which are never packed. Anything else is not plain decoding's shape: the target's
  ``last_forward_plain`` is then False and exact mode judges its rows like verify rows.
- Sliding-window models run every forward alone (a packed row's own mask would have to repeat each layer's window).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from collections.abc import Sequence as Seq

import torch

from redraft.pricing.stepcost import StepCostFit, key_weight, row_cost, rows_within
from redraft.runtimes.sequence import ForwardCall, Sequence, Steps, resume_waits, split_waits
from redraft.runtimes.transformers.packing import Block, causal_positions, enable_packed_attention, packed_forward
from redraft.runtimes.transformers.target import HFTarget


class SequenceCancelled(Exception):
    """Raised inside a sequence's step function where it waits for a forward when its client left (a scheduler
    throws it in, :meth:`Sequence.fail`); its rows leave the batch."""


class _Request:
    """One waiting :class:`ForwardCall` and its progress over the steps that run it (several when chunked)."""

    __slots__ = ("call", "target", "ids", "positions", "mask", "n_logits", "n_cached", "done_rows", "pieces",
                 "skipped", "order")

    def __init__(self, call: ForwardCall, order: int) -> None:
        self.call, self.target, self.ids, self.n_logits, self.order = call, call.target, call.ids, call.n_logits, order
        self.n_cached = call.n_cached
        self.positions = (call.positions.reshape(-1).cpu() if call.positions is not None
                          else causal_positions(self.n_cached, len(self.ids)))
        self.mask = None if call.mask is None else call.mask.cpu()
        self.done_rows = 0
        self.pieces: list[torch.Tensor] = []
        self.skipped = 0  # steps planned while it waited and did not get a place in them

    @property
    def solo(self) -> bool:
        return self.call.solo or self.target.sliding_window is not None

    @property
    def rows_left(self) -> int:
        return len(self.ids) - self.done_rows

    def logits(self) -> torch.Tensor:
        """The finished call's logits rows, its chunks' in order: FloatTensor [n_logits, V]."""
        if len(self.pieces) == 1:
            return self.pieces[0]
        return torch.cat(self.pieces) if self.pieces else torch.empty(0, self.target.vocab_size)

    def chunk(self, rows: int) -> tuple[Block, list[int], range]:
        """The next ``rows`` rows as a packing block, their ids, and which of them need logits (local indices)."""
        a, b, s = self.done_rows, self.done_rows + rows, len(self.ids)
        n = self.n_cached + a  # the cache holds the earlier chunks
        mask = None if self.mask is None else self.mask[..., a:b, :self.n_cached + b]
        first_logit = max(a, s - self.n_logits)
        return Block(n, self.positions[a:b], mask), self.ids[a:b], range(first_logit - a, max(b - a, first_logit - a))


class StepBatcher:
    """Runs the forwards of several sequences as one forward per step (module docstring). Not thread-safe: one loop
    calls :meth:`step`.

    Args:
        model: the transformers causal LM (eval mode) every sequence decodes with.
        max_batch_tokens: most rows in one packed step (>= 1), and a step costs at most what that many rows cost
            at depth 0 (:mod:`redraft.pricing.stepcost`); a forward with more rows is chunked over steps.
        min_chunk: fewest rows of a chunk (>= 1; a step may exceed ``max_batch_tokens`` by up to this much).
    Attributes (read-only, for metrics): steps (forwards run), rows (rows carried by them), forward_seconds (wall
        seconds in them), last_step_rows, active (sequences of the last step still running after it), step_log
        (recent steps: per step a tuple of (sequence number, rows) per participant), step_seconds (the same steps'
        forward seconds), cost_fit (:class:`~redraft.pricing.stepcost.StepCostFit`).
    Raises:
        ValueError: max_batch_tokens < 1 or min_chunk < 1, or a model whose attention implementation has no mask
            function in transformers (:func:`redraft.runtimes.transformers.packing.enable_packed_attention`).
    """

    chunks_prefill = True  # a long prompt's prefill runs in chunks beside the other sequences' rows

    def __init__(self, model, *, max_batch_tokens: int = 512, min_chunk: int = 32) -> None:
        if max_batch_tokens < 1 or min_chunk < 1:
            raise ValueError(f"StepBatcher needs max_batch_tokens >= 1 and min_chunk >= 1; got {max_batch_tokens}, "
                             f"{min_chunk}")
        enable_packed_attention(model)  # the model's own attention, unchanged unless a forward is packed
        self.model = model
        self.cost_fit = StepCostFit(key_weight(model))  # from the FLOP count's weight to the host's, learned
        self.max_batch_tokens, self.min_chunk = int(max_batch_tokens), int(min_chunk)
        self.steps = self.rows = self.active = self.last_step_rows = 0
        self.forward_seconds = 0.0
        self.step_log: deque[tuple[tuple[int, int], ...]] = deque(maxlen=4096)
        self.step_seconds: deque[float] = deque(maxlen=4096)  # each logged step's forward, in step_log's order
        self._requests: dict[ForwardCall, _Request] = {}
        self._order = itertools.count()
        self._numbers: weakref.WeakKeyDictionary[HFTarget, int] = weakref.WeakKeyDictionary()
        self._next_number = itertools.count()

    @property
    def in_progress(self) -> int:
        """Forwards partly run (chunked over steps) and still held."""
        return len(self._requests)

    def new_target(self) -> HFTarget:
        """A new, empty target for one sequence, priced until its first step at the load the batcher carries now
        (``carried_rows``: the last step's rows + 1, or 1 when no sequence is running)."""
        t = HFTarget(self.model)
        t.carried_rows = self.last_step_rows + 1 if self.active else 1
        return t

    def number(self, target: HFTarget) -> int:
        """The sequence's number in ``step_log`` (given at its first step)."""
        if target not in self._numbers:
            self._numbers[target] = next(self._next_number)
        return self._numbers[target]

    def step(self, sequences: Seq[Sequence]) -> None:
        """One step: the next forward over the waiting calls of ``sequences`` (every running sequence: ended ones
        are skipped), then each sequence whose call is complete is resumed with its logits (it drafts and asks for
        its next forward, or ends). A forward that fails is raised inside every participant (:meth:`Sequence.fail`).
        A sequence that waits (:func:`~redraft.runtimes.sequence.wait_step`) is resumed after the forward.
        """
        live, waits = split_waits(sequences)
        self.active = self._step(live) if live else 0
        self.active += resume_waits(waits)

    def _step(self, live: list[Sequence]) -> int:
        """:meth:`step` over the sequences that asked for a forward; returns how many of them still run."""
        calls = {s.call: s for s in live}
        for call in [c for c in self._requests if c not in calls]:  # its sequence left (cancelled mid-chunk)
            del self._requests[call]
        for c in calls:
            if c not in self._requests:  # a new call: its progress is kept until its last chunk ran
                self._requests[c] = _Request(c, next(self._order))
        pending = [self._requests[c] for c in calls]
        work = self._plan(pending)
        try:
            self._run(work)
        except Exception as e:  # noqa: BLE001 - delivered to every participant; the loop keeps serving
            for req, _ in work:
                del self._requests[req.call]
                calls[req.call].fail(e)
        else:
            for req, _ in work:
                if req.rows_left == 0:
                    del self._requests[req.call]
                    calls[req.call].advance(req.logits())
        return sum(not s.done for s in live)

    def _plan(self, pending: list[_Request]) -> list[tuple[_Request, int]]:
        """The step as [(request, rows)]: a solo forward alone, a lone sequence whole, else :func:`plan_step`."""
        solo = next((r for r in pending if r.solo), None)
        if solo is not None:
            return [(solo, solo.rows_left)]
        if len(pending) == 1:  # the only sequence: nothing to chunk for, run it whole
            return [(pending[0], pending[0].rows_left)]
        fit = self.cost_fit
        step = plan_step(pending, fit.weight, fit.participant_rows, self.max_batch_tokens, self.min_chunk)
        placed = {id(r) for r, _ in step}
        for r in pending:
            r.skipped = 0 if id(r) in placed else r.skipped + 1
        return step

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
        """Run one step's forward; each participant's target gets its rows' KV entries, its logits rows go to
        ``pieces``, and its ``last_forward_plain`` and ``carried_rows`` are set."""
        total = sum(rows for _, rows in work)
        self.steps += 1
        self.rows += total
        self.last_step_rows = total
        self.step_log.append(tuple((self.number(req.target), rows) for req, rows in work))
        if len(work) == 1 and work[0][0].done_rows == 0 and work[0][1] == len(work[0][0].ids):
            req = work[0][0]  # alone and whole: plain decoding's own forward
            req.pieces = [req.call.run_alone()]
            req.done_rows = len(req.ids)
            req.target.last_forward_plain, req.target.carried_rows = True, 1
            return
        parts = [req.chunk(rows) for req, rows in work]
        owners = [req.target for req, _ in work]
        logits = packed_forward(self.model, [t.cache for t in owners], [p[0] for p in parts], [p[1] for p in parts],
                                [p[2] for p in parts], cache_kwarg=owners[0].cache_kwarg)
        for (req, rows), got in zip(work, logits, strict=True):
            req.target.length += rows
            req.done_rows += rows
            if len(got):
                req.pieces.append(got)
            req.target.last_forward_plain, req.target.carried_rows = False, total - rows + 1


def run_together(batcher: StepBatcher, steps: Seq[Steps], starts: Seq[int] | None = None) -> list[Sequence]:
    """Drive several step functions to their ends through ``batcher``, one step at a time (the smallest scheduler
    loop: benchmarks and tests); step function i starts once the batcher ran ``starts[i]`` steps of this run (or
    when nothing else runs). Returns the ended :class:`Sequence` objects (``result`` or ``error`` each)."""
    starts = list(starts) if starts is not None else [0] * len(steps)
    seqs = [Sequence(s) for s in steps]
    waiting = sorted(range(len(seqs)), key=lambda i: starts[i])
    running: list[Sequence] = []
    first = batcher.steps
    while waiting or running:
        while waiting and (starts[waiting[0]] <= batcher.steps - first or not running):
            running.append(seqs[waiting.pop(0)].start())
        batcher.step(running)
        running = [s for s in running if not s.done]
    return seqs


def plan_step(pending, weight: float, extra: float, max_batch_tokens: int, min_chunk: int) -> list:
    """Which waiting forwards a step carries, and how many rows of each (the module docstring's rules).

    Args:
        pending: the waiting forwards; each has ``rows_left``, ``n_cached`` + ``done_rows`` (its depth), ``order``
            (arrival) and ``skipped`` (steps planned since it last had a place).
        weight: w, a cached key's cost per row (:mod:`redraft.pricing.stepcost`).
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


