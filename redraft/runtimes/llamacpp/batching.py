"""Continuous batching on llama.cpp: one ``llama_decode`` per step over every running sequence's rows.

The llama.cpp counterpart of :class:`redraft.runtimes.transformers.batching.StepBatcher`, with the same interface for a scheduler
loop (``new_target``, ``step``, ``max_batch_tokens``, ``steps``, ``rows``): every running request is a sequence id
of one llama.cpp context (:meth:`LlamaCppTarget.view`), and a step is one multi-sequence batch
(:func:`redraft.runtimes.llamacpp.target.decode_together`), as llama.cpp's own server batches its slots. llama.cpp runs
such a batch in one pass per run of consecutive sequence ids with equal row counts (its per-stream split), so ids are
handed out lowest first and laid out in order; a step whose sequences feed different row counts (a decode beside a
verify) still takes several passes over the weights.

- The context keeps one KV stream per sequence (``kv_unified`` off), so each sequence's cells lie in position order
  as in a context of its own; on a batch-invariant build (``make llama``) every row is then computed bit for bit
  as that sequence alone computes it, whatever else the batch carries (tests/runtimes/test_llama_batching.py checks
  it against plain decoding on a context of one sequence).
- A step takes the waiting forwards smallest first while their rows fit ``max_batch_tokens`` (at most ``n_batch``);
  a forward that waited a step goes first in the next, and one with more rows than fit (a long prompt) runs alone
  in its own ``n_batch`` pieces. No chunking beside others: llama.cpp's attention over a prompt chunk is the
  prompt's own, but a lone forward keeps plain decoding's prompt batches.
- A forward asked for under :meth:`~redraft.runtimes.transformers.target.Target.solo` (exact mode's recomputes) and a lone
  sequence run alone, in plain decoding's shape.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence as Seq

from redraft.runtimes.llamacpp.target import LlamaCppTarget, decode_together
from redraft.runtimes.sequence import ForwardCall, Sequence, resume_waits, split_waits


class LlamaStepBatcher:
    """Runs the forwards of up to ``target.n_seq_max`` sequences as one ``llama_decode`` per step (module docstring).
    Not thread-safe: one loop calls :meth:`step`.

    Args:
        target: a :class:`LlamaCppTarget` made with ``n_seq_max`` > 1 (its context holds the sequences).
        max_batch_tokens: most rows in one step (default and at most the context's ``n_batch``).
    Attributes (read-only, for metrics): steps (forwards run), rows (rows carried by them), packed_steps (steps
        that carried several sequences), forward_seconds, last_step_rows, active (sequences of the last step still
        running after it), free (sequence ids not in use).
    Raises:
        ValueError: a target with one sequence, or max_batch_tokens < 1.
    """

    chunks_prefill = False  # a prompt longer than a step runs alone, in its own n_batch batches

    def __init__(self, target: LlamaCppTarget, max_batch_tokens: int | None = None) -> None:
        if target.n_seq_max < 2:
            raise ValueError("LlamaStepBatcher needs a llama.cpp context of several sequences (n_seq_max > 1)")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.target = target
        self.max_batch_tokens = min(int(max_batch_tokens or target.n_batch), target.n_batch)
        self.free = list(range(target.n_seq_max))  # a heap: the lowest free id first
        self.steps = self.rows = self.active = self.last_step_rows = self.packed_steps = 0
        self.forward_seconds = 0.0
        self._waited: dict[ForwardCall, int] = {}

    @property
    def in_progress(self) -> int:
        """Forwards waiting for a place in a step."""
        return len(self._waited)

    def new_target(self) -> LlamaCppTarget:
        """An empty sequence of the context for one request, the lowest free id (running sequences then keep
        consecutive ids, which llama.cpp runs in fewer passes); :meth:`LlamaCppTarget.release` hands it back.

        Raises:
            RuntimeError: every sequence is in use (the scheduler runs at most ``n_seq_max`` requests).
        """
        if not self.free:
            raise RuntimeError(f"all {self.target.n_seq_max} llama.cpp sequences are in use")
        t = self.target.view(heapq.heappop(self.free), on_release=lambda seq: heapq.heappush(self.free, seq))
        t.carried_rows = self.last_step_rows + 1 if self.active else 1
        return t

    def step(self, sequences: Seq[Sequence]) -> None:
        """One step: one ``llama_decode`` over the waiting calls that fit (see the module docstring), then each of
        those sequences is resumed with its logits. A forward that fails is raised inside every participant. A
        sequence that waits (:func:`~redraft.runtimes.sequence.wait_step`) is resumed after the decode."""
        live, waits = split_waits(sequences)
        self.active = (self._step(live) if live else 0) + resume_waits(waits)

    def _step(self, live: list[Sequence]) -> int:
        """:meth:`step` over the sequences that asked for a forward; returns how many of them still run."""
        for call in [c for c in self._waited if all(s.call is not c for s in live)]:
            del self._waited[call]  # its sequence left
        group = self._plan(live)
        rows = sum(len(s.call.ids) for s in group)
        self.steps += 1
        self.packed_steps += len(group) > 1
        self.rows += rows
        self.last_step_rows = rows
        t0 = time.perf_counter()
        try:
            if len(group) == 1:
                logits = [group[0].call.run_alone()]
            else:
                logits = decode_together([(s.call.target, s.call.ids, s.call.n_logits) for s in group])
        except Exception as e:  # noqa: BLE001 - delivered to every participant; the loop keeps serving
            self.forward_seconds += time.perf_counter() - t0
            for s in group:
                s.fail(e)
        else:
            self.forward_seconds += time.perf_counter() - t0  # the forward's own time, not the sequences' drafting
            for s, got in zip(group, logits, strict=True):
                s.call.target.last_forward_plain = len(group) == 1
                s.call.target.carried_rows = rows - len(s.call.ids) + 1
                s.advance(got)
        return sum(not s.done for s in live)

    def _plan(self, live: list[Sequence]) -> list[Sequence]:
        """The sequences whose forwards this step runs: a solo forward alone; else those that waited first, then the
        smallest, while the rows fit; a forward too large for a step runs alone."""
        solo = next((s for s in live if s.call.solo), None)
        if solo is not None:
            return [solo]
        order = sorted(live, key=lambda s: (-self._waited.get(s.call, 0), len(s.call.ids)))
        group: list[Sequence] = []
        rows = 0
        for s in order:
            n = len(s.call.ids)
            if not group and n > self.max_batch_tokens:
                group = [s]
                break
            if rows + n <= self.max_batch_tokens:
                group.append(s)
                rows += n
        for s in live:
            if s in group:
                self._waited.pop(s.call, None)
            else:
                self._waited[s.call] = self._waited.get(s.call, 0) + 1
        return group
