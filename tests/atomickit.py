"""Helpers for tests of atomic writes: a disk that fills up mid-write, and the temporary files a failed write must
not leave (tests/io/test_atomic.py and the writers covered beside their features)."""

from __future__ import annotations

import errno
import os
import pathlib

from redraft.corpus import format as corpus_format


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def fail_midway(monkeypatch):
    """Make ``Path.write_text`` write half of its text, then fail as a full disk would."""
    real = pathlib.Path.write_text

    def half(self, data, *args, **kwargs):
        real(self, data[:len(data) // 2], *args, **kwargs)
        raise disk_full()

    monkeypatch.setattr(pathlib.Path, "write_text", half)


def leftovers(directory) -> list[str]:
    """Names in ``directory`` that look like temporary files of an atomic write."""
    return sorted(n for n in os.listdir(directory) if ".tmp" in n)


class FailingFile:
    """A file object whose writes fail once ``budget`` bytes were written (a disk filling up mid-write)."""

    def __init__(self, f, budget: int, error) -> None:
        self.f, self.budget, self.error = f, budget, error

    def write(self, data):
        if len(data) > self.budget:
            self.f.write(data[:self.budget])
            raise self.error()
        self.budget -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_corpus_writes(monkeypatch, budget: int = 40, error=disk_full) -> None:
    """Corpus files opened for writing by redraft.corpus.format raise ``error()`` after ``budget`` bytes."""
    def failing_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FailingFile(f, budget, error) if any(c in mode for c in "wa") else f

    monkeypatch.setattr(corpus_format, "open", failing_open, raising=False)
