"""Corpus file tools (no model loading): build, append, merge, convert, compact and statistics.

Plain functions, usable from Python; ``redraft corpus build|append|merge|stats|convert|compact``
(:mod:`redraft.cli.corpus`) is their command line.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from .compaction import fold
from .corpus import Corpus, concat_flat, load_corpus
from .directory import current_generation, directory_meta, read_directory, resolve, writers
from .errors import CorpusError
from .format import SECTIONS, append_text, binary_version, read_text, sniff
from .index import SuffixIndex
from .lease import CompactionLock, writer_id
from .sources import read_spans


# ---- functions --------------------------------------------------------------------------------------------------
def _gather(inputs, vocab_size, fingerprint, force, progress):
    """Spans of all inputs in order (oldest first) and the fingerprint they agree on."""
    parts, seen_fp = [], fingerprint
    for path in _progress(inputs, progress, "reading"):
        tokens, offsets, fp = read_spans(path, vocab_size=vocab_size, fingerprint=seen_fp, force=force,
                                         progress=progress)
        if fp is not None and seen_fp is not None and fp != seen_fp and not force:
            raise CorpusError(f"{path}: tokenizer fingerprint mismatch: {fp} vs {seen_fp} (--force to merge anyway)")
        seen_fp = seen_fp or fp
        parts.append((tokens, offsets))
    tokens, offsets = concat_flat(parts)
    return tokens, offsets, seen_fp


def build_corpus(inputs, out, *, vocab_size=None, fingerprint=None, force=False, fmt="binary",
                 progress=False) -> Corpus:
    """Build a corpus from inputs (text/binary corpora, JSONL, run logs; sources.py) and write it to `out`."""
    tokens, offsets, fp = _gather(list(inputs), vocab_size, fingerprint, force, progress)
    corpus = Corpus.from_flat(tokens, offsets, vocab_size=vocab_size, fingerprint=fp)
    corpus.save(out, fmt=fmt)
    corpus.path = os.fspath(out)
    return corpus


def merge_corpora(inputs, out, **kw) -> Corpus:
    """Concatenate corpora (later inputs are newer, so they win ties) into `out`. Same options as build."""
    return build_corpus(inputs, out, **kw)


def append_to_corpus(corpus_path, inputs, *, vocab_size=None, fingerprint=None, force=False,
                     progress=False) -> Corpus:
    """Add the spans of `inputs` to the corpus file at `corpus_path` (they become its newest spans).

    The existing corpus is loaded first (a malformed one, or one from another tokenizer, is refused before
    anything is written). A text corpus is appended to in place (:func:`redraft.corpus.format.append_text`: its
    bytes are never rewritten); a binary one holds one index, so it is rebuilt and replaced atomically.
    Returns the corpus as it now is. Raises CorpusError (the message names the file).
    """
    fmt = sniff(corpus_path)
    base = load_corpus(corpus_path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    vocab = vocab_size if vocab_size is not None else base.vocab_size
    tokens, offsets, fp = _gather(list(inputs), vocab, base.fingerprint or fingerprint, force, progress)
    spans = [tokens[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    if fmt == "text":
        append_text(corpus_path, spans)
        for span in spans:
            base.append(span)
        return base
    tokens, offsets = concat_flat([base.spans(), (tokens, offsets)])
    del base  # release the map before replacing the file
    corpus = Corpus.from_flat(tokens, offsets, vocab_size=vocab, fingerprint=fp)
    _replace(corpus, corpus_path, fmt)
    return corpus


def convert_corpus(src, out, *, to: str, vocab_size=None, fingerprint=None, force=False) -> Corpus:
    """Rewrite a corpus as text or binary; spans and ids are preserved exactly (empty spans are dropped)."""
    corpus = load_corpus(src, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    corpus.save(out, fmt=to)
    return corpus


def compact_corpus(path, *, vocab_size=None, fingerprint=None, force=False) -> Corpus:
    """Rebuild the corpus file at `path` with one fresh index, in its own format; or compact a corpus directory
    (a server's or the vLLM proposer's, see :mod:`redraft.corpus.directory`) into its next generation: one binary
    base folding every writer's journal, damaged records dropped (a damaged journal whose writer is gone is kept as
    ``.damaged``). Safe while servers and proposers write it: it takes the compaction lock as they do. Raises
    CorpusError naming the lock file when another process is compacting it now."""
    if os.path.isdir(path):
        d = resolve(path)
        meta_vocab, meta_fp = directory_meta(d)  # the base records the tokenizer the directory was made for
        vocab_size = vocab_size if vocab_size is not None else meta_vocab
        fingerprint = fingerprint if fingerprint is not None else meta_fp
        me = writer_id()
        if fold(d, me, lambda spans: (spans, 0), vocab_size=vocab_size, fingerprint=fingerprint) is None:
            raise CompactionLock(d, me).busy_error()
        return read_directory(d, vocab_size=vocab_size, fingerprint=fingerprint)[0]
    fmt = sniff(path)
    c = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    corpus = Corpus.from_flat(*c.spans(), vocab_size=c.vocab_size, fingerprint=c.fingerprint)
    del c
    _replace(corpus, path, fmt)
    return corpus


def _replace(corpus: Corpus, path, fmt: str) -> None:
    corpus.save(path, fmt=fmt)  # atomic (temporary file + rename): a failed write leaves the old file whole
    corpus.path = os.fspath(path)


def verify_corpus(path, *, vocab_size=None) -> dict:
    """Check a corpus file fully; the thorough counterpart of what opening it checks.

    Text: every token parses and every id is in range. Binary: the checksums of the header and of every array
    (version 2; opening checks them too), then the header counts and the whole index (suffix array, range-minimum
    table, search samples) rebuilt from the token stream and compared, which also catches a faulty writer.
    Costs a rebuild: O(n log n) time and ~10 bytes/token of memory (about a minute at 10^8 tokens).
    Returns {"path", "format", "version" (None for text), "n_tokens", "n_spans"}. Raises CorpusError naming the file
    and what is wrong.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        corpus, problems = read_directory(path, vocab_size=vocab_size)
        if problems:
            raise CorpusError(f"{path}: {len(problems)} damaged region(s), first: {problems[0]}; `redraft corpus "
                              f"compact {path}` keeps the valid records")
        return {"path": path, "format": "directory", "version": None, "n_tokens": corpus.n_tokens,
                "n_spans": corpus.n_spans}
    if sniff(path) == "text":
        tokens, offsets = read_text(path, vocab_size=vocab_size)
        return {"path": path, "format": "text", "version": None, "n_tokens": len(tokens),
                "n_spans": len(offsets) - 1}
    corpus = load_corpus(path, vocab_size=vocab_size, force=True)
    for seg in corpus.segments:
        tokens, offsets = seg.spans()
        counts = (seg.n_tokens, seg.n_spans, seg.max_id)
        if counts != (len(tokens), len(offsets) - 1, int(tokens.max())):
            raise CorpusError(f"{path}: the header's counts (tokens, spans, largest id) {counts} do not match the "
                              f"token stream; rebuild the corpus from its sources")
        fresh = SuffixIndex.build(tokens, offsets, seg.width)
        for name in ("sa", "table", "samples"):
            if not np.array_equal(getattr(seg, name), getattr(fresh, name)):
                raise CorpusError(f"{path}: the {SECTIONS[name]} does not match the token stream (written by a "
                                  f"faulty tool?); rebuild the index with `redraft corpus compact {path}`")
    return {"path": path, "format": "binary", "version": binary_version(path), "n_tokens": corpus.n_tokens,
            "n_spans": corpus.n_spans}


def distinct_ngrams(tokens: np.ndarray, offsets: np.ndarray, n: int) -> int:
    """Number of distinct n-grams inside spans (never across a separator), by 64-bit polynomial hashing.

    tokens: int64 [N]; offsets: int64 [n_spans + 1]. Collisions are possible but negligible at these sizes.
    """
    if len(tokens) < n:
        return 0
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    mult = np.uint64(0x9E3779B97F4A7C15)
    for j in range(n):
        h = h * mult + tokens[j:len(tokens) - n + 1 + j].astype(np.uint64) + np.uint64(1)
    # A window starting at i stays in its span iff i + n <= end of that span.
    span_end = np.repeat(offsets[1:], np.diff(offsets))[: len(h)]
    keep = np.arange(len(h)) + n <= span_end
    return int(len(np.unique(h[keep])))


def corpus_stats(path, *, vocab_size=None, fingerprint=None, force=False, top: int = 5,
                 ngram_sizes=(1, 3, 8)) -> dict:
    """Corpus.stats() plus file bytes/token, distinct n-grams and the most repeated whole spans (a corpus directory:
    its valid spans, the bytes of its files, and ``problems``, the damaged regions skipped)."""
    if os.path.isdir(path):
        corpus, problems = read_directory(path, vocab_size=vocab_size, fingerprint=fingerprint)
        out = corpus.stats()
        out["format"], out["problems"] = "directory", len(problems)
        out["generation"] = current_generation(resolve(path)).number
        out["writers"] = writers(path, vocab_size=vocab_size)
        d = resolve(path)
        out["file_bytes"] = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    else:
        corpus = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
        out = corpus.stats()
        out["format"] = sniff(path)
        out["file_bytes"] = os.path.getsize(path)
    out["file_bytes_per_token"] = out["file_bytes"] / out["n_tokens"] if out["n_tokens"] else 0.0
    tokens, offsets = corpus.spans()
    out["distinct_ngrams"] = {n: distinct_ngrams(tokens, offsets, n) for n in ngram_sizes}
    counts = Counter(tokens[a:b].tobytes() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    out["top_repeated_spans"] = [
        {"count": c, "length": len(key) // 8, "head": np.frombuffer(key, dtype=np.int64)[:8].tolist()}
        for key, c in counts.most_common(top) if c > 1
    ]
    return out


# ---- helpers ----------------------------------------------------------------------------------------------------
def _progress(items, enabled, desc):
    if not enabled or len(items) < 2:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, delay=1.0, disable=None)
