"""Append-only journal of corpus spans: one checksummed record per span, replayed at start (numpy only).

A server that learns from its own answers appends each finished generation (prompt ids + output ids) here before
the response completes, so a crash loses at most the generations still in flight. Record layout, little-endian:

    4 bytes   magic b"RDJ\\x01"
    uint32    n, the number of ids (1 .. MAX_RECORD_IDS)
    uint32    zlib.crc32 of the n field followed by the payload
    n uint32  the ids

Replay never refuses a journal: a torn tail (a record cut short by a crash) and corrupt records (bad magic, bad
checksum, ids outside the vocabulary) are skipped with one warning line each; after a corrupt record the reader
resynchronises on the next magic whose record checks out, so one flipped byte costs one span, not the rest of
the file. The design is the classic write-ahead log (e.g. SQLite's WAL frames and LevelDB's log records carry a
checksum per record for the same reason).
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from redraft.io.atomic import atomic_path, fsync_dir, temporary_name

MAGIC = b"RDJ\x01"
_HEAD = struct.Struct("<4sII")  # magic, n ids, crc32
_COUNT = struct.Struct("<I")
MAX_RECORD_IDS = 1 << 26  # a larger count can only be a damaged length field


def encode_record(span: Sequence[int] | np.ndarray) -> bytes:
    """The journal bytes of one span (ids int, 0 <= id < 2**32). Raises ValueError for an empty span."""
    ids = np.asarray(span, dtype=np.int64).reshape(-1)
    if len(ids) == 0:
        raise ValueError("a journal record needs at least one id")
    if ids.min() < 0 or ids.max() > 0xFFFFFFFF:
        raise ValueError("journal ids must be in [0, 2**32)")
    payload = ids.astype("<u4").tobytes()
    count = _COUNT.pack(len(ids))
    return MAGIC + count + _COUNT.pack(zlib.crc32(payload, zlib.crc32(count))) + payload


@dataclass
class Replay:
    """What a journal holds.

    Attributes:
        spans: valid records in file order, each int64 [n].
        end: byte offset just after the last valid record.
        problems: one line per skipped region (byte offset, length, why); empty for a clean journal.
        skipped_bytes: bytes that belonged to no valid record.
        torn: bytes of a record cut short at the very end (0: none). In a journal a live writer still appends to,
            that is a record being written: :func:`read_tail` stops before it and reads it once complete.
    """

    spans: list[np.ndarray] = field(default_factory=list)
    end: int = 0
    problems: list[str] = field(default_factory=list)
    skipped_bytes: int = 0
    torn: int = 0


def scan(data: bytes, *, vocab_size: int | None = None, where: str = "journal") -> Replay:
    """Parse journal bytes into valid spans, skipping damage (see the module doc). Never raises on content."""
    out = Replay()
    view = memoryview(data)
    pos, size = 0, len(data)
    while pos < size:
        why, n = _check_record(view, pos, size, vocab_size)
        if why is None:
            out.spans.append(np.frombuffer(view[pos + _HEAD.size:pos + _HEAD.size + 4 * n], dtype="<u4")
                             .astype(np.int64))
            pos += _HEAD.size + 4 * n
            out.end = pos
            continue
        # resynchronise: the next magic whose record checks out
        nxt = data.find(MAGIC, pos + 1)
        while nxt >= 0 and _check_record(view, nxt, size, vocab_size)[0] is not None:
            nxt = data.find(MAGIC, nxt + 1)
        stop = size if nxt < 0 else nxt
        kind = "torn tail" if nxt < 0 and why == "cut short" else "corrupt record"
        if kind == "torn tail":
            out.torn = stop - pos
        out.problems.append(f"{where}: {kind} at byte {pos} ({stop - pos} bytes, {why}) skipped")
        out.skipped_bytes += stop - pos
        pos = stop
    return out


def _check_record(view: memoryview, pos: int, size: int, vocab_size: int | None) -> tuple[str | None, int]:
    """(None, n) for a valid record at pos, else (why it is not, 0)."""
    if size - pos < _HEAD.size:
        return "cut short", 0
    magic, n, crc = _HEAD.unpack_from(view, pos)
    if magic != MAGIC:
        return "bad magic", 0
    if not 0 < n <= MAX_RECORD_IDS:
        return f"bad length {n}", 0
    end = pos + _HEAD.size + 4 * n
    if end > size:
        return "cut short", 0
    payload = view[pos + _HEAD.size:end]
    if zlib.crc32(payload, zlib.crc32(view[pos + 4:pos + 8])) != crc:
        return "checksum mismatch", 0
    if vocab_size is not None:
        top = int(np.frombuffer(payload, dtype="<u4").max())
        if top >= vocab_size:
            return f"id {top} outside the vocabulary ({vocab_size})", 0
    return None, n


def read_journal(path, *, vocab_size: int | None = None) -> Replay:
    """Replay a journal file; a missing file is an empty journal. Raises OSError only if it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Replay()
    return scan(data, vocab_size=vocab_size, where=os.fspath(path))


def read_tail(path, offset: int, *, vocab_size: int | None = None) -> Replay:
    """The records of a journal from byte ``offset`` on (a follower's read of another writer's journal).
    ``end`` and the problems' byte positions count from the file's start; a record cut short at the end is left
    for the next read (``end`` stops before it, its problem line is dropped), damage before it is skipped and
    reported once, since ``end`` moves past it. A missing file reads as no new records. Raises OSError only if
    it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return Replay(end=offset)
    out = scan(data, vocab_size=vocab_size, where=os.fspath(path))
    if out.torn:
        out.problems.pop()
        out.skipped_bytes -= out.torn
    out.end = offset + len(data) - out.torn
    out.problems = [_shift(p, offset) for p in out.problems]
    return out


def _shift(problem: str, offset: int) -> str:
    head, _, rest = problem.partition(" at byte ")
    n, _, tail = rest.partition(" ")
    return f"{head} at byte {int(n) + offset} {tail}" if n.isdigit() else problem


def write_journal(path, spans: Sequence[Sequence[int] | np.ndarray]) -> None:
    """Write a whole journal atomically (:func:`redraft.io.atomic.atomic_path`: a temporary file, fsync, rename,
    fsync of the directory). Raises OSError; ``path`` is then unchanged."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for s in spans:
            f.write(encode_record(s))


class JournalWriter:
    """Appends records to a journal file.

    Args:
        path: the journal file (created if missing).
        sync: fsync after each record (a crash then loses no appended span); False leaves it to the OS (a
            crash of the process loses nothing, a power cut may lose the last seconds).
        owned: hold an exclusive ``flock`` on the file while it is open, so other processes can tell the writer
            is alive (:func:`has_live_writer`; the kernel releases it when the process dies, ``kill -9`` included).
            A new owned journal is made under a temporary name, locked, then linked to ``path``, so no process ever
            sees it without its writer's lock (a compaction would take it for a dead writer's, empty journal).
    Raises:
        OSError: the file cannot be opened; BlockingIOError when ``owned`` and another writer holds it.
    """

    def __init__(self, path, *, sync: bool = True, owned: bool = False) -> None:
        self.path = os.fspath(path)
        self.sync = sync
        created = not os.path.exists(self.path)
        f = _open_locked_new(self.path) if owned and created else None
        if f is None:
            f = open(self.path, "ab", buffering=0)
            if owned:
                _lock_or_close(f)
        self._f = f
        self.size = f.seek(0, os.SEEK_END)
        if created:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def append(self, span: Sequence[int] | np.ndarray) -> None:
        """Write one record (and fsync when ``sync``). On an OSError the file is cut back to its previous size,
        so a failed write never leaves a torn record in the middle of the journal, and the error is raised."""
        rec = encode_record(span)
        try:
            written = 0
            while written < len(rec):
                written += self._f.write(rec[written:])
            if self.sync:
                os.fsync(self._f.fileno())
        except OSError:
            try:
                os.ftruncate(self._f.fileno(), self.size)
            except OSError:
                pass
            raise
        self.size += len(rec)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _lock_or_close(f) -> None:
    """Take ``f``'s exclusive ``flock`` without waiting; on failure close ``f`` and raise (BlockingIOError: held)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise


def _open_locked_new(path: str):
    """A new journal at ``path``, already locked when it appears there (None: ``path`` appeared meanwhile, open it
    as an existing one). Raises OSError."""
    tmp = os.fspath(temporary_name(path))
    f = open(tmp, "xb", buffering=0)
    try:
        _lock_or_close(f)
        os.link(tmp, path)
    except FileExistsError:
        f.close()
        return None
    except OSError:
        f.close()
        raise
    finally:
        os.unlink(tmp)
    return f


def has_live_writer(path) -> bool:
    """Whether a process holds ``path`` open as an owned :class:`JournalWriter` (its ``flock``). A missing file
    has none. On a shared volume this needs locks the filesystem carries between hosts (NFSv4 does)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False
