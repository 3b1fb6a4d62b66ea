"""What every target runtime implements: the narrow interface the decode loop, exact mode and the step loop use
(:class:`Target`), and the KV entries of a sequence's first tokens that start another sequence (:class:`PrefixKV`).

A new runtime is a folder beside :mod:`redraft.runtimes.transformers` and :mod:`redraft.runtimes.llamacpp` with a
class implementing :class:`Target`; :func:`redraft.compose.runtime.load_target` picks one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixKV:
    """The target's KV entries for the first tokens of a sequence, to start another sequence that begins with them.

    Attributes:
        ids: the tokens the entries belong to (length n).
        kv: per decoder layer, (keys, values): FloatTensors [1, H_kv, n, D] in the model dtype, keys after the
            rotary encoding (as :meth:`HFTarget.verified_kv` returns them). Never written in place: a target
            seeded with them (:meth:`HFTarget.seed`) shares them and never writes into them, so one entry can seed
            any number of sequences.
        origin: where the entries came from: "memory" (this process computed them) or "disk" (an entry written
            by this or another process, :mod:`redraft.runtimes.prefix_store`).

    The entries were computed by whatever forwards built them (a prefill over an earlier prompt, verify forwards),
    so their rows differ from plain decoding's by rounding: the engine treats rows computed on them as it treats
    verify rows in exact mode.
    """

    ids: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    origin: str = "memory"

    @property
    def length(self) -> int:
        return len(self.ids)


class Target:
    """The interface every target implements (the engine, exact mode and the step loop use nothing else):
    ``reset``, ``forward``, ``crop``, ``keep``, ``seed``, ``snapshot``, ``solo``, ``release`` and ``verified_kv`` as
    :class:`HFTarget` documents them, and the attributes ``length``, ``vocab_size``, ``max_length``, ``dtype``,
    ``numerics`` (the key of the runtime's measured noise in ``defaults.EXACT_ROW_NOISE``/``EXACT_GAP_NOISE``),
    ``chain_only`` (True: the engine verifies chains only), ``last_forward_plain``, ``carried_rows`` and
    ``solo_depth``, and ``runtime`` (its name). :class:`HFTarget` is transformers; :class:`redraft.runtimes.llamacpp.target.LlamaCppTarget` is llama.cpp.
    """

    runtime = "transformers"
    last_forward_plain = True
    carried_rows = 1
    solo_depth = 0

    def release(self) -> None:
        """The sequence ended: free its KV entries at once (a prefix-cache entry keeps its own views)."""
        self.cache = None
        self.length = 0

    @contextlib.contextmanager
    def solo(self):
        """A context in which every forward asked for runs in plain decoding's shape, this sequence's rows alone
        (:class:`redraft.runtimes.sequence.ForwardCall` ``solo``: a step batcher never packs or chunks it)."""
        self.solo_depth += 1
        try:
            yield self
        finally:
            self.solo_depth -= 1
