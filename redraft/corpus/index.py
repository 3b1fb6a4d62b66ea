"""Suffix-array index over one run of whole spans (one *segment* of a Corpus).

The index is a suffix array over the REVERSED symbol stream (see symbols.py), built with libdivsufsort through
pydivsufsort. Reversal turns "the context ends with these n ids" into "this suffix starts with the reversed
context tail", so the matches for every n = max_n..min_n are nested prefix ranges of ONE query: one binary
search plus the common-prefix length with the two neighbouring rows gives the longest n, and two galloping
searches give its row range.

Only useful suffixes are kept in the array: those that start with a token and whose occurrence has a non-empty
continuation (the symbol before it in the reversed stream is a token). So every row of a range is a valid
proposal and "the first n with a non-empty continuation" is simply "the longest n with a non-empty range".

"Most recent occurrence" = highest corpus position = smallest reversed offset = minimum suffix-array value over
the range. A sparse table over per-block minima (blocks of BLOCK rows) answers that in O(1) whatever the range
size: two partial blocks plus two table reads.

"Most recent occurrence with k ids of continuation" (best_occurrence) is what a self-overlapping suffix needs: inside
a run like 7 7 7 ... the most recent occurrence of "7 7 7" sits at the end of the run, one id before the span ends.
The most recent occurrence answers it in the common case; otherwise a small range is searched whole, and a large one
by a bounded search of the stream next to the most recent occurrence (where the rest of a run or period lies).
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np
from pydivsufsort import divsufsort

from .symbols import WIDTHS, reversed_symbols_to_spans, spans_to_reversed_symbols

BLOCK = 64  # rows per block of the range-minimum structure; a partial block costs ~1 us of Python min()
SMALL = 8192  # streams up to this many symbols are sorted in numpy: libdivsufsort costs ~2-15 ms per call
# (OpenMP start-up) whatever the size, which would dominate append() of one output
SAMPLE = 32  # every SAMPLE-th row's first 8 bytes are kept as a uint64 to narrow the binary search in C
SCAN_ROWS = 256  # ranges up to this many rows are searched whole by best_occurrence: one numpy gather of
# rows x k symbols (~30 us at k = 48); larger ranges are a stream search plus a sample of this many rows
SCAN_WINDOW = 1024  # symbols of stream searched after the most recent occurrence's span end (bytes.find, ~1 us):
# the rest of a run, or of a period up to this long, lies there


def sample_keys(rev: np.ndarray, sa: np.ndarray) -> np.ndarray:
    """First 8 bytes of every SAMPLE-th suffix, as big-endian integers (so integer order = suffix order).

    rev: reversed big-endian symbols [L]; sa: [M]. Returns uint64 [ceil(M / SAMPLE)]; bytes past the stream end
    read as 0, which sorts first like the end of a suffix does.
    """
    width = rev.dtype.itemsize
    per = 8 // width
    starts = sa[::SAMPLE].astype(np.int64)
    keys = np.zeros(len(starts), dtype=np.uint64)
    for j in range(per):
        idx = starts + j
        sym = rev[np.minimum(idx, len(rev) - 1)].astype(np.uint64)
        sym[idx >= len(rev)] = 0
        keys |= sym << np.uint64(8 * width * (per - 1 - j))
    return keys


def sparse_table(sa: np.ndarray) -> np.ndarray:
    """Range-minimum table over block minima of `sa`.

    sa: int32/int64 [M]. Returns the levels concatenated, same dtype: level j (j = 0, 1, ...) has
    nb - 2**j + 1 entries, entry b = min of sa over blocks b .. b + 2**j - 1, nb = ceil(M / BLOCK).
    """
    if len(sa) == 0:
        return sa[:0].copy()
    level = np.minimum.reduceat(sa, np.arange(0, len(sa), BLOCK))
    levels = [level]
    half = 1
    while 2 * half <= len(levels[0]):
        level = np.minimum(level[:-half], level[half:])
        levels.append(level)
        half *= 2
    return np.concatenate(levels)


def _level_views(table: np.ndarray, n_blocks: int) -> list[memoryview]:
    views, start, size = [], 0, n_blocks
    j = 0
    while size > 0 and start < len(table):
        views.append(_int_view(table[start:start + size]))
        start += size
        j += 1
        size = n_blocks - (1 << j) + 1
    return views


def build_suffix_array(rev: np.ndarray) -> np.ndarray:
    """Suffix array of the useful suffixes of a reversed symbol stream.

    rev: big-endian uint16/uint32 [L] (symbols, 0 = separator). Returns int32 (int64 when L >= 2**31) [M] offsets
    i into `rev`, sorted by suffix, keeping only i > 0 with rev[i] != 0 and rev[i-1] != 0 (see module doc).
    libdivsufsort sorts bytes; on big-endian symbols the byte order of suffixes starting at symbol boundaries
    equals their symbol order, so the symbol suffix array is the byte one restricted to multiples of the width.
    """
    if len(rev) == 0:
        return np.zeros(0, dtype=np.int32)
    if len(rev) <= SMALL:
        sa = prefix_doubling_sa(rev)
    else:
        width = rev.dtype.itemsize
        raw = divsufsort(np.ascontiguousarray(rev).view(np.uint8))
        sa = raw[(raw & (width - 1)) == 0]
        del raw
        sa >>= width.bit_length() - 1
    raw_syms = rev.view(rev.dtype.newbyteorder("="))  # byte-swapped values, but zero is still zero
    keep = sa > 0
    keep &= raw_syms[sa] != 0
    keep &= raw_syms[sa - 1] != 0  # sa - 1 = -1 where sa == 0 wraps harmlessly: already dropped by `sa > 0`
    sa = sa[keep]
    return sa.astype(np.int32 if len(rev) < 2**31 else np.int64, copy=False)


def prefix_doubling_sa(sym: np.ndarray) -> np.ndarray:
    """Suffix array of a short symbol array by prefix doubling (Manber-Myers ranks, numpy lexsort per round).

    sym: integer [n]. Returns int64 [n]; a suffix that ends sorts before its extensions, as in libdivsufsort.
    O(n log n) per round, rounds = log2 of the longest repeat; meant for n <= SMALL.
    """
    n = len(sym)
    rank = sym.astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[:n - k] = rank[k:]
        sa = np.lexsort((second, rank))
        r1, r2 = rank[sa], second[sa]
        new = np.empty(n, dtype=np.int64)
        new[0] = 0
        np.cumsum((r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1]), out=new[1:])
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = new
        if new[-1] == n - 1 or k >= n:
            return sa
        k *= 2


@dataclass
class Match:
    """Where one segment matches a query: `n` symbols, rows [lo, hi) of its suffix array."""

    n: int
    lo: int
    hi: int


class SuffixIndex:
    """Immutable index over whole spans: reversed symbol stream + filtered suffix array + range-minimum table.

    stream: bytes-like (bytes or mmap) holding the reversed big-endian symbols at byte `offset`, L * width bytes.
    sa: int32/int64 [M] (see build_suffix_array); table: sparse_table(sa); samples: sample_keys(stream, sa).
    Arrays may be views of a mmap.
    """

    def __init__(self, stream, offset: int, length: int, width: int, sa: np.ndarray, table: np.ndarray,
                 samples: np.ndarray, n_tokens: int, n_spans: int, max_id: int):
        self.buf = stream
        self.off = offset
        self.length = length  # symbols, separators included
        self.width = width
        self.sym_dtype = WIDTHS[width][0]
        self.max_token = WIDTHS[width][2]
        self.rev = np.frombuffer(stream, dtype=self.sym_dtype, count=length, offset=offset)
        self.sa = sa
        self.table = table
        self.n_tokens = n_tokens
        self.n_spans = n_spans
        self.max_id = max_id
        self.samples = samples
        self._packers: dict[int, struct.Struct] = {}
        self._sa_mv = _int_view(sa)
        self._samples_mv = np.ascontiguousarray(samples).view(np.uint8).data.cast("Q")
        self._levels = _level_views(table, -(-len(sa) // BLOCK))

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def build(cls, tokens: np.ndarray, offsets: np.ndarray, width: int) -> SuffixIndex:
        """Index spans given as tokens int64 [n_tokens] (ids >= 0) and offsets int64 [n_spans + 1] (non-empty)."""
        rev = spans_to_reversed_symbols(tokens, offsets, width)
        sa = build_suffix_array(rev)
        table = sparse_table(sa)
        samples = sample_keys(rev, sa)
        max_id = int(tokens.max()) if len(tokens) else -1
        return cls(rev.tobytes(), 0, len(rev), width, sa, table, samples, len(tokens), len(offsets) - 1, max_id)

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [n_tokens], offsets int64 [n_spans + 1]) of this segment, oldest span first."""
        return reversed_symbols_to_spans(self.rev)

    def nbytes(self) -> int:
        """Resident bytes of stream + suffix array + table."""
        return self.length * self.width + self.sa.nbytes + self.table.nbytes + self.samples.nbytes

    # ---- queries --------------------------------------------------------------------------------------------
    def encode(self, rev_tail) -> bytes:
        """Query bytes for a reversed context tail (newest id first; a list of ints or an int array); stops at the
        first id this width can't hold. Long tails are packed in numpy (a Python loop costs ~0.1 us per id)."""
        if len(rev_tail) > 64:
            arr = np.asarray(rev_tail, dtype=np.int64)
            bad = (arr < 0) | (arr > self.max_token)
            if bad.any():
                arr = arr[:int(np.argmax(bad))]
            return (arr + 1).astype(self.sym_dtype).tobytes()
        if isinstance(rev_tail, np.ndarray):
            rev_tail = rev_tail.tolist()
        n = len(rev_tail)
        if n and (min(rev_tail) < 0 or max(rev_tail) > self.max_token):
            n = 0
            for t in rev_tail:
                if t < 0 or t > self.max_token:
                    break
                n += 1
        packer = self._packers.get(n)
        if packer is None:
            packer = self._packers[n] = struct.Struct(f">{n}{WIDTHS[self.width][1]}")
        return packer.pack(*[t + 1 for t in rev_tail[:n]])

    def longest(self, q: bytes, min_n: int) -> Match | None:
        """Longest prefix of `q` (>= min_n symbols) that starts some kept suffix; its row range. None if none."""
        sa, buf, off, w = self._sa_mv, self.buf, self.off, self.width
        if len(sa) == 0 or len(q) < min_n * w:
            return None
        ql = len(q)

        def key(i: int) -> bytes:
            return buf[off + i * w: off + i * w + ql]

        # Sampled 8-byte prefixes bound the insertion point to one window of SAMPLE rows (bisect in C on ints),
        # then the exact search runs inside it.
        samples = self._samples_mv
        pad = 8 * (8 - min(ql, 8))
        lo_key = int.from_bytes(q[:8], "big") << pad
        hi_key = lo_key | ((1 << pad) - 1)
        a = bisect_left(samples, lo_key)
        b = a if (a == len(samples) or samples[a] > hi_key) else bisect_right(samples, hi_key, a)
        r = bisect_left(sa, q, max(0, (a - 1) * SAMPLE + 1), min(len(sa), b * SAMPLE), key=key)
        # The longest common prefix with any row is reached at one of the two rows around the insertion point.
        best, anchor = 0, -1
        if r < len(sa):
            best, anchor = _common_symbols(key(sa[r]), q, w), r
        if best * w < ql and r > 0:
            n = _common_symbols(key(sa[r - 1]), q, w)
            if n > best:
                best, anchor = n, r - 1
        if best < min_n:
            return None
        lo, hi = self.range_of(q[:best * w], anchor)
        return Match(best, lo, hi)

    def range_of(self, qn: bytes, anchor: int) -> tuple[int, int]:
        """Rows [lo, hi) whose suffix starts with `qn`, given one such row `anchor`. Galloping: O(log range)."""
        sa, buf, off, w, ql = self._sa_mv, self.buf, self.off, self.width, len(qn)

        def key(i: int) -> bytes:
            return buf[off + i * w: off + i * w + ql]

        step, inner = 1, anchor
        while True:
            probe = anchor - step
            if probe < 0:
                lo = bisect_left(sa, qn, 0, inner, key=key)
                break
            if key(sa[probe]) != qn:
                lo = inner if probe + 1 == inner else bisect_left(sa, qn, probe + 1, inner, key=key)
                break
            inner, step = probe, step * 2
        step, inner = 1, anchor + 1
        while True:
            probe = anchor + step
            if probe >= len(sa):
                hi = bisect_right(sa, qn, inner, len(sa), key=key)
                break
            if key(sa[probe]) != qn:
                hi = inner if inner == probe else bisect_right(sa, qn, inner, probe, key=key)
                break
            inner, step = probe + 1, step * 2
        return lo, hi

    def min_offset(self, lo: int, hi: int) -> int:
        """min(sa[lo:hi]) (hi > lo): the reversed offset of the most recent occurrence in the range. O(1)."""
        sa = self._sa_mv
        b_lo, b_hi = -(-lo // BLOCK), hi // BLOCK  # full blocks [b_lo, b_hi)
        if b_hi - b_lo <= 0:
            return min(sa[lo:hi])
        best = min(sa[lo:b_lo * BLOCK]) if lo < b_lo * BLOCK else 1 << 62
        if b_hi * BLOCK < hi:
            best = min(best, min(sa[b_hi * BLOCK:hi]))
        j = (b_hi - b_lo).bit_length() - 1
        level = self._levels[j]
        return min(best, level[b_lo], level[b_hi - (1 << j)])

    def best_occurrence(self, lo: int, hi: int, k: int, qn: bytes | None = None) -> tuple[int, int]:
        """The occurrence to draft from among rows [lo, hi) (hi > lo): (reversed offset, ids of continuation <= k).

        Rule: the most recent occurrence with k ids of continuation (never across a separator or the corpus end);
        when none has k, the one with the longest continuation, most recent first. Colibri's rule (the most recent
        occurrence) is kept whenever it already yields k ids. Exact for ranges of <= SCAN_ROWS rows, and, when qn
        (the query bytes whose occurrences are exactly these rows) is given, whenever the answer lies within
        SCAN_WINDOW symbols of the most recent occurrence's span end (runs and short periods); otherwise the best
        of SCAN_ROWS rows sampled evenly across the range. k >= 1. Cost: O(k) when the most recent occurrence
        yields k ids, at most O(SCAN_ROWS * k + SCAN_WINDOW).
        """
        i0 = self.min_offset(lo, hi)
        run = len(self.continuation(i0, k))
        if run >= k:
            return i0, run
        if hi - lo <= SCAN_ROWS:
            return self._best_of(np.asarray(self.sa[lo:hi], dtype=np.int64), k)
        if qn is not None:
            i = self._search_after(i0, run, qn, k)
            if i is not None:
                return i, k
        rows = lo + (np.arange(SCAN_ROWS, dtype=np.int64) * (hi - lo)) // SCAN_ROWS
        return self._best_of(np.concatenate(([i0], np.asarray(self.sa[rows], dtype=np.int64))), k)

    def aligned_rows(self, q_run: bytes, q_more: bytes, min_n: int) -> tuple[int, list[tuple[int, int]]]:
        """Occurrences aligned with a periodic run at the end of the context: (alignment, row intervals).

        q_run: query bytes (encode()) of the context's whole periodic tail run, newest id first, r symbols;
        q_more: the same run extended by one more period-consistent id (r + 1 symbols). An occurrence preceded in
        the corpus by exactly r ids of the run sits where the context does inside it (in a replay: the same
        place); those rows are range(q_run) minus range(q_more), at most two intervals. Where the corpus has no
        run that long, the rows of the longest part of q_run it has. alignment = 2 * matched symbols, + 1 for
        exactly r: a larger value is better aligned. Returns (0, []) when not even min_n symbols match.
        """
        m = self.longest(q_run, min_n)
        if m is None:
            return 0, []
        if m.n * self.width == len(q_run) and len(q_more) > len(q_run):
            longer = self.longest(q_more, m.n + 1)
            if longer is None:
                return 2 * m.n + 1, [(m.lo, m.hi)]
            exact = [(a, b) for a, b in ((m.lo, longer.lo), (longer.hi, m.hi)) if b > a]
            if exact:
                return 2 * m.n + 1, exact
        return 2 * m.n, [(m.lo, m.hi)]

    def holds(self, ids: np.ndarray) -> bool:
        """Whether ids (int [n], n >= 1, each >= 0) occur contiguously inside one span of this segment.

        An occurrence ending a span has no continuation, so its own suffix is not kept; the suffix one id earlier
        is (ids[-1] follows it). So: one binary search for ids[:-1] matched whole (the lookup's search), then a
        gather over its rows for ids[-1]. O(log n) comparisons + O(rows of ids[:-1]); a one-id query scans the
        stream (O(n)).
        """
        last = int(ids[-1]) + 1
        if last - 1 > self.max_token:
            return False
        if len(ids) == 1:
            return bool((self.rev == last).any())
        q = self.encode(np.asarray(ids[-2::-1], dtype=np.int64).tolist())
        m = self.longest(q, len(ids) - 1)
        if m is None:
            return False
        offs = np.asarray(self.sa[m.lo:m.hi], dtype=np.int64)
        return bool((self.rev[offs - 1] == last).any())

    def _best_of(self, offsets: np.ndarray, k: int) -> tuple[int, int]:
        runs = (self.continuations(offsets, k) >= 0).sum(axis=1)
        j = np.lexsort((offsets, -runs))[0]  # longest continuation (capped at k), then most recent
        return int(offsets[j]), int(runs[j])

    def _search_after(self, i0: int, run: int, qn: bytes, k: int) -> int | None:
        """Smallest offset >= i0 - run + k (every offset below it reaches a separator within k ids) inside the
        next SCAN_WINDOW symbols where `qn` occurs with k ids of continuation, or None."""
        w, off = self.width, self.off
        t = i0 - run + k
        start = off + t * w
        end = off + min(self.length, t + SCAN_WINDOW + len(qn) // w) * w
        while start < end:
            pos = self.buf.find(qn, start, end)
            if pos < 0:
                return None
            if (pos - off) % w:  # a match straddling two symbols
                start = pos + 1
                continue
            i = (pos - off) // w
            run = len(self.continuation(i, k))
            if run >= k:
                return i
            start = off + (i - run + k) * w
        return None

    def continuation(self, i: int, k: int) -> np.ndarray:
        """Up to k ids following the occurrence at reversed offset i, stopping at a separator. int64 [<= k]."""
        start = max(0, i - k)
        syms = struct.unpack_from(f">{i - start}{WIDTHS[self.width][1]}", self.buf, self.off + start * self.width)
        out = []
        for s in reversed(syms):
            if s == 0:
                break
            out.append(s - 1)
        return np.array(out, dtype=np.int64)

    def continuations(self, offsets: np.ndarray, k: int) -> np.ndarray:
        """Continuations of many occurrences as int64 [len(offsets), k], padded with -1 after a stop."""
        idx = offsets[:, None] - 1 - np.arange(k)[None, :]
        syms = self.rev[np.maximum(idx, 0)].astype(np.int64)
        syms[idx < 0] = 0
        alive = np.cumprod(syms != 0, axis=1, dtype=np.int8).astype(bool)
        return np.where(alive, syms - 1, -1)

    def position(self, i: int) -> int:
        """Stream position (separators counted, oldest first) of the occurrence at reversed offset i."""
        return self.length - 1 - i


def _int_view(arr: np.ndarray) -> memoryview:
    """Native int memoryview of an int32/int64 array (fast scalar indexing; numpy may label it '<i')."""
    if arr.dtype.itemsize not in (4, 8):
        raise ValueError(f"expected an int32 or int64 array, got {arr.dtype}")
    return np.ascontiguousarray(arr).view(np.uint8).data.cast("i" if arr.dtype.itemsize == 4 else "q")


def _common_symbols(a: bytes, b: bytes, w: int) -> int:
    """Number of leading whole symbols (w bytes each) that a and b share."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return (n - (x.bit_length() + 7) // 8) // w
