"""Folding a shared corpus directory into its next generation (numpy only): the one writer holding the compaction
lock (:mod:`redraft.corpus.lease`) reads the current generation's base and every journal as the files hold them,
writes the next base, commits the generation file, then removes what the new generation no longer needs.

Reading the files rather than the folding process's memory is what keeps many writers exact: a span another writer
appended is in its journal (fsynced before that writer's response completed), so it is either folded (below the
journal's new folded offset) or read past it; none is lost or stored twice. Layout: :mod:`redraft.corpus.directory`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection

import numpy as np

from redraft.io.atomic import fsync_dir, is_temporary_name

from .corpus import Corpus
from .directory import (
    GENERATION_FILE,
    JOURNAL_FILE,
    MANIFEST_FILE,
    Generation,
    base_name,
    current_generation,
    journal_files,
    read_generation,
    write_generation,
)
from .errors import CorpusError
from .journal import has_live_writer
from .lease import LEASE_SECONDS, CompactionLock

Evict = Callable[[list[np.ndarray]], tuple[list[np.ndarray], int]]


def fold(d: str, writer: str, evict: Evict, *, vocab_size: int | None = None, fingerprint: str | None = None,
         warn: Callable[[list[str]], None] = lambda lines: None, lease: float = LEASE_SECONDS) -> int | None:
    """Compact tenant directory ``d`` into its next generation as ``writer``.

    Args:
        evict: spans (oldest first) -> (the spans to keep, how many were dropped): the cap's rule.
        warn: receives the problem lines met (damaged records skipped).
    Returns:
        The number of spans evicted, or None when another writer holds the lock (nothing was done).
    Raises:
        OSError: a file could not be read or written (the current generation stays whole).
        CorpusError: the lease ran out before the commit (the new base is dropped, the lock left to expire).
    """
    lock = CompactionLock(d, writer, lease)
    if not lock.acquire():
        return None
    try:
        gen = current_generation(d)
        gone = gone_writers(d, gen)  # before reading: a record half-written when read may be finished meanwhile
        base, tails, problems = read_generation(d, gen, vocab_size=vocab_size, fingerprint=fingerprint)
        warn(problems)
        folded, damaged = {}, set()
        for t in tails:  # a writer that is gone will never finish a torn record: fold it away with the rest
            gone_now = t.name in gone
            folded[t.name] = t.end + (t.torn if gone_now else 0)
            if t.skipped or (gone_now and t.torn):
                damaged.add(t.name)
        spans, evicted = evict(base.span_list() + [s for t in tails for s in t.spans])
        nxt = Corpus.from_spans(spans, vocab_size=vocab_size, fingerprint=fingerprint)
        number = gen.number + 1
        if nxt.n_tokens:
            nxt.save(os.path.join(d, base_name(number)), fmt="binary")  # atomic: complete or absent
        if not lock.held():
            raise CorpusError(f"{lock.path}: the lease ran out during the compaction; its result is dropped")
        write_generation(d, Generation(number, base_name(number) if nxt.n_tokens else None, folded))  # commit
        remove_folded(d, number, folded, keep=journal_files(d, gen), damaged=damaged)
    finally:
        lock.release()
    return evicted


def gone_writers(d: str, gen: Generation) -> set[str]:
    """The journals of generation ``gen`` that no live writer holds (checked now: nobody appends to them any more,
    so what they hold when read next is all they will ever hold). A journal made later is not among them."""
    return {n for n in journal_files(d, gen) if not has_live_writer(os.path.join(d, n))}


def remove_folded(d: str, number: int, folded: dict[str, int], keep: Collection[str] = (),
                  damaged: Collection[str] = ()) -> None:
    """After generation ``number`` committed: older generation files and bases, single-writer journals of older
    generations, journals wholly folded whose writer is gone (one in ``damaged``, whose valid records were folded
    around skipped bytes, is kept aside as ``NAME.damaged``), and temporary files older than a lease (a crashed
    writer's), as are identity files ``journal-W.json`` left without their journal (a writer killed while starting
a segment). A journal in ``keep`` but not in ``folded`` (refused: another tokenizer's) stays."""
    now = time.time()
    for name in os.listdir(d):
        path = os.path.join(d, name)
        manifest, single = MANIFEST_FILE.match(name), GENERATION_FILE.match(name)
        try:
            if manifest:
                stale = int(manifest.group(1)) < number
            elif name in folded:
                stale = os.path.getsize(path) <= folded[name] and not has_live_writer(path)
            elif single:
                stale = int(single.group(2)) < number and name not in keep
            else:
                left = is_temporary_name(name) or name.endswith(".tmp") or _orphan_identity(d, name)
                stale = left and now - os.path.getmtime(path) > LEASE_SECONDS
            if not stale:
                continue
            if name in damaged:
                os.replace(path, path + ".damaged")
            else:
                os.unlink(path)
            if name.endswith(".rdj") and os.path.exists(path[:-len(".rdj")] + ".json"):
                os.unlink(path[:-len(".rdj")] + ".json")
        except OSError:
            pass
    fsync_dir(d)


def _orphan_identity(d: str, name: str) -> bool:
    """Whether ``name`` is a journal's identity file whose journal is not there."""
    if not (name.startswith("journal-") and name.endswith(".json")):
        return False
    journal = name[:-len(".json")] + ".rdj"
    return JOURNAL_FILE.match(journal) is not None and not os.path.exists(os.path.join(d, journal))


__all__ = ["fold", "gone_writers", "remove_folded"]
