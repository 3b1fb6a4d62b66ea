"""A llama.cpp sequence's KV state as bytes, and back (``llama_state_seq_get_data`` / ``set_data``): what the prefix
cache writes to disk for the llama.cpp target (:mod:`redraft.runtimes.prefix_store`), as llama.cpp's server saves and
restores a slot.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from redraft.runtimes.base import PrefixKV
from redraft.runtimes.llamacpp.lib import LlamaCppError


class SequenceState:
    """Save and load methods of :class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget` (a mixin: it uses the
    target's context, memory, sequence id, ``ids``, ``length``, ``reset`` and ``max_length``)."""

    def save_state(self) -> bytes:
        """This sequence's KV state as llama.cpp serialises it (``llama_state_seq_get_data``): the cells of its
        ``length`` tokens. Raises LlamaCppError when llama.cpp copies nothing."""
        self._check_live()
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, self.seq))
        buf = (ctypes.c_uint8 * size)()
        got = int(lib.llama_state_seq_get_data(self._ctx, buf, size, self.seq)) if size else 0
        if got == 0:
            raise LlamaCppError(f"llama.cpp saved no state for a sequence of {self.length} tokens")
        return bytes(buf)[:got]

    def load_state(self, ids: Sequence[int], state: bytes) -> PrefixKV:
        """Replace this sequence's cache with a state :meth:`save_state` wrote for ``ids`` (in a process with the
        same :func:`redraft.runtimes.fingerprint.kv_fingerprint`); returns the :class:`PrefixKV` naming them, for :meth:`seed`.

        Raises:
            LlamaCppError: llama.cpp refused the state (another model or layout); the sequence is then empty.
        """
        self.reset()
        ids = [int(t) for t in ids]
        if len(ids) >= self.max_length:
            raise LlamaCppError(f"a saved state of {len(ids)} tokens does not fit n_ctx={self.max_length}")
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(self._lib.llama_state_seq_set_data(self._ctx, buf, len(state), self.seq)) == 0:
            self.reset()
            raise LlamaCppError("llama.cpp refused a saved sequence state")
        held = int(self._lib.llama_memory_seq_pos_max(self._mem, self.seq)) + 1
        if held != len(ids):
            self.reset()
            raise LlamaCppError(f"a saved sequence state holds {held} positions, its entry names {len(ids)} tokens")
        self.ids, self.length = ids, len(ids)
        return PrefixKV(tuple(ids), (), origin="disk")
