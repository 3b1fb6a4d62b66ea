"""Atomic file writes: a file redraft writes is complete or absent, never half-written.

Every writer (corpus files and journals, bench results and plots, cost curves, GliDe checkpoints and training
data, demo / oracle JSON, self-written questions) writes to a temporary file next to the target and renames it over
the target once the write returned: ``os.replace`` within one directory is atomic on POSIX, so a reader (or a later
``--resume``) sees the old file or the new one. The data is fsynced before the rename and the directory after it, so
the new file also survives a crash of the machine. A write that fails or is interrupted removes its temporary file
and leaves the old target untouched.

A leaf module: standard library only (no numpy, no torch, nothing else of redraft), so that the numpy-only
:mod:`redraft.corpus` package writes its files through it too.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_serial = itertools.count()
TEMPORARY = re.compile(r"\..*\.tmp-\d+-\d+(\.[^.]*)?")


def temporary_name(path: str | os.PathLike) -> Path:
    """A hidden temporary path next to ``path`` with the same suffix (``savefig`` picks the format from it),
    unique within this process: ``dir/.NAME.tmp-PID-N.SUFFIX``."""
    p = Path(path)
    return p.with_name(f".{p.stem}.tmp-{os.getpid()}-{next(_serial)}{p.suffix}")


def is_temporary_name(name: str) -> bool:
    """True for a file name :func:`temporary_name` makes (a leftover of an interrupted process, safe to remove)."""
    return TEMPORARY.fullmatch(name) is not None


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or file creation in ``directory`` durable (a no-op where directories cannot be opened or
    synced, as on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to; on a clean exit it is flushed to disk and renamed
    over ``path``, on any exception (KeyboardInterrupt included) it is removed and the exception propagates.

    Use it for writers that take a file name (``safetensors.save_file``, ``Figure.savefig``)::

        with atomic_path(out / "plot.png") as tmp:
            fig.savefig(tmp)

    Raises:
        OSError: the temporary file could not be written, synced or renamed (``path`` is then unchanged); its
            ``filename`` is ``path``, not the temporary name, so a message names the file the user asked for.
    """
    tmp = temporary_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(tmp.parent)  # the rename itself is on disk
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (str(tmp), tmp):
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns ``path`` as a Path. Raises OSError."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON (plus a final newline) to ``path`` atomically; returns ``path`` as a Path.

    Raises:
        OSError: as :func:`write_text`.
        TypeError, ValueError: ``obj`` is not JSON-serialisable (nothing is written).
    """
    return write_text(path, json.dumps(obj, indent=indent) + "\n")
