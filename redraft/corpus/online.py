"""A corpus that grows while it is read: copy-on-write snapshots, a crash-safe journal, a token cap, compaction.

Readers (the drafter's ``propose`` / ``propose_tree``) take no lock: they read the current :class:`Corpus`
snapshot, which is never changed once published. A writer builds the next snapshot (a copy of the segment list
plus the new span's segment) and publishes it with one reference assignment, so a lookup running while another
thread appends sees either the old or the new corpus whole, never a half-merged segment list.

On disk (when a directory is given) a generation G is ``base-G.bin`` (optional, a binary corpus) plus
``journal-G.rdj`` (spans appended since, see :mod:`redraft.corpus.journal`). Compaction builds generation G + 1 in
a background thread from a snapshot (evicting the oldest spans when over the cap) while appends go on; it then
writes the spans appended meanwhile into ``journal-(G+1).rdj``, whose rename is the commit point, and drops
generation G. A crash at any moment leaves one complete generation: at start the highest generation with a
journal wins, and leftovers of an unfinished compaction are removed.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from redraft.io.atomic import fsync_dir, is_temporary_name

from .corpus import CONTEXT_N, Corpus, check_ids, load_corpus
from .directory import GENERATION_FILE
from .errors import CorpusError
from .journal import JournalWriter, read_journal, write_journal

COMPACT_MIN_TOKENS = 1 << 16  # journal tokens before a compaction is worth its rebuild
EVICT_TO = 0.75  # eviction keeps the newest spans up to this share of the cap, so it runs once per cap/4 tokens
HARD_CAP = 2  # appends wait for a running eviction rather than hold more than HARD_CAP * cap ids



def _stderr_warning(msg: str) -> None:
    print(f"redraft: warning: {msg}", file=sys.stderr)


class OnlineCorpus:
    """A growing corpus, safe for concurrent lookups and appends, optionally persisted and capped.

    Args:
        directory: where the journal and binary base live (created if missing); None keeps it in memory only.
        vocab_size: ids must be below this (journal records with larger ids are skipped at replay).
        fingerprint: tokenizer fingerprint stored in the binary base and checked when it is loaded.
        cap_tokens: most ids held (separators excluded); over it the oldest spans are evicted down to
            ``EVICT_TO * cap_tokens`` by a background compaction. A span longer than the cap is not kept.
            None = unbounded.
        sync: fsync each journal record before ``append`` returns.
        compact_tokens: journal tokens that trigger a compaction into the binary base (default
            max(COMPACT_MIN_TOKENS, base tokens): the rebuild cost stays proportional to what was appended).
        warn: called with one line per problem found (default: ``redraft: warning: ...`` on stderr).

    Attributes:
        problems: the warning lines of the last replay. evicted_spans: spans dropped by the cap so far.
        dropped_spans: spans refused because they alone exceed the cap.
    """

    name = "online"

    def __init__(self, directory=None, *, vocab_size: int | None = None, fingerprint: str | None = None,
                 cap_tokens: int | None = None, sync: bool = True, compact_tokens: int | None = None,
                 warn: Callable[[str], None] = _stderr_warning) -> None:
        if cap_tokens is not None and cap_tokens < 1:
            raise ValueError(f"cap_tokens must be at least 1, got {cap_tokens}")
        self.directory = os.fspath(directory) if directory is not None else None
        self.vocab_size, self.fingerprint = vocab_size, fingerprint
        self.cap_tokens, self.sync, self.compact_tokens = cap_tokens, sync, compact_tokens
        self.warn = warn
        self.problems: list[str] = []
        self.evicted_spans = self.dropped_spans = 0
        self._lock = threading.Lock()  # writers only: append, the end of a compaction
        self._corpus = Corpus([], vocab_size=vocab_size, fingerprint=fingerprint)
        self._gen, self._base_tokens, self._journal_tokens = 0, 0, 0
        self._journal: JournalWriter | None = None
        self._pending: list[np.ndarray] | None = None  # spans appended while a compaction runs
        self._worker: threading.Thread | None = None
        if self.directory is not None:
            self._open()
        if self._over_cap():
            self.compact()

    @classmethod
    def in_memory(cls, corpus: Corpus, **kw) -> OnlineCorpus:
        """An OnlineCorpus without a directory that starts from ``corpus`` (e.g. one read by
        :func:`redraft.corpus.directory.read_directory` on a process that must not write it). kw: as the
        constructor's, ``directory`` excepted."""
        oc = cls(None, vocab_size=corpus.vocab_size, fingerprint=corpus.fingerprint, **kw)
        oc._corpus = corpus
        if oc._over_cap():
            oc.compact()
        return oc

    # ---- reads: no lock, one snapshot per call ------------------------------------------------------------------
    @property
    def corpus(self) -> Corpus:
        """The current snapshot (never modified after it is published)."""
        return self._corpus

    def propose(self, context, k: int, min_n: int = 3, max_n: int = 8, context_n: int | None = CONTEXT_N):
        """:meth:`Corpus.propose` on the current snapshot."""
        return self._corpus.propose(context, k, min_n=min_n, max_n=max_n, context_n=context_n)

    def propose_tree(self, context, k: int, branches: int = 4, min_n: int = 3, max_n: int = 8,
                     context_n: int | None = CONTEXT_N):
        """:meth:`Corpus.propose_tree` on the current snapshot."""
        return self._corpus.propose_tree(context, k, branches=branches, min_n=min_n, max_n=max_n,
                                         context_n=context_n)

    @property
    def n_tokens(self) -> int:
        return self._corpus.n_tokens

    @property
    def n_spans(self) -> int:
        return self._corpus.n_spans

    def stats(self) -> dict:
        """Sizes and state: n_tokens, n_spans, generation, journal_bytes, evicted_spans, dropped_spans, problems."""
        return {"n_tokens": self.n_tokens, "n_spans": self.n_spans, "generation": self._gen,
                "journal_bytes": self._journal.size if self._journal else 0, "evicted_spans": self.evicted_spans,
                "dropped_spans": self.dropped_spans, "problems": len(self.problems)}

    # ---- writes -----------------------------------------------------------------------------------------------
    def append(self, span: Sequence[int] | np.ndarray) -> bool:
        """Add one span; lookups see it as soon as this returns, and it is in the journal (fsynced when ``sync``).

        While an eviction runs, an append that would hold more than HARD_CAP * cap ids waits for it, so memory stays
        bounded however fast spans arrive. Returns False (and keeps nothing) for an empty span or one longer than
        the cap. Raises CorpusError for an id outside the vocabulary and OSError when the journal cannot be written
        (the span is then not added: memory and journal stay the same).
        """
        tokens = np.asarray(span, dtype=np.int64).reshape(-1)
        if len(tokens) == 0:
            return False
        check_ids(tokens, self.vocab_size, "appended span")
        while True:
            with self._lock:
                if self.cap_tokens is not None and len(tokens) > self.cap_tokens:
                    self.dropped_spans += 1
                    return False
                worker = self._worker
                if worker is None or self.cap_tokens is None or \
                        self._corpus.n_tokens + len(tokens) <= HARD_CAP * self.cap_tokens:
                    self._add(tokens)
                    start = self._worker is None and (self._over_cap() or self._journal_due())
                    break
            worker.join()  # appends outran the eviction: wait for it rather than grow past the bound
        if start:
            self.compact(wait=False)
        return True

    def learn(self, span: Sequence[int]) -> bool:
        """Append ``span`` unless the corpus already holds it (:meth:`Corpus.holds`: all of it contiguously inside
        one stored span), so a repeated request never stores its answer twice, whatever was drafted for it.

        Returns True when the span was appended. Same errors as :meth:`append`. Two writers learning the same
        span at the same moment may both append it (the check reads the published snapshot, without the lock).
        """
        if self._corpus.holds(span):
            return False
        return self.append(span)

    def _add(self, tokens: np.ndarray) -> None:
        if self._journal is not None:
            self._journal.append(tokens)
        self._corpus = self._corpus.with_span(tokens)
        self._journal_tokens += len(tokens)
        if self._pending is not None:
            self._pending.append(tokens)

    def compact(self, wait: bool = True) -> None:
        """Rebuild into one index (and, with a directory, a new binary base), evicting over the cap.

        wait=False starts it in a background thread (appends and lookups go on meanwhile) unless one is already
        running; wait=True returns once a compaction that started after the call has finished. Failures are warned
        about, never raised: the previous generation stays in use.
        """
        while True:
            with self._lock:
                worker, started = self._worker, self._worker is None
                if started:
                    # the snapshot and the start of _pending are taken together: each span is in exactly one of them
                    self._pending = []
                    worker = self._worker = threading.Thread(target=self._compact, args=(self._corpus,),
                                                             name="corpus-compaction", daemon=True)
                    worker.start()
            if not wait:
                return
            assert worker is not None  # the one started here or the one already running
            worker.join()
            if started:
                return

    def close(self) -> None:
        """Wait for a running compaction and close the journal."""
        worker = self._worker
        if worker is not None:
            worker.join()
        with self._lock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None

    # ---- internals ----------------------------------------------------------------------------------------------
    def _over_cap(self) -> bool:
        return self.cap_tokens is not None and self._corpus.n_tokens > self.cap_tokens

    def _journal_due(self) -> bool:
        if self.directory is None:
            return False
        due = self.compact_tokens if self.compact_tokens is not None else max(COMPACT_MIN_TOKENS, self._base_tokens)
        return self._journal_tokens >= due

    def _path(self, kind: str, gen: int) -> str:
        assert self.directory is not None  # generations on disk exist only with a directory
        return os.path.join(self.directory, f"{kind}-{gen:06d}.{'bin' if kind == 'base' else 'rdj'}")

    def _open(self) -> None:
        """Load the newest complete generation, replay its journal, remove leftovers."""
        assert self.directory is not None  # called only with a directory
        os.makedirs(self.directory, exist_ok=True)
        gens: dict[str, set[int]] = {"base": set(), "journal": set()}
        for name in os.listdir(self.directory):
            m = GENERATION_FILE.match(name)
            if m:
                gens[m.group(1)].add(int(m.group(2)))
        self._gen = max(gens["journal"], default=0)
        base = self._load_base()
        replay = read_journal(self._path("journal", self._gen), vocab_size=self.vocab_size)
        self.problems += replay.problems
        for p in replay.problems:
            self.warn(p)
        if replay.problems:
            self._rewrite_damaged(replay.spans)
        tail = Corpus.from_spans(replay.spans, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        self._corpus = Corpus(list(base.segments) + list(tail.segments), vocab_size=self.vocab_size,
                              fingerprint=self.fingerprint)
        self._base_tokens, self._journal_tokens = base.n_tokens, tail.n_tokens
        self._journal = JournalWriter(self._path("journal", self._gen), sync=self.sync)
        self._remove_other_generations()

    def _load_base(self) -> Corpus:
        path = self._path("base", self._gen)
        empty = Corpus([], vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        if not os.path.exists(path):
            return empty
        try:
            return load_corpus(path, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        except CorpusError as e:
            # never refuse to start; keep the file aside rather than let the next compaction overwrite it
            os.replace(path, path + ".damaged")
            msg = f"{path}: binary base unreadable ({e}); moved to {path}.damaged, its spans are not used"
            self.problems.append(msg)
            self.warn(msg)
            return empty

    def _rewrite_damaged(self, spans: list[np.ndarray]) -> None:
        """Keep a copy of a damaged journal and replace it with its valid records, so appends follow clean data."""
        import shutil

        path = self._path("journal", self._gen)
        shutil.copyfile(path, path + ".damaged")
        write_journal(path, spans)
        self.warn(f"{path}: rewritten with its {len(spans)} valid records (the damaged file is {path}.damaged)")

    def _remove_other_generations(self) -> None:
        assert self.directory is not None  # called only with a directory
        for name in os.listdir(self.directory):
            m = GENERATION_FILE.match(name)
            stale = (m and int(m.group(2)) != self._gen) or is_temporary_name(name) or name.endswith(".tmp")
            if stale:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass

    def _compact(self, snap: Corpus) -> None:
        ok = False
        try:
            self._build_next(snap)
            ok = True
        except Exception as e:  # disk full, permissions: keep serving from the current generation
            self.warn(f"corpus compaction failed ({type(e).__name__}: {e}); keeping the current generation")
        finally:
            with self._lock:
                self._worker, self._pending = None, None
                again = ok and self._over_cap()
        if again:  # spans appended during the eviction pushed it over the cap again
            self.compact(wait=False)

    def _build_next(self, snap: Corpus) -> None:
        spans = snap.span_list()
        if self.cap_tokens is not None and snap.n_tokens > self.cap_tokens:
            budget, keep = int(EVICT_TO * self.cap_tokens), len(spans)
            while keep > 0 and budget >= len(spans[keep - 1]):
                budget -= len(spans[keep - 1])
                keep -= 1
            evicted, spans = keep, spans[keep:]
        else:
            evicted = 0
        nxt = Corpus.from_spans(spans, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        gen = self._gen + 1
        if self.directory is not None and nxt.n_tokens:
            base = self._path("base", gen)
            nxt.save(base, fmt="binary")  # atomic: complete or absent
        with self._lock:
            pending, self._pending = self._pending or [], None
            if self.directory is not None:
                # the commit point: from here on generation gen is what a restart loads
                write_journal(self._path("journal", gen), pending)
                old = self._journal
                self._journal = JournalWriter(self._path("journal", gen), sync=self.sync)
                if old is not None:
                    old.close()
                self._gen = gen
            for s in pending:
                nxt = nxt.with_span(s)
            self._corpus = nxt
            self._base_tokens = nxt.n_tokens - sum(len(s) for s in pending)
            self._journal_tokens = sum(len(s) for s in pending)
            self.evicted_spans += evicted
        if self.directory is not None:
            self._remove_other_generations()
            fsync_dir(self.directory)


__all__ = ["OnlineCorpus"]
