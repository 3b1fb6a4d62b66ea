"""A corpus that grows while it is read: copy-on-write snapshots, crash-safe journals, many writers, a token cap.

Readers (the drafter's ``propose`` / ``propose_tree``) take no lock: they read the current :class:`Corpus`
snapshot, which is never changed once published. A writer builds the next snapshot (a copy of the segment list
plus the new span's segment) and publishes it with one reference assignment, so a lookup running while another
thread appends sees either the old or the new corpus whole, never a half-merged segment list.

On disk (when a directory is given, the layout of :mod:`redraft.corpus.directory`) each process appends to its own
journal ``journal-W.rdj`` and follows every other writer's journal of the directory (a background thread reads new
complete records every ``follow_seconds``), so a span learned by one replica drafts on all of them within about
that delay. Compaction folds the base and every journal into the next generation's base; any writer may start it,
the one holding the compaction lock (:mod:`redraft.corpus.lease`) runs it, reading the files rather than its own
memory, so nothing another writer stored is lost or stored twice. Its generation file is the commit point; a crash
at any moment leaves the previous generation whole, and a record cut short by a crash is never read.

A live writer's journal moves to a new segment once a generation folded most of it; the closed segment is
followed like another writer's journal until a compaction folds the rest and removes it (:mod:`redraft.corpus.segments`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from .compaction import fold
from .corpus import CONTEXT_N, Corpus, check_ids
from .directory import Generation, check_identity, current_generation, journal_files, read_generation
from .errors import CorpusError
from .journal import read_tail
from .lease import writer_id
from .segments import WriterJournal

COMPACT_MIN_TOKENS = 1 << 16  # journal tokens before a compaction is worth its rebuild
EVICT_TO = 0.75  # eviction keeps the newest spans up to this share of the cap, so it runs once per cap/4 tokens
HARD_CAP = 2  # appends wait for a running eviction rather than hold more than HARD_CAP * cap ids
FOLLOW_SECONDS = 0.2  # how often a writer reads the other writers' journals



def _stderr_warning(msg: str) -> None:
    print(f"redraft: warning: {msg}", file=sys.stderr)


class OnlineCorpus:
    """A growing corpus, safe for concurrent lookups and appends, optionally persisted, shared and capped.

    Args:
        directory: a tenant directory (created if missing) this process writes its journal into and whose other
            journals it follows; None keeps the corpus in memory only.
        vocab_size: ids must be below this (journal records with larger ids are skipped at replay).
        fingerprint: tokenizer fingerprint stored in the binary base and checked when it is loaded; a journal
            whose writer recorded another one is not read.
        cap_tokens: most ids held (separators excluded); over it the oldest spans are evicted down to
            ``EVICT_TO * cap_tokens`` by a background compaction. A span longer than the cap is not kept.
            None = unbounded.
        sync: fsync each journal record before ``append`` returns.
        compact_tokens: journal tokens (all writers') that trigger a compaction into the binary base (default
            max(COMPACT_MIN_TOKENS, base tokens): the rebuild cost stays proportional to what was appended).
        warn: called with one line per problem found (default: ``redraft: warning: ...`` on stderr).
        follow_seconds: how often the other writers' journals are read (None: only at start and compaction).
        writer: this process's writer id (default a new :func:`redraft.corpus.lease.writer_id`).

    Attributes:
        problems: the warning lines so far. evicted_spans: spans dropped by the cap so far (by this process's
        compactions). dropped_spans: spans refused because they alone exceed the cap. followed_spans: spans read
        from other writers' journals since start. follow_delay: seconds between the newest followed record's write
        and its read, at the last read that found one.

    Raises:
        CorpusError: the directory cannot be created or written (names it).
    """

    name = "online"

    def __init__(self, directory=None, *, vocab_size: int | None = None, fingerprint: str | None = None,
                 cap_tokens: int | None = None, sync: bool = True, compact_tokens: int | None = None,
                 warn: Callable[[str], None] = _stderr_warning, follow_seconds: float | None = FOLLOW_SECONDS,
                 writer: str | None = None) -> None:
        if cap_tokens is not None and cap_tokens < 1:
            raise ValueError(f"cap_tokens must be at least 1, got {cap_tokens}")
        self.directory = os.fspath(directory) if directory is not None else None
        self.vocab_size, self.fingerprint = vocab_size, fingerprint
        self.cap_tokens, self.sync, self.compact_tokens = cap_tokens, sync, compact_tokens
        self.warn = warn
        self.writer = writer or writer_id()
        self.problems: list[str] = []
        self.evicted_spans = self.dropped_spans = self.followed_spans = 0
        self.follow_delay = 0.0
        self._lock = threading.Lock()  # writers only: append, publishing a reload
        self._disk = threading.RLock()  # one reload or follow pass at a time
        self._corpus = Corpus([], vocab_size=vocab_size, fingerprint=fingerprint)
        self._gen, self._base_tokens, self._journal_tokens = 0, 0, 0
        self._journal: WriterJournal | None = None
        self._own = f"journal-{self.writer}.rdj"  # the journal segment this writer appends to
        self._offsets: dict[str, int] = {}  # other writers' journals: bytes read so far
        self._refused: set[str] = set()  # journals of another tokenizer (warned once)
        self._pending: list[np.ndarray] | None = None  # in memory: spans appended while a compaction runs
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        if self.directory is not None:
            self._open()
            if follow_seconds is not None:
                self._follower = threading.Thread(target=self._follow_loop, args=(follow_seconds,),
                                                  name="corpus-follow", daemon=True)
                self._follower.start()
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
    def journal(self) -> str | None:
        """This writer's journal file (None in memory, or once closed)."""
        return self._journal.path if self._journal is not None else None

    @property
    def n_spans(self) -> int:
        return self._corpus.n_spans

    def stats(self) -> dict:
        """Sizes and state: n_tokens, n_spans, generation, journal_bytes (this writer's), evicted_spans,
        dropped_spans, problems, writer, journals (other writers' followed), followed_spans, follow_delay_seconds."""
        return {"n_tokens": self.n_tokens, "n_spans": self.n_spans, "generation": self._gen,
                "journal_bytes": self._journal.size if self._journal else 0, "evicted_spans": self.evicted_spans,
                "dropped_spans": self.dropped_spans, "problems": len(self.problems), "writer": self.writer,
                "journals": len(self._offsets), "followed_spans": self.followed_spans,
                "follow_delay_seconds": round(self.follow_delay, 3)}

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
        span within one follow delay of each other may both append it (each checks what it has read so far).
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
        """Rebuild into one index (and, with a directory, a new binary base folding every writer's journal),
        evicting over the cap.

        wait=False starts it in a background thread (appends and lookups go on meanwhile) unless one is already
        running; wait=True returns once a compaction that started after the call has finished. With a directory,
        a compaction another writer is running now makes this one a no-op (that one's generation is read when it
        commits). Failures are warned about, never raised: the previous generation stays in use.
        """
        while True:
            with self._lock:
                worker, started = self._worker, self._worker is None
                if started:
                    # the snapshot and the start of _pending are taken together: each span is in exactly one of them
                    self._pending = [] if self.directory is None else None
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
        """Stop following, wait for a running compaction and close the journal (removed when this writer stored
        nothing)."""
        self._stop.set()
        if self._follower is not None:
            self._follower.join()
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

    def _path(self, name: str) -> str:
        assert self.directory is not None  # files exist only with a directory
        return os.path.join(self.directory, name)

    def _note(self, lines: list[str]) -> None:
        for line in lines:
            if line not in self.problems:
                self.problems.append(line)
                self.warn(line)

    def _open(self) -> None:
        """Start this writer's journal (and its identity file), then read the current generation."""
        assert self.directory is not None  # called only with a directory
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._journal = WriterJournal(self.directory, self.writer, sync=self.sync,
                                          identity={"fingerprint": self.fingerprint, "vocab_size": self.vocab_size})
        except OSError as e:
            raise CorpusError(f"{self.directory}: cannot write a journal there ({e.strerror or e}); a corpus "
                              f"directory must be writable by every server and proposer that learns into it") from e
        self._reload(current_generation(self.directory))

    def _rotate(self, gen: Generation, end: int) -> None:
        """A new journal segment once ``gen`` folded enough of this one, which holds ``end`` bytes (the caller holds
        ``_lock``: no append runs). The closed segment is followed from ``end`` on, as another writer's journal: its
        records past the fold are in the snapshot already, read as this writer's own."""
        assert self._journal is not None
        old = self._journal.name
        try:
            closed = self._journal.rotate(gen.folded)
        except OSError as e:
            self._note([f"{self._journal.path}: cannot start a new journal segment ({e.strerror or e}); "
                        f"appending to this one"])
            closed = None
        if closed is not None:
            self._offsets[old] = end
        self._own = self._journal.name

    def _reload(self, gen: Generation) -> None:
        """Make generation ``gen`` (or a newer one, when ``gen``'s files were removed meanwhile) the snapshot: its
        base, every other journal's records past what it folded, and this writer's own."""
        assert self.directory is not None
        with self._disk:
            for _ in range(5):
                try:
                    base, tails, problems = read_generation(self.directory, gen, vocab_size=self.vocab_size,
                                                            fingerprint=self.fingerprint, skip=self._own)
                    break
                except FileNotFoundError:  # a compaction committed a newer generation and removed this one
                    gen = current_generation(self.directory)
            else:
                return
            self._note(problems)
            with self._lock:  # this writer's records are complete here: it appends under this lock
                own = read_tail(self._path(self._own), gen.folded.get(self._own, 0), vocab_size=self.vocab_size)
                spans = [s for t in tails for s in t.spans] + own.spans
                tail = Corpus.from_spans(spans, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
                self._corpus = Corpus(list(base.segments) + list(tail.segments), vocab_size=self.vocab_size,
                                      fingerprint=self.fingerprint)
                self._gen, self._base_tokens = gen.number, base.n_tokens
                self._journal_tokens = sum(len(s) for s in spans)
                self._offsets = {t.name: t.end for t in tails}
                if self._journal is not None:
                    self._rotate(gen, own.end)

    def _follow_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.follow()
            except Exception as e:  # a shared volume that hiccups: keep serving, try again next time
                self._note([f"{self.directory}: following the other writers failed ({type(e).__name__}: {e})"])

    def follow(self) -> int:
        """Read what the other writers appended since the last read (a newer generation: reload from it), and
        start a compaction when it is due. Returns the number of spans added. Raises OSError."""
        assert self.directory is not None
        with self._disk:
            gen = current_generation(self.directory)
            if gen.number != self._gen:
                before = self._corpus.n_spans
                self._reload(gen)
                added = max(0, self._corpus.n_spans - before)
            else:
                added = self._read_others(gen)
        if self._worker is None and (self._over_cap() or self._journal_due()):
            self.compact(wait=False)
        return added

    def _read_others(self, gen: Generation) -> int:
        assert self.directory is not None
        added = 0
        for name in journal_files(self.directory, gen):
            if name == self._own or name in self._refused:
                continue
            path = self._path(name)
            offset = self._offsets.get(name, gen.folded.get(name, 0))
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_size <= offset:
                continue
            if name not in self._offsets:
                why = check_identity(self.directory, name, self.vocab_size, self.fingerprint)
                if why is not None:
                    self._refused.add(name)
                    self._note([why])
                    continue
            try:
                tail = read_tail(path, offset, vocab_size=self.vocab_size)
            except FileNotFoundError:  # removed by a compaction once wholly folded: the next generation holds it
                continue
            self._note(tail.problems)
            if tail.spans:
                with self._lock:
                    c = self._corpus
                    for span in tail.spans:
                        c = c.with_span(span)
                    self._corpus = c
                    self._journal_tokens += sum(len(span) for span in tail.spans)
                self.followed_spans += len(tail.spans)
                added += len(tail.spans)
                self.follow_delay = max(0.0, time.time() - st.st_mtime)
            self._offsets[name] = tail.end
        return added

    def _compact(self, snap: Corpus) -> None:
        ok = False
        try:
            ok = self._compact_directory() if self.directory is not None else self._compact_memory(snap)
        except Exception as e:  # disk full, permissions: keep serving from the current generation
            self.warn(f"corpus compaction failed ({type(e).__name__}: {e}); keeping the current generation")
        finally:
            with self._lock:
                self._worker, self._pending = None, None
                again = ok and self._over_cap()
        if again:  # spans appended during the eviction pushed it over the cap again
            self.compact(wait=False)

    def _evict(self, spans: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """The newest spans within ``EVICT_TO * cap`` when over the cap, and how many were dropped."""
        if self.cap_tokens is None or sum(len(s) for s in spans) <= self.cap_tokens:
            return spans, 0
        budget, keep = int(EVICT_TO * self.cap_tokens), len(spans)
        while keep > 0 and budget >= len(spans[keep - 1]):
            budget -= len(spans[keep - 1])
            keep -= 1
        return spans[keep:], keep

    def _compact_memory(self, snap: Corpus) -> bool:
        spans, evicted = self._evict(snap.span_list())
        nxt = Corpus.from_spans(spans, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        with self._lock:
            pending, self._pending = self._pending or [], None
            for s in pending:
                nxt = nxt.with_span(s)
            self._corpus = nxt
            self._base_tokens = nxt.n_tokens - sum(len(s) for s in pending)
            self._journal_tokens = sum(len(s) for s in pending)
            self.evicted_spans += evicted
        return True

    def _compact_directory(self) -> bool:
        """Fold the directory's generation into the next one (:func:`redraft.corpus.compaction.fold`) and read it;
        False when another writer holds the compaction lock."""
        assert self.directory is not None
        done = fold(self.directory, self.writer, self._evict, vocab_size=self.vocab_size,
                    fingerprint=self.fingerprint, warn=self._note)
        if done is None:
            return False
        self.evicted_spans += done
        self._reload(current_generation(self.directory))
        return True


__all__ = ["OnlineCorpus"]
