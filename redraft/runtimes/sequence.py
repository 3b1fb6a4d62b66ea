"""A sequence that advances one target forward at a time: the unit a scheduler loop drives.

Decoding code never calls a target's forward directly on the decode path: it *asks* for the forward and waits for
its logits, as a generator does::

    logits = yield from forward(target, ids, positions, mask, n_logits)

The generator (a *step function*: :meth:`redraft.decoding.engine.Engine.steps`, a server request) yields one
:class:`ForwardCall` per forward and is resumed with that forward's logits. Whoever drives it decides how the forward
runs: :func:`drive` runs each call as :meth:`HFTarget.forward` on its own target (one sequence, bit for bit what a
direct call computes), and a step loop packs the calls of every running sequence into one forward per step
(:class:`redraft.runtimes.transformers.batching.StepBatcher`). Iteration-level scheduling as in vLLM and SGLang, with the
sequence's state (context, KV cache, drafters, exact mode, statistics) held by its suspended generator: no thread
per sequence.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from redraft.runtimes.transformers.target import HFTarget

T = TypeVar("T")
Steps = Generator["ForwardCall", torch.Tensor, T]  # a step function's type: yields calls, gets logits, returns T


@dataclass(eq=False)
class ForwardCall:
    """One target forward a sequence waits for (the arguments of :meth:`HFTarget.forward`).

    Attributes:
        target: the sequence's target (its KV cache holds ``n_cached`` tokens; the forward appends ``ids``).
        ids: S >= 1 token ids; none (S = 0) for a *wait*: the sequence asks for no forward, only to be resumed
            after the step (:func:`wait_step`).
        positions: LongTensor [1, S] or None (consecutive positions after the cache).
        mask: additive FloatTensor [1, 1, S, n_cached + S] or None (plain causal attention).
        n_logits: trailing rows that need logits.
        solo: must run alone, in plain decoding's shape (asked under :meth:`HFTarget.solo`).
        borrow: the caller reads the logits before it asks for its next forward and keeps no reference past it, so
            a target that can lend its own output buffer (``lends_logits``: llama.cpp) returns a view of it instead
            of a copy (a replay's 128 rows of Gemma 3's 262,144 logits are 134 MB to copy, ~10% of its forward).
        n_cached: the target's cached tokens when the call was made.
    """

    target: HFTarget
    ids: list[int]
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    n_logits: int = 1
    solo: bool = False
    borrow: bool = False
    n_cached: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_cached = self.target.length

    def run_alone(self) -> torch.Tensor:
        """Run this call as its target's own ``forward`` (:meth:`HFTarget.forward`); FloatTensor [n_logits, V] on the
        CPU. A wait runs nothing: FloatTensor [0, 0]."""
        if not self.ids:
            return NO_LOGITS
        if self.borrow and getattr(self.target, "lends_logits", False):
            return self.target.forward(self.ids, self.positions, self.mask, self.n_logits, borrow=True)
        return self.target.forward(self.ids, self.positions, self.mask, self.n_logits)

    @property
    def is_wait(self) -> bool:
        """No forward asked for: resume the sequence after the step (:func:`wait_step`)."""
        return not self.ids


NO_LOGITS = torch.empty(0, 0)  # what a wait is resumed with


def forward(target: HFTarget, ids: list[int], positions: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, n_logits: int = 1, *, borrow: bool = False) -> Steps[torch.Tensor]:
    """Ask for one forward of ``target`` (``yield from`` it in a step function): the logits it returns, as
    :meth:`HFTarget.forward` returns them, once the driver ran it; ``borrow``: they are read before the next forward
    and not kept (:attr:`ForwardCall.borrow`: possibly a view of the target's own buffer)."""
    if target.cache is None:
        target.reset()
    logits = yield ForwardCall(target, [int(t) for t in ids], positions, mask, int(n_logits), target.solo_depth > 0,
                               bool(borrow))
    return logits


def wait_step(target: HFTarget) -> Steps[None]:
    """Ask for no forward, only to be resumed after the next step (``yield from`` it in a step function): a sequence
    waiting for work another sequence does for it (a prompt prefix they share, being computed once). A driver
    never runs anything for it; a lone sequence (:func:`drive`) is resumed at once."""
    yield ForwardCall(target, [], n_logits=0)


def split_waits(sequences) -> tuple[list[Sequence], list[Sequence]]:
    """The running sequences of a step (ended ones and those without a call left out), as (those asking for a
    forward, those waiting: :attr:`ForwardCall.is_wait`). A batcher runs the first and then resumes the second
    with :func:`resume_waits`."""
    live = [s for s in sequences if not s.done and s.call is not None]
    return [s for s in live if not s.call.is_wait], [s for s in live if s.call.is_wait]


def resume_waits(waits) -> int:
    """Resume each waiting sequence after the step (with no logits); returns how many still run."""
    for s in waits:
        s.advance(NO_LOGITS)
    return sum(not s.done for s in waits)


def drive(steps: Steps[T]) -> T:
    """Run a step function to its end, each forward alone on its own target (:meth:`ForwardCall.run_alone`); returns
    what it returns. Exceptions from the forwards are raised inside the step function, as a direct call raises."""
    try:
        call = next(steps)
        while True:
            try:
                logits = call.run_alone()
            except Exception as e:  # noqa: BLE001 - raised where the step function asked for the forward
                call = steps.throw(e)
            else:
                call = steps.send(logits)
    except StopIteration as done:
        return done.value


class Sequence:
    """A step function being driven: the forward it waits for, and its result or error once it ended.

    Args:
        steps: the step function (a generator of :class:`ForwardCall`).
    Attributes:
        call: the forward it waits for (None once it ended).
        result: what the step function returned (once ``done`` and no ``error``).
        error: the exception it ended with, or None.
        done: it ended (returned or raised).
    """

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps
        self.call: ForwardCall | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False

    def start(self) -> Sequence:
        """Run it to its first forward (or its end)."""
        self._resume(lambda: next(self.steps))
        return self

    def advance(self, logits: torch.Tensor) -> None:
        """Hand the waited-for forward's logits back and run it to its next forward (or its end)."""
        self._resume(lambda: self.steps.send(logits))

    def fail(self, error: BaseException) -> None:
        """Raise ``error`` where it waits (its forward failed, or it was cancelled); it may catch it and go on."""
        self._resume(lambda: self.steps.throw(error))

    def close(self) -> None:
        """End it where it waits (GeneratorExit inside: its ``finally`` blocks run)."""
        if not self.done:
            self.steps.close()
            self.done, self.call = True, None

    def _resume(self, step) -> None:
        if self.done:
            return
        try:
            self.call = step()
        except StopIteration as end:
            self.done, self.call, self.result = True, None, end.value
        except Exception as e:  # noqa: BLE001 - kept for the driver: one sequence's failure is not the loop's
            self.done, self.call, self.error = True, None, e
