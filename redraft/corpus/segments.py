"""One writer's journal in a shared tenant directory: its identity file and its segments (numpy only).

Writer W appends to ``journal-W.rdj``. Once a generation has folded at least ``ROTATE_SHARE`` of it into the base
(all of it, unless the writer appended while that compaction ran), it goes on in a new segment ``journal-W.N.rdj``
and closes the old one. The old one is then a journal whose writer is gone and that nobody appends to: the next
compaction folds what is left of it and removes it (:func:`redraft.corpus.compaction.remove_folded`). So a live
writer's journals hold at most what the last two compactions have not both folded, instead of everything since the
process started. Each segment has its ``journal-W[.N].json`` identity (:mod:`redraft.corpus.directory`).

The writer does not remove its closed segment itself: another process may still be on the generation before (its
base and the closed segment's records past that generation's folded bytes are its snapshot) and reads the files by
name and byte offset. A closed segment only stops growing, so a follower reads each of its records once, whichever
generation it is on; the compaction that folds the rest of it commits its generation before removing the file, so
a follower that finds it gone reads that generation, which holds all of it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import numpy as np

from redraft.io.atomic import atomic_path

from .journal import JournalWriter
from .lease import host_name

ROTATE_SHARE = 0.5  # a new segment once a generation folded at least this share of the current one


class WriterJournal:
    """The journal segment writer ``writer`` appends to in tenant directory ``directory``.

    Args:
        directory: the tenant directory (must exist).
        writer: the writer id (:func:`redraft.corpus.lease.writer_id`).
        sync: fsync each record (:class:`~redraft.corpus.journal.JournalWriter`).
        identity: extra fields of the identity file (fingerprint, vocab_size).
    Attributes:
        name: the current segment's file name; segment: its number (0 for ``journal-W.rdj``).
    Raises:
        OSError: the identity file or the segment cannot be written (also BlockingIOError: another writer holds it).
    """

    def __init__(self, directory: str, writer: str, *, sync: bool = True, identity: dict | None = None) -> None:
        self.directory, self.writer, self.sync = directory, writer, sync
        self.identity = dict(identity or {})
        self.segment = 0
        self._file = self._start()

    @property
    def name(self) -> str:
        return f"journal-{self.writer}.rdj" if self.segment == 0 else f"journal-{self.writer}.{self.segment}.rdj"

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @property
    def identity_path(self) -> str:
        return self.path[:-len(".rdj")] + ".json"

    @property
    def size(self) -> int:
        """Bytes in the current segment."""
        return self._file.size

    def append(self, span: Sequence[int] | np.ndarray) -> None:
        """One record into the current segment (:meth:`JournalWriter.append`; raises OSError)."""
        self._file.append(span)

    def due(self, folded: dict[str, int], share: float = ROTATE_SHARE) -> bool:
        """Whether a generation's ``folded`` offsets cover at least ``share`` of the current, non-empty segment."""
        done = folded.get(self.name, 0)
        return self._file.size > 0 and done > 0 and done >= share * self._file.size

    def rotate(self, folded: dict[str, int], share: float = ROTATE_SHARE) -> str | None:
        """When :meth:`due`: start the next segment and close this one (its records past ``folded`` stay for the next
        compaction). Returns the closed segment's path (None: nothing to do). The caller must not append meanwhile.
        Raises OSError when the next segment cannot be written (the current one stays in use)."""
        if not self.due(folded, share):
            return None
        old, old_path = self._file, self.path
        self.segment += 1
        try:
            self._file = self._start()
        except OSError:
            self.segment -= 1
            raise
        old.close()
        return old_path

    def close(self) -> None:
        """Close the current segment; remove it and its identity file when it holds nothing."""
        empty = self._file.size == 0
        self._file.close()
        if empty:
            for path in (self.path, self.identity_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _start(self) -> JournalWriter:
        with atomic_path(self.identity_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"writer": self.writer, "host": host_name(), "pid": os.getpid(), "started": time.time(),
                       "segment": self.segment, **self.identity}, f)
        return JournalWriter(self.path, sync=self.sync, owned=True)


__all__ = ["ROTATE_SHARE", "WriterJournal"]
