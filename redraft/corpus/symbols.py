"""Token ids <-> index symbols.

The suffix index works on *symbols*: symbol = token id + 1, and symbol 0 is the span separator. Symbols are stored
big-endian so that byte-wise comparison (what `bytes` comparison and libdivsufsort do) equals comparison by id.
Because the separator is 0 and a query never contains it, no match can run across a span boundary.
"""

from __future__ import annotations

import numpy as np

# Symbol width in bytes -> (big-endian numpy dtype, struct code, largest token id it can hold).
WIDTHS: dict[int, tuple[np.dtype, str, int]] = {
    2: (np.dtype(">u2"), "H", 0xFFFF - 1),
    4: (np.dtype(">u4"), "I", 0xFFFFFFFF - 1),
}


def width_for(max_id: int, vocab_size: int | None) -> int:
    """Symbol width in bytes (2 or 4) able to hold every id below `vocab_size` (or up to `max_id` if unknown)."""
    top = (vocab_size - 1) if vocab_size is not None else max_id
    return 2 if top <= WIDTHS[2][2] else 4


def spans_to_reversed_symbols(tokens: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """Lay spans out as one symbol stream with a 0 between spans, then reverse it.

    tokens: integer [n_tokens] ids >= 0; offsets: int64 [n_spans + 1] span starts into `tokens` (non-empty spans).
    Returns the reversed stream, big-endian uint16/uint32 [n_tokens + n_spans - 1].
    """
    n_spans = len(offsets) - 1
    length = len(tokens) + max(n_spans - 1, 0)
    dtype = WIDTHS[width][0]
    stream = np.zeros(length, dtype=dtype.newbyteorder("="))
    if n_spans > 1:
        # Span s starts s separators further right in the stream than in `tokens`.
        is_token = np.ones(length, dtype=bool)
        is_token[offsets[1:-1] + np.arange(n_spans - 1)] = False
        stream[is_token] = tokens.astype(stream.dtype) + 1
    elif length:
        stream[:] = tokens.astype(stream.dtype) + 1
    return stream[::-1].astype(dtype)


def reversed_symbols_to_spans(rev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `spans_to_reversed_symbols`: returns (tokens int64 [n_tokens], offsets int64 [n_spans + 1])."""
    stream = rev[::-1].astype(np.int64)
    seps = np.flatnonzero(stream == 0)
    tokens = stream[stream != 0] - 1
    offsets = np.concatenate(([0], seps - np.arange(len(seps)), [len(tokens)])).astype(np.int64)
    return tokens, np.unique(offsets) if len(tokens) else np.zeros(1, dtype=np.int64)
