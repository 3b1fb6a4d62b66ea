"""A ``llama_batch``'s slots and a decode's output rows, as the llama.cpp target fills and reads them (ctypes only).

Right after a decode the weights it streamed have evicted the caches, so every object touched costs a memory
access: these helpers touch fewest (one ``memmove`` for a copy, none for a view).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


def copy_rows(out: torch.Tensor, at: int, ptr, n: int) -> None:
    """Copy ``n`` rows of float32 logits from llama.cpp's output buffer ``ptr`` (``llama_get_logits``) into rows
    ``at..at + n`` of ``out`` ([R, vocab], float32, contiguous): one ``memmove``, no intermediate array (against
    numpy's ``as_array(...).copy()`` and ``torch.from_numpy``: ~40 us a step less on the 2-core development CPU)."""
    width = out.shape[1] * out.element_size()
    ctypes.memmove(out.data_ptr() + at * width, ptr, n * width)


def lent_rows(ptr, n: int, vocab: int) -> torch.Tensor:
    """FloatTensor [n, vocab] (float32) viewing llama.cpp's output buffer ``ptr`` (the batch's output rows in
    order): no copy; valid until the context's next decode."""
    rows = (ctypes.c_float * (n * vocab)).from_address(ctypes.addressof(ptr.contents))
    return torch.frombuffer(rows, dtype=torch.float32).view(n, vocab)


def put_tokens(batch, at: int, seq: int, pos: int, ids: Sequence[int], first_logit: int) -> int:
    """Write ``ids`` into ``batch`` (a ``llama_batch``) from slot ``at`` under sequence id ``seq`` at positions
    ``pos, pos + 1, ...``, with an output row from the ``first_logit``-th of them on; returns the next free slot."""
    for i, tok in enumerate(ids):
        batch.token[at + i] = int(tok)
        batch.pos[at + i] = pos + i
        batch.n_seq_id[at + i] = 1
        batch.seq_id[at + i][0] = seq
        batch.logits[at + i] = i >= first_logit
    return at + len(ids)
