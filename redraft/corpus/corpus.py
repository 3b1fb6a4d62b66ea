"""Corpus: frozen token spans from earlier outputs, with suffix lookups for drafting.

Lookup contract after Colibri's COLI_DRAFT_CORPUS (docs/architecture.md, "The corpus contract"): for
n = max_n down to min_n, find the context's last n ids; the longest n with an occurrence that has a non-empty
continuation wins; among its occurrences the most recent (highest corpus position) is proposed, up to k ids,
never across a -1 separator or the corpus end. Where the context matches all max_n ids, the match is extended
further back (up to context_n ids, default CONTEXT_N: in practice the whole prompt): the occurrences whose
preceding context matches the live context longest win, the most recent among them. Templated prompts share their
last max_n ids (an instruction, a chat template's tail), so the max_n rule alone drafts whichever answer was stored
last; the longer match finds each prompt's own answer. It is the same single suffix-array search (the reversed
stream makes every match length a prefix of one query), so it costs O(log n) comparisons of the query per step. Where that yields fewer than k ids (a self-overlapping suffix
inside a run such as 7 7 7 ..., or a span ending), the most recent occurrence that yields k is proposed instead,
else the one with the longest continuation (SuffixIndex.best_occurrence).

A Corpus is a list of SuffixIndex *segments* over consecutive runs of spans, oldest first. A loaded or built
corpus has one; append() adds small segments for the new spans and merges equal-sized neighbours (a
logarithmic-method tail: each appended token is re-indexed O(log tail) times, never the big base segment).
compact() merges everything into one segment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .branches import Branches, most_frequent_tree
from .errors import CorpusError
from .format import read_binary, read_text, sniff, write_binary, write_text
from .index import SuffixIndex
from .symbols import WIDTHS, width_for

EMPTY = np.zeros(0, dtype=np.int64)
MAX_ID = WIDTHS[4][2]  # largest id a corpus can hold (uint32 symbols, id + 1)
TREE_SAMPLE = 1024  # occurrences looked at by propose_tree when a suffix has more
TREE_SMALL = 64  # up to this many occurrences the tree is built in plain Python (numpy calls cost more)
PERIOD_CAP = 64  # longest period of a context tail run that propose() aligns on
RUN_CAP = 1024  # context ids read back along such a run (the aligned match may be this long)
CONTEXT_N = 4096  # most context ids compared past max_n (the whole prompt of a typical request): the query is this
# long, so it bounds the per-step cost of encoding it (~0.1 ms) and of each comparison in the binary search


def check_ids(tokens: np.ndarray, vocab_size: int | None, where: str) -> None:
    """Raise CorpusError if any id in tokens (integer [n]) is < 0 or >= vocab_size (or beyond uint32 symbols)."""
    if len(tokens) == 0:
        return
    limit = min(vocab_size, MAX_ID + 1) if vocab_size is not None else MAX_ID + 1
    bad = np.flatnonzero((tokens < 0) | (tokens >= limit))
    if len(bad):
        j = int(bad[0])
        note = f" (vocab size {vocab_size})" if vocab_size is not None else ""
        raise CorpusError(f"{where}: id {int(tokens[j])} at position {j} is out of range{note}")


def periodic_tail(context, n: int) -> tuple[list[int], int] | None:
    """The periodic run the context ends with, if its last n ids recur within PERIOD_CAP ids before.

    context: 1-D int array or sequence [L]. With p the smallest such distance (the period), the run is the longest
    suffix of the context (at most RUN_CAP ids) in which every id equals the id p later. Returns (run ids newest
    first, the id that would continue the period one step further back) or None when no period is found.
    """
    window = np.asarray(context[-RUN_CAP:], dtype=np.int64)
    ids = window[-(n + PERIOD_CAP):].tolist()
    last = ids[len(ids) - n:]
    for p in range(1, len(ids) - n + 1):
        if ids[len(ids) - n - p:len(ids) - p] == last:
            break
    else:
        return None
    same = window[:-p] == window[p:]
    r = p + (len(same) if same.all() else int(np.argmin(same[::-1])))
    run = window[len(window) - r:][::-1].tolist()
    return run, run[r - p]


def spans_to_flat(spans: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [n], offsets int64 [n_spans + 1]) from a list of spans; empty spans are dropped."""
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in spans]
    arrays = [a for a in arrays if len(a)]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokens = np.concatenate(arrays) if arrays else EMPTY
    return tokens, offsets


class Corpus:
    """Frozen token spans plus a suffix index; see the module doc for the lookup rule.

    Attributes: path (file it was loaded from, or None), vocab_size (int | None), fingerprint (tokenizer
    fingerprint, str | None), n_tokens (ids, separators excluded), n_spans.
    """

    def __init__(self, segments: list[SuffixIndex], *, path: str | None = None, vocab_size: int | None = None,
                 fingerprint: str | None = None):
        self.path = path
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self._segments = [s for s in segments if s.n_tokens]
        self._n_base = min(1, len(self._segments))  # segments [0, n_base) are never merged by append()

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_spans(cls, spans: Sequence[Sequence[int] | np.ndarray], vocab_size: int | None = None,
                   fingerprint: str | None = None) -> Corpus:
        """Build from spans (each a sequence of ids >= 0, oldest first). Empty spans are dropped.

        Raises CorpusError for an id < 0 or >= vocab_size (position = index into the concatenated spans).
        """
        tokens, offsets = spans_to_flat(spans)
        return cls.from_flat(tokens, offsets, vocab_size=vocab_size, fingerprint=fingerprint)

    @classmethod
    def from_flat(cls, tokens: np.ndarray, offsets: np.ndarray, vocab_size: int | None = None,
                  fingerprint: str | None = None, path: str | None = None) -> Corpus:
        """Build from tokens (any integer dtype) [n] and span offsets int64 [n_spans + 1] (non-empty spans)."""
        tokens = np.asarray(tokens)
        if tokens.dtype.kind not in "iu":
            tokens = tokens.astype(np.int64)
        check_ids(tokens, vocab_size, path or "corpus")
        if len(tokens) == 0:
            return cls([], path=path, vocab_size=vocab_size, fingerprint=fingerprint)
        width = width_for(int(tokens.max()), vocab_size)
        seg = SuffixIndex.build(tokens, np.asarray(offsets, dtype=np.int64), width)
        return cls([seg], path=path, vocab_size=vocab_size, fingerprint=fingerprint)

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self._segments)

    @property
    def n_spans(self) -> int:
        return sum(s.n_spans for s in self._segments)

    @property
    def max_id(self) -> int:
        """The largest token id held (-1 when empty): a corpus loaded without a vocabulary fits a model whose
        vocabulary size is above it."""
        return max((s.max_id for s in self._segments), default=-1)

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return (f"Corpus(path={self.path!r}, n_tokens={self.n_tokens}, n_spans={self.n_spans}, "
                f"vocab_size={self.vocab_size}, segments={len(self._segments)})")

    # ---- lookups --------------------------------------------------------------------------------------------
    def _longest(self, context, min_n: int, max_n: int, all_segments: bool, context_n: int | None = None):
        """Longest matching suffix over all segments: (n, [(segment, Match, query), ...] newest segment first).

        The query is the context's last max(max_n, context_n) ids: a match past max_n is the longer preceding
        context (module doc)."""
        if not self._segments or min_n < 1 or max_n < min_n:
            return 0, []
        n, hits = self._longest_of(context[-max_n:], min_n, all_segments)
        if n == max_n and context_n is not None and context_n > max_n and len(context) > max_n:
            # all max_n ids match: extend the match as far back as it goes (a second search, so that lookups
            # matching fewer ids, e.g. novel text, cost what they did)
            n, hits = self._longest_of(context[-context_n:], max_n, all_segments)
        return n, hits

    def _longest_of(self, tail, min_n: int, all_segments: bool):
        """Longest match of a context tail (any length) over all segments; see _longest."""
        if isinstance(tail, np.ndarray):
            tail = tail[::-1] if len(tail) > 64 else tail[::-1].tolist()
        else:
            tail = [int(t) for t in tail][::-1]
        if len(tail) < min_n:
            return 0, []
        segments = self._segments
        if len(segments) == 1:  # the common case: one frozen index, no appended tail
            seg = segments[0]
            q = seg.encode(tail)
            m = seg.longest(q, min_n)
            return (m.n, [(seg, m, q)]) if m is not None else (0, [])
        queries: dict[int, bytes] = {}
        best_n, hits = 0, []
        for seg in reversed(segments):
            if seg.width not in queries:
                queries[seg.width] = seg.encode(tail)
            q = queries[seg.width]
            # An older segment only matters if it matches strictly longer (newer wins ties).
            need = max(min_n, best_n + (0 if all_segments else 1))
            m = seg.longest(q, need)
            if m is None:
                continue
            if m.n > best_n:
                best_n, hits = m.n, [(seg, m, q)]
            else:
                hits.append((seg, m, q))
            if best_n == len(tail) and not all_segments:
                break
        return best_n, hits

    def propose(self, context, k: int, min_n: int = 3, max_n: int = 8,
                context_n: int | None = CONTEXT_N) -> tuple[int, np.ndarray]:
        """Continuation of the longest matching context suffix, up to k ids.

        context: 1-D int array or sequence (prompt + output so far). context_n: where all max_n ids match, how far
        back the match is extended (at most this many context ids; None or <= max_n: not at all, Colibri's rule
        alone). The longest match (up to max(max_n, context_n) ids) selects the occurrences; among them:
        - the most recent one, if its continuation has k ids (Colibri's rule);
        - otherwise, if the context ends in a periodic run (a run of one id, or any period up to PERIOD_CAP that
          repeats at least once) at least as long as the match, the occurrences preceded in the corpus by the same
          run length (aligned: in a replay, the same place), else by the longest part of the run the corpus has (a
          match reaching past the run is aligned already);
        - then the most recent one with k ids of continuation, else the longest continuation, most recent first
          (SuffixIndex.best_occurrence, which also states the bounds of that search).
        So runs and periodic stretches are drafted at full depth: spans [[7] * 100 + [1, 2, 3]] and context
        [7] * 10 give eight 7s at k = 8. Returns (n_matched, ids int64 [1..k]) or (0, int64 [0]) when nothing
        matches (absent suffix, context shorter than min_n, empty corpus, k < 1). Cost: one binary search + O(1)
        range minimum + O(k) per segment, independent of corpus size beyond log factors; the fallback adds
        O(RUN_CAP) on the context, three more binary searches and at most O(SCAN_ROWS * k) per segment.
        """
        if k < 1:
            return 0, EMPTY
        n, hits = self._longest(context, min_n, max_n, all_segments=False, context_n=context_n)
        if not n:
            return 0, EMPTY
        seg, m, q = hits[0]  # the newest segment matching n symbols
        i = seg.min_offset(m.lo, m.hi)
        ids = seg.continuation(i, k)
        if len(ids) >= k:
            return n, ids
        if len(self._segments) > 1:
            hits = self._longest(context, min_n, max_n, all_segments=True, context_n=context_n)[1]
        tail = periodic_tail(context, min(n, max_n))
        if tail is not None and len(tail[0]) < n:
            tail = None  # the match reaches past the context's periodic run: its occurrences are aligned already
        best = None  # ((alignment, ids of continuation), segment, offset); newer segments first win ties
        for seg, m, q in hits:
            if tail is None:
                cands = [(0, seg.best_occurrence(m.lo, m.hi, k, q[:m.n * seg.width]))]
            else:
                run, more = tail
                align, rows = seg.aligned_rows(seg.encode(run), seg.encode(run + [more]), n)
                cands = [(align, seg.best_occurrence(lo, hi, k)) for lo, hi in rows]
            for align, (i, run) in cands:
                if best is None or (align, run) > best[0] or ((align, run) == best[0] and i < best[2] and
                                                              seg is best[1]):
                    best = ((align, run), seg, i)
        assert best is not None  # n > 0: the newest hit at least is a candidate
        _, seg, i = best
        return n, seg.continuation(i, k)

    def propose_tree(self, context, k: int, branches: int = 4, min_n: int = 3, max_n: int = 8,
                     context_n: int | None = CONTEXT_N) -> Branches | None:
        """Most frequent continuations of the longest matching context suffix, as :class:`Branches` (or None).

        Same longest-suffix rule as propose(), the match extended past max_n up to context_n ids. Every occurrence
        of that suffix (in every segment) contributes its continuation of up to k ids (stopping at a separator);
        up to `branches` root-to-leaf paths are chosen greedily by count (branches.most_frequent_tree). Ties: higher count, then most recent supporting occurrence.
        Suffixes with more than TREE_SAMPLE (1024) occurrences in a segment use TREE_SAMPLE rows evenly strided
        across the suffix-array range (a deterministic sample, stratified by the preceding context) plus the most
        recent occurrence; counts are then sample counts. Cost O(TREE_SAMPLE * k) at most.
        """
        if k < 1 or branches < 1:
            return None
        n, hits = self._longest(context, min_n, max_n, all_segments=True, context_n=context_n)
        if not n:
            return None
        samples = []  # (segment, reversed offsets int64 [m]) per matching segment
        total = 0
        for seg, m, _ in hits:
            lo, hi = m.lo, m.hi
            total += hi - lo
            if hi - lo > TREE_SAMPLE:
                rows = lo + (np.arange(TREE_SAMPLE, dtype=np.int64) * (hi - lo)) // TREE_SAMPLE
                offs = np.unique(np.concatenate((seg.sa[rows], [seg.min_offset(lo, hi)]))).astype(np.int64)
            else:
                offs = np.asarray(seg.sa[lo:hi], dtype=np.int64)
            samples.append((seg, offs))
        # Recency = position in the whole corpus: segments are consecutive, oldest first.
        base, bases = 0, {}
        for seg in self._segments:
            bases[id(seg)] = base
            base += seg.length + 1
        conts: list[list[int]] | np.ndarray
        recency: list[int] | np.ndarray
        if sum(len(o) for _, o in samples) <= TREE_SMALL:
            conts, recency = [], []
            for seg, offs in samples:
                for i in offs.tolist():
                    conts.append(seg.continuation(i, k).tolist())
                    recency.append(bases[id(seg)] + seg.position(i))
        else:
            conts = np.concatenate([seg.continuations(offs, k) for seg, offs in samples])
            recency = np.concatenate([bases[id(seg)] + seg.length - 1 - offs for seg, offs in samples])
        tokens, parents, counts = most_frequent_tree(conts, recency, branches)
        if not tokens:
            return None
        return Branches(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64),
                        np.array(counts, dtype=np.int64), match_length=n, occurrences=total)

    def holds(self, span: Sequence[int]) -> bool:
        """Whether the corpus already holds ``span`` (ids, any integer sequence): all of it, contiguously, inside
        one stored span (possibly a longer one).

        This is the "already learned" test: a span is prompt + answer, and when the corpus holds it the lookup
        matches every replay step's whole context (prompt + answer so far) at that occurrence with the same
        suffix-array search propose() runs, so storing it again adds nothing a replay could draft. An empty span
        is held. Cost: one binary search per segment plus the rows of span[:-1] (see SuffixIndex.holds).
        """
        ids = np.asarray(span, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return True
        if ids.min() < 0:
            return False
        return any(seg.holds(ids) for seg in reversed(self._segments))

    # ---- growth ---------------------------------------------------------------------------------------------
    def append(self, span: Sequence[int] | np.ndarray) -> None:
        """Append one span (ids >= 0, < vocab_size); lookups see it at once and prefer it (it is the newest).

        Indexes the span as a small segment and merges tail segments of similar size (never the base segment),
        so appending costs O(len(span) * log(tail)) amortised, not a rebuild. Raises CorpusError on a bad id.
        """
        tokens = np.asarray(span, dtype=np.int64).reshape(-1)
        if len(tokens) == 0:
            return
        check_ids(tokens, self.vocab_size, self.path or "appended span")
        width = width_for(int(tokens.max()), self.vocab_size)
        self._segments.append(SuffixIndex.build(tokens, np.array([0, len(tokens)], dtype=np.int64), width))
        while (len(self._segments) - self._n_base >= 2
               and self._segments[-2].n_tokens <= 2 * self._segments[-1].n_tokens):
            b = self._segments.pop()
            a = self._segments.pop()
            self._segments.append(_merge([a, b], self.vocab_size))

    def with_span(self, span: Sequence[int] | np.ndarray) -> Corpus:
        """A new corpus: this one plus ``span`` (as :meth:`append`); this one is left unchanged.

        Copy-on-write for readers on other threads: the segments are immutable and shared, only the list is
        copied, so a lookup running on this corpus meanwhile sees it whole. Raises CorpusError on a bad id.
        """
        c = Corpus(list(self._segments), path=self.path, vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        c._n_base = self._n_base
        c.append(span)
        return c

    def compact(self) -> None:
        """Merge all segments (base + appended tail) into one index. O(n_tokens) rebuild."""
        if len(self._segments) > 1:
            self._segments = [_merge(self._segments, self.vocab_size)]
        self._n_base = min(1, len(self._segments))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """All spans, oldest first: (tokens int64 [n_tokens], offsets int64 [n_spans + 1])."""
        if not self._segments:
            return EMPTY, np.zeros(1, dtype=np.int64)
        return concat_flat([s.spans() for s in self._segments])

    def span_list(self) -> list[np.ndarray]:
        """All spans as a list of int64 arrays, oldest first."""
        tokens, offsets = self.spans()
        return [tokens[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]

    @property
    def segments(self) -> list[SuffixIndex]:
        """The index segments, oldest first (read-only use: saving, stats)."""
        return self._segments

    # ---- files and stats ------------------------------------------------------------------------------------
    def save(self, path, *, fmt: str = "binary") -> None:
        """Write the corpus to `path` as fmt="binary" (index included, mmap-able) or "text".

        A corpus with an appended tail is compacted first (binary files hold one index); text is written in the
        one text layout (:func:`redraft.corpus.format.append_text`). Raises CorpusError on an unknown fmt or an
        OSError.
        """
        if fmt == "binary":
            self.compact()
            write_binary(path, self._segments[0] if self._segments else None, vocab_size=self.vocab_size,
                         fingerprint=self.fingerprint)
        elif fmt == "text":
            write_text(path, self.span_list())
        else:
            raise CorpusError(f"{path}: unknown corpus format {fmt!r} (expected 'binary' or 'text')")

    def stats(self) -> dict:
        """Sizes: n_tokens, n_spans, segments, tail_tokens, vocab_size, fingerprint, token_bytes, index_bytes,
        bytes_per_token (stream + suffix array + range-minimum table, resident or mapped), path."""
        n = self.n_tokens
        token_bytes = sum(s.length * s.width for s in self._segments)
        index_bytes = sum(s.sa.nbytes + s.table.nbytes + s.samples.nbytes for s in self._segments)
        return {
            "path": self.path,
            "n_tokens": n,
            "n_spans": self.n_spans,
            "segments": len(self._segments),
            "tail_tokens": sum(s.n_tokens for s in self._segments[self._n_base:]),
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "token_width": max((s.width for s in self._segments), default=0),
            "token_bytes": token_bytes,
            "index_bytes": index_bytes,
            "bytes_per_token": (token_bytes + index_bytes) / n if n else 0.0,
        }



def load_corpus(path, *, vocab_size: int | None = None, fingerprint: str | None = None, force: bool = False,
                progress: bool = False) -> Corpus:
    """Load a text or binary corpus file, detected by content.

    vocab_size: when given, every id must be < vocab_size. fingerprint: the current tokenizer's fingerprint
    (fingerprint.tokenizer_fingerprint); a binary corpus made by another tokenizer is refused unless force=True.
    progress: tqdm bar while parsing text / building the index.
    Raises CorpusError (never returns a half-loaded corpus) for a missing/unreadable file, a non-integer token
    (with line), an id < -1 or >= vocab_size (with position and line), a truncated binary, bad magic, unknown
    version or fingerprint mismatch. An empty file gives an empty corpus.
    """
    path = os.fspath(path)
    if sniff(path) == "binary":
        seg, file_vocab, file_fp = read_binary(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
        return Corpus([seg] if seg is not None else [], path=path,
                      vocab_size=vocab_size if vocab_size is not None else file_vocab,
                      fingerprint=file_fp if file_fp is not None else fingerprint)
    tokens, offsets = read_text(path, vocab_size=vocab_size, progress=progress)
    return Corpus.from_flat(tokens, offsets, vocab_size=vocab_size, fingerprint=fingerprint, path=path)

def concat_flat(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (tokens [n_i], offsets [s_i + 1]) pairs, oldest first, into one (tokens, offsets) pair."""
    tokens = np.concatenate([t for t, _ in parts]) if parts else EMPTY
    offsets, shift = [np.zeros(1, dtype=np.int64)], 0
    for t, o in parts:
        offsets.append(o[1:] + shift)
        shift += len(t)
    return tokens, np.concatenate(offsets)


def _merge(segments: list[SuffixIndex], vocab_size: int | None) -> SuffixIndex:
    tokens, offsets = concat_flat([s.spans() for s in segments])
    width = width_for(int(tokens.max()), vocab_size)
    return SuffixIndex.build(tokens, offsets, width)
