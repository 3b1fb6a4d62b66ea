"""Corpus files: the text format of Colibri's COLI_DRAFT_CORPUS and redraft's mmap-able binary format.

Text: whitespace-separated integer token ids, -1 between spans (one span = one earlier output). Empty spans
(repeated, leading or trailing -1) carry nothing and are dropped. Any such layout is read; redraft writes one:
one span per line and a ``-1`` line between spans, only ever appending (:func:`append_text`), so a growing corpus
is never rewritten and an interrupted writer leaves every earlier span intact.

Binary (version 2), little-endian:
    0   8 bytes   magic b"RDCORPUS"
    8   uint32    format version
    12  uint32    header length H
    16  uint32    CRC-32 (zlib.crc32) of the H header bytes
    20  H bytes   JSON header: token_width, length (symbols incl. separators), n_tokens, n_spans, max_id,
                  vocab_size, fingerprint, block, sample, arrays {name: {offset, dtype, count, crc32}}
    then the arrays, each at a 64-byte aligned absolute offset, each with the CRC-32 of its bytes in the header:
        sa      filtered suffix array, int32/int64 [M]          (index.build_suffix_array)
        table   range-minimum table over its blocks, same dtype (index.sparse_table)
        samples uint64 8-byte prefixes of every 32nd suffix     (index.sample_keys)
        stream  reversed big-endian symbols (id + 1, 0 = separator), uint16 or uint32 [length]
    The stream is last and the file ends exactly where it ends: suffix comparisons slice the map past a suffix's
    end and must get a short slice (as with bytes), never the bytes of another array.
Opening checks every checksum, then maps the file and wraps the arrays in place: nothing is rebuilt. The check
reads the whole file once (zlib.crc32, ~2.3 GB/s here: 0.34 s warm, 0.41 s cold for the ~750 MB of a 10^8-token
corpus); damage anywhere in the header or an array is refused with the section named. Version 1 files (no
checksums; a 16-byte prefix without the header CRC) are still read, with a warning to rewrite them once with
`redraft corpus compact FILE`. Files are written to a temporary name and renamed: a reader never sees half a file.

The format is detected by content (the magic bytes), never by file name. This module reads and writes arrays and
index segments; :func:`redraft.corpus.corpus.load_corpus` turns a file into a :class:`~redraft.corpus.Corpus`.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import sys
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from redraft.io.atomic import atomic_path

from .errors import CorpusError
from .index import BLOCK, SAMPLE, SuffixIndex

MAGIC = b"RDCORPUS"
VERSION = 2
ALIGN = 64
_PREFIX = struct.Struct("<8sIII")  # magic, version, header length, header CRC-32
_PREFIX_V1 = struct.Struct("<8sII")  # version 1: no header CRC, no array CRCs
SECTIONS = {"sa": "suffix array", "table": "range-minimum table", "samples": "search samples",
            "stream": "token stream"}
_CRC_CHUNK = 1 << 24  # bytes read per step while checking a section
_TEXT_CHARS = b"0123456789- \t\n\r\x0b\x0c"
_INT = re.compile(rb"-?[0-9]+")
_CHUNK = 1 << 23  # bytes of text parsed per step


# ---- detection --------------------------------------------------------------------------------------------------
def sniff(path) -> str:
    """'binary' if the file starts with the magic, else 'text'. Raises CorpusError if it can't be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e
    # A file shorter than the magic but starting like it is a truncated binary, not text.
    return "binary" if head and MAGIC.startswith(head) else "text"


def read_text(path, *, vocab_size: int | None = None, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Parse a text corpus: (tokens int64 [n_tokens], offsets int64 [n_spans + 1]), empty spans dropped.

    Raises CorpusError naming path, line, the token / id and its 0-based position among all ids of the file
    (separators counted).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e
    if b"\0" in raw[:4096]:
        raise CorpusError(f"{path}: bad magic {raw[:8]!r}: not a redraft binary corpus (expected {MAGIC!r}) "
                          f"and not a text corpus (contains NUL bytes)")
    ids = _parse_ids(raw, path, progress)
    bad = np.flatnonzero((ids < -1) | ((ids >= vocab_size) if vocab_size is not None else False))
    if len(bad):
        pos = int(bad[0])
        value = int(ids[pos])
        line = _line_of_position(raw, pos)
        why = (f"is out of range (vocab size {vocab_size})" if value >= 0
               else "is negative (only -1, the span separator, may be)")
        raise CorpusError(f"{path}:{line}: id {value} at position {pos} {why}")
    return split_spans(ids)


def split_spans(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids int64 [n] with -1 separators -> (tokens int64 [n_tokens], offsets int64 [n_spans + 1]), empty spans
    dropped."""
    seps = np.flatnonzero(ids == -1)
    tokens = ids[ids != -1] if len(seps) else ids
    cuts = seps - np.arange(len(seps))  # tokens before each separator
    offsets = np.unique(np.concatenate(([0], cuts, [len(tokens)]))).astype(np.int64)
    if len(tokens) == 0:
        offsets = np.zeros(1, dtype=np.int64)
    return tokens.astype(np.int64, copy=False), offsets


def _parse_ids(raw: bytes, path: str, progress: bool) -> np.ndarray:
    chunks = []
    start = 0
    bar = _bar(len(raw), progress, f"parsing {os.path.basename(path)}")
    while start < len(raw):
        end = raw.find(b"\n", min(start + _CHUNK, len(raw)))
        end = len(raw) if end < 0 else end + 1
        piece = raw[start:end]
        toks = piece.split()
        try:
            if piece.translate(None, _TEXT_CHARS):
                raise ValueError
            chunks.append(np.fromiter(map(int, toks), dtype=np.int64, count=len(toks)))
        except (ValueError, OverflowError):
            _raise_bad_token(raw, path)
        if bar is not None:
            bar.update(end - start)
        start = end
    if bar is not None:
        bar.close()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)


def _raise_bad_token(raw: bytes, path: str) -> None:
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        for tok in line.split():
            if not _INT.fullmatch(tok) or abs(int(tok)) >= 2**62:
                shown = tok[:40].decode("utf-8", "replace") + ("..." if len(tok) > 40 else "")
                what = "is out of range" if _INT.fullmatch(tok) else "is not an integer"
                raise CorpusError(f"{path}:{lineno}: token {shown!r} {what} "
                                  f"(expected whitespace-separated token ids, -1 between spans)")
    raise CorpusError(f"{path}: unreadable token")  # unreachable: the fast path found one


def _line_of_position(raw: bytes, pos: int) -> int:
    seen = 0
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        seen += len(line.split())
        if seen > pos:
            return lineno
    return lineno


def append_text(path, spans: Iterable[Sequence[int] | np.ndarray]) -> int:
    """Append spans to a text corpus (created if missing): one span per line, a ``-1`` line between spans.

    The one text writer (freeze, the corpus tools, ``Corpus.save``): costs O(new ids), never rewrites the file.
    Only the file's last bytes are read, to know whether a separator and a newline are needed. Empty spans are
    skipped (they would carry nothing).

    Args:
        path: the text corpus file.
        spans: token-id sequences or integer arrays [n], ids >= 0.
    Returns:
        the number of spans written.
    Raises:
        CorpusError: a negative id (it would read back as a separator or a bad token), or an OSError (the
            message names the file).
    """
    path = os.fspath(path)
    try:
        need_sep, need_newline = _tail_state(path)
        n = 0
        with open(path, "a", encoding="ascii") as f:
            if need_newline:
                f.write("\n")  # never glue a new id onto the file's last id
            for span in spans:
                ids = np.asarray(span, dtype=np.int64).reshape(-1)
                if len(ids) == 0:
                    continue
                if int(ids.min()) < 0:
                    raise CorpusError(f"{path}: cannot write id {int(ids.min())}: span ids must be >= 0")
                if need_sep:
                    f.write("-1\n")
                f.write(" ".join(map(str, ids.tolist())) + "\n")
                need_sep = True
                n += 1
    except OSError as e:
        raise CorpusError(f"{path}: cannot write corpus ({e.strerror or e})") from e
    return n


def write_text(path, spans: Iterable[Sequence[int] | np.ndarray]) -> int:
    """Write spans as a new text corpus replacing ``path``, in :func:`append_text`'s layout.

    Atomic (:func:`redraft.io.atomic.atomic_path`): the spans are appended to a temporary file next to ``path``,
    which is then renamed over it. Returns the number of spans written. Raises CorpusError as :func:`append_text`.
    """
    try:
        with atomic_path(path) as tmp:
            open(tmp, "w").close()
            n = append_text(tmp, spans)
        return n
    except OSError as e:
        raise CorpusError(f"{path}: cannot write corpus ({e.strerror or e})") from e


def _tail_state(path: str) -> tuple[bool, bool]:
    """(needs a -1 line before the next span, needs a newline first) for an existing text corpus, or a new one."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return False, False
    if size == 0:
        return False, False
    with open(path, "rb") as f:
        n = 64
        while True:  # read back until the last word is whole (or the file's start)
            f.seek(max(0, size - n))
            tail = f.read()
            words = tail.split()
            if n >= size or (words and len(words[-1]) < len(tail.rstrip())):
                break
            n *= 4
    return bool(words) and words[-1] != b"-1", not tail.endswith((b"\n", b"\r"))


# ---- binary -----------------------------------------------------------------------------------------------------

def _write_atomic(path, write) -> None:
    """Call write(binary file) on a temporary file next to `path` and rename it over `path`
    (:func:`redraft.io.atomic.atomic_path`). Any failure (an OSError, which becomes CorpusError, or an interruption)
    removes the temporary file and leaves `path` as it was."""
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            write(f)
    except OSError as e:
        raise CorpusError(f"{path}: cannot write corpus ({e.strerror or e})") from e
# ---- binary -----------------------------------------------------------------------------------------------------
def write_binary(path, seg: SuffixIndex | None, *, vocab_size: int | None, fingerprint: str | None) -> None:
    """Write one index segment (None = an empty corpus) in the binary format, version 2 (with CRC-32s), with the
    vocabulary size and the tokenizer fingerprint it records.

    Atomic (temporary file + rename). Raises CorpusError on an OSError.
    """
    stream = np.asarray(seg.rev) if seg else np.zeros(0, dtype=">u2")
    sa = seg.sa if seg else np.zeros(0, dtype=np.int32)
    table = seg.table if seg else np.zeros(0, dtype=np.int32)
    samples = seg.samples if seg else np.zeros(0, dtype=np.uint64)
    arrays = {"sa": np.asarray(sa), "table": np.asarray(table), "samples": np.asarray(samples), "stream": stream}
    raw = {name: np.ascontiguousarray(arr).view(np.uint8) for name, arr in arrays.items()}
    header: dict[str, Any] = {
        "token_width": seg.width if seg else 2,
        "length": seg.length if seg else 0,
        "n_tokens": seg.n_tokens if seg else 0,
        "n_spans": seg.n_spans if seg else 0,
        "max_id": seg.max_id if seg else -1,
        "vocab_size": vocab_size,
        "fingerprint": fingerprint,
        "block": BLOCK,
        "sample": SAMPLE,
        "arrays": {name: {"crc32": zlib.crc32(raw[name].data)} for name in arrays},
    }
    # Offsets depend on the header length, which depends on the offsets' digits: size it with a generous guess.
    guess = len(json.dumps(header)) + 400
    pos = end = _align(_PREFIX.size + guess)
    for name, arr in arrays.items():
        header["arrays"][name].update(offset=pos, dtype=arr.dtype.str, count=int(len(arr)))
        end = pos + arr.nbytes
        pos = _align(end)
    blob = json.dumps(header).encode()
    assert len(blob) <= guess

    def write(f):
        f.write(_PREFIX.pack(MAGIC, VERSION, len(blob), zlib.crc32(blob)))
        f.write(blob)
        for name in arrays:
            f.seek(header["arrays"][name]["offset"])
            f.write(raw[name])
        f.truncate(end)  # no trailing padding: losing any byte of the file is detectable

    _write_atomic(path, write)


def read_binary(path, *, vocab_size: int | None = None, fingerprint: str | None = None,
                force: bool = False) -> tuple[SuffixIndex | None, int | None, str | None]:
    """Map a binary corpus after checking it: (its index segment or None when empty, recorded vocab size, recorded
    fingerprint).

    Raises CorpusError naming the file for truncation, bad magic, unknown version, a malformed header, a damaged
    section (header or array whose CRC-32 does not match: the section is named), ids >= vocab_size or a
    fingerprint mismatch (unless force). A version 1 file (no checksums) is read with a warning on stderr.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e
    version, header, arrays = _read_layout(path, mm, size)
    width, length = int(header["token_width"]), int(header["length"])
    n_tokens, n_spans, max_id = int(header["n_tokens"]), int(header["n_spans"]), int(header["max_id"])
    file_vocab, file_fp = header.get("vocab_size"), header.get("fingerprint")
    if vocab_size is not None and max_id >= vocab_size:
        raise CorpusError(f"{path}: id {max_id} is out of range (vocab size {vocab_size}; "
                          f"corpus vocab size {file_vocab})")
    if fingerprint is not None and file_fp is not None and fingerprint != file_fp and not force:
        raise CorpusError(f"{path}: tokenizer fingerprint mismatch: corpus was made with {file_fp}, "
                          f"current tokenizer is {fingerprint} (force=True / --force to use it anyway)")
    if version == 1:
        print(f"redraft: warning: {path}: binary corpus version 1 has no checksums, so damage to it goes "
              f"unnoticed; rewrite it once with `redraft corpus compact {path}`", file=sys.stderr)
    else:
        check_sections(path, arrays)
    if not n_tokens:
        return None, file_vocab, file_fp
    sa, table, samples = (np.frombuffer(mm, dtype=arrays[name][0], count=arrays[name][1], offset=arrays[name][2])
                          for name in ("sa", "table", "samples"))
    seg = SuffixIndex(mm, arrays["stream"][2], length, width, sa, table, samples, n_tokens, n_spans, max_id)
    return seg, file_vocab, file_fp


def _read_layout(path: str, mm, size: int) -> tuple[int, dict, dict]:
    """(version, header, {array name: (dtype, count, offset, crc32 or None)}) after the structural checks and the
    header checksum. Raises CorpusError."""
    if size < _PREFIX_V1.size:
        raise CorpusError(f"{path}: truncated binary corpus ({size} bytes, header needs {_PREFIX.size})")
    magic, version, hlen = _PREFIX_V1.unpack_from(mm, 0)
    if magic != MAGIC:
        raise CorpusError(f"{path}: bad magic {magic!r} (expected {MAGIC!r})")
    if version not in (1, VERSION):
        raise CorpusError(f"{path}: unknown binary corpus version {version} (this redraft reads versions 1 and "
                          f"{VERSION})")
    start = _PREFIX_V1.size if version == 1 else _PREFIX.size
    if size < start + hlen:
        raise CorpusError(f"{path}: truncated binary corpus (header of {hlen} bytes, file has {size})")
    blob = bytes(mm[start:start + hlen])
    try:
        header = json.loads(blob)
        width = int(header["token_width"])
        int(header["length"]), int(header["n_tokens"]), int(header["n_spans"]), int(header["max_id"])
        arrays = {}
        for name in SECTIONS:
            spec = header["arrays"][name]
            dtype, count, offset = np.dtype(spec["dtype"]), int(spec["count"]), int(spec["offset"])
            arrays[name] = (dtype, count, offset, int(spec["crc32"]) if version > 1 else None)
    except (ValueError, KeyError, TypeError) as e:
        raise CorpusError(f"{path}: malformed binary corpus header ({e})") from e
    if version > 1 and zlib.crc32(blob) != _PREFIX.unpack_from(mm, 0)[3]:
        raise CorpusError(f"{path}: damaged binary corpus: the header (bytes 0-{start + hlen}) fails its checksum; "
                          f"rebuild the corpus from its sources or restore a copy")
    if (width not in (2, 4) or header.get("block") != BLOCK or header.get("sample") != SAMPLE
            or arrays["stream"][0].itemsize != width):
        raise CorpusError(f"{path}: unsupported binary corpus layout (width {width}, block {header.get('block')})")
    for name, (dtype, count, offset, _) in arrays.items():
        if offset < start + hlen or offset + dtype.itemsize * count > size:
            raise CorpusError(f"{path}: truncated binary corpus ({name} needs bytes {offset} to "
                              f"{offset + dtype.itemsize * count}, file has {size})")
    _, s_count, s_off, _ = arrays["stream"]
    if s_count != int(header["length"]) or s_off + s_count * width != size:
        raise CorpusError(f"{path}: bad binary corpus layout (the token stream must end the file: it ends at "
                          f"{s_off + s_count * width}, the file at {size})")
    return version, header, arrays


def binary_version(path) -> int:
    """Format version of a binary corpus file (1 or 2). Raises CorpusError if it is not a readable binary corpus."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_PREFIX_V1.size)
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e
    if len(head) < _PREFIX_V1.size or head[:len(MAGIC)] != MAGIC:
        raise CorpusError(f"{path}: not a redraft binary corpus")
    return _PREFIX_V1.unpack(head)[1]


def check_sections(path: str, arrays: dict) -> None:
    """Compare each array's CRC-32 with the header's, reading the file (not the map: no resident pages are added).

    arrays: as returned by the layout check, {name: (dtype, count, offset, crc32)}. Raises CorpusError naming the
    file and the first damaged section.
    """
    buf = bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            for name, (dtype, count, offset, want) in arrays.items():
                crc, left = 0, dtype.itemsize * count
                f.seek(offset)
                while left:
                    got = f.readinto(view[:min(left, _CRC_CHUNK)])
                    if not got:
                        break
                    crc = zlib.crc32(view[:got], crc)
                    left -= got
                if left or crc != want:
                    raise CorpusError(
                        f"{path}: damaged binary corpus: the {SECTIONS[name]} section (bytes {offset}-"
                        f"{offset + dtype.itemsize * count}) fails its checksum; rebuild the corpus from its sources "
                        f"or restore a copy")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read corpus file ({e.strerror or e})") from e


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False, delay=1.0, disable=None)
