"""`redraft corpus build|append|merge|stats|convert|compact|verify`: corpus file tools (no model loading).

Each tool is a plain function (usable from Python) plus an argparse subcommand registered by
add_corpus_subparser(); every subcommand sets `func`, which returns an exit code (0 ok, 2 bad input).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np

from .corpus import Corpus, _concat_flat
from .errors import CorpusError
from .format import SECTIONS, binary_version, load_corpus, read_text, sniff
from .index import SuffixIndex
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
    tokens, offsets = _concat_flat(parts)
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
    """Add the spans of `inputs` to the corpus file at `corpus_path` (newest), rewriting it in its own format."""
    fmt = sniff(corpus_path)
    base = load_corpus(corpus_path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    vocab = vocab_size if vocab_size is not None else base.vocab_size
    tokens, offsets, fp = _gather([corpus_path, *inputs], vocab, base.fingerprint or fingerprint, force, progress)
    del base  # release the map before rewriting the file
    corpus = Corpus.from_flat(tokens, offsets, vocab_size=vocab, fingerprint=fp)
    _replace(corpus, corpus_path, fmt)
    return corpus


def convert_corpus(src, out, *, to: str, vocab_size=None, fingerprint=None, force=False) -> Corpus:
    """Rewrite a corpus as text or binary; spans and ids are preserved exactly (empty spans are dropped)."""
    corpus = load_corpus(src, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    corpus.save(out, fmt=to)
    return corpus


def compact_corpus(path, *, vocab_size=None, fingerprint=None, force=False) -> Corpus:
    """Rebuild the corpus file at `path` with one fresh index, in its own format."""
    fmt = sniff(path)
    c = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    corpus = Corpus.from_flat(*c.spans(), vocab_size=c.vocab_size, fingerprint=c.fingerprint)
    del c
    _replace(corpus, path, fmt)
    return corpus


def _replace(corpus: Corpus, path, fmt: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    corpus.save(tmp, fmt=fmt)
    os.replace(tmp, path)
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
    """Corpus.stats() plus file bytes/token, distinct n-grams and the most repeated whole spans."""
    corpus = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    out = corpus.stats()
    out["format"] = sniff(path)
    out["file_bytes"] = os.path.getsize(path)
    out["file_bytes_per_token"] = out["file_bytes"] / out["n_tokens"] if out["n_tokens"] else 0.0
    tokens, offsets = corpus.spans()
    out["distinct_ngrams"] = {n: distinct_ngrams(tokens, offsets, n) for n in ngram_sizes}
    counts = Counter(tokens[a:b].tobytes() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    out["top_repeated_spans"] = [
        {"count": c, "length": len(key) // 8, "head": np.frombuffer(key, dtype=np.int64)[:8].tolist()}
        for key, c in counts.most_common(top) if c > 1
    ]
    return out


# ---- command line -----------------------------------------------------------------------------------------------
def _progress(items, enabled, desc):
    if not enabled or len(items) < 2:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, delay=1.0)


def _common(p: argparse.ArgumentParser, fingerprint: bool = True) -> None:
    p.add_argument("--vocab-size", type=int, default=None, help="refuse ids >= this vocabulary size")
    if fingerprint:
        p.add_argument("--fingerprint", default=None,
                       help="tokenizer fingerprint to record / check (see redraft.corpus.tokenizer_fingerprint)")
        p.add_argument("--force", action="store_true", help="accept a tokenizer fingerprint mismatch")


def _guard(fn):
    """Turn CorpusError into a one-line message and exit code 2."""

    def run(args) -> int:
        try:
            return fn(args) or 0
        except CorpusError as e:
            print(f"redraft corpus: error: {e}", file=sys.stderr)
            return 2

    return run


def _say(corpus: Corpus, verb: str, path) -> None:
    s = corpus.stats()
    print(f"{verb} {path}: {s['n_tokens']:,} tokens in {s['n_spans']:,} spans "
          f"({s['bytes_per_token']:.2f} bytes/token resident)")
    if s["n_tokens"] == 0:
        print("note: the corpus is empty; it will never propose anything", file=sys.stderr)


@_guard
def _cmd_build(args) -> int:
    c = build_corpus(args.inputs, args.out, vocab_size=args.vocab_size, fingerprint=args.fingerprint,
                     force=args.force, fmt=args.format, progress=not args.quiet)
    _say(c, "built", args.out)


@_guard
def _cmd_append(args) -> int:
    c = append_to_corpus(args.corpus, args.inputs, vocab_size=args.vocab_size, fingerprint=args.fingerprint,
                         force=args.force, progress=not args.quiet)
    _say(c, "appended to", args.corpus)


@_guard
def _cmd_merge(args) -> int:
    c = merge_corpora(args.inputs, args.out, vocab_size=args.vocab_size, fingerprint=args.fingerprint,
                      force=args.force, progress=not args.quiet)
    _say(c, "merged into", args.out)


@_guard
def _cmd_stats(args) -> int:
    s = corpus_stats(args.corpus, vocab_size=args.vocab_size, top=args.top)
    print(f"corpus:        {args.corpus} ({s['format']})")
    print(f"tokens:        {s['n_tokens']:,} in {s['n_spans']:,} spans")
    print(f"vocab size:    {s['vocab_size']}")
    print(f"fingerprint:   {s['fingerprint']}")
    print(f"bytes/token:   {s['file_bytes_per_token']:.2f} on disk, {s['bytes_per_token']:.2f} resident "
          f"(tokens + index, {s['token_width']}-byte ids)")
    grams = ", ".join(f"{n}-grams {v:,}" for n, v in s["distinct_ngrams"].items())
    print(f"distinct:      {grams}")
    if s["top_repeated_spans"]:
        print("top repeated spans:")
        for r in s["top_repeated_spans"]:
            head = " ".join(map(str, r["head"])) + (" ..." if r["length"] > len(r["head"]) else "")
            print(f"  {r['count']:>6}x  {r['length']:>6} ids  {head}")
    else:
        print("top repeated spans: none (every span is unique)")


@_guard
def _cmd_convert(args) -> int:
    c = convert_corpus(args.input, args.out, to=args.to, vocab_size=args.vocab_size, fingerprint=args.fingerprint,
                       force=args.force)
    _say(c, f"wrote {args.to}", args.out)


@_guard
def _cmd_compact(args) -> int:
    c = compact_corpus(args.corpus, vocab_size=args.vocab_size, fingerprint=args.fingerprint, force=args.force)
    _say(c, "compacted", args.corpus)


def add_corpus_subparser(subparsers) -> argparse.ArgumentParser:
    """Register `corpus` with subcommands build / append / merge / stats / convert / compact on `subparsers`.

    Each subcommand sets `func(args) -> int`. Returns the `corpus` parser.
    """
    corpus = subparsers.add_parser("corpus", help="build and inspect frozen-corpus files",
                                   description=__doc__.split("\n\n")[0])
    sub = corpus.add_subparsers(dest="corpus_command", metavar="COMMAND")
    corpus.set_defaults(func=lambda args: (corpus.print_help(), 2)[1])

    p = sub.add_parser("build", help="build a corpus from text/binary corpora, JSONL token records or run logs")
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--out", "-o", required=True, metavar="CORPUS")
    p.add_argument("--format", choices=("binary", "text"), default="binary")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    _common(p)
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("append", help="append the spans of INPUT(s) to CORPUS (rewrites it in place)")
    p.add_argument("corpus", metavar="CORPUS")
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--quiet", "-q", action="store_true")
    _common(p)
    p.set_defaults(func=_cmd_append)

    p = sub.add_parser("merge", help="merge corpora (later ones are newer)")
    p.add_argument("inputs", nargs="+", metavar="CORPUS")
    p.add_argument("--out", "-o", required=True)
    p.add_argument("--quiet", "-q", action="store_true")
    _common(p)
    p.set_defaults(func=_cmd_merge)

    p = sub.add_parser("stats", help="tokens, spans, distinct n-grams, repeated spans, bytes/token, fingerprint")
    p.add_argument("corpus", metavar="CORPUS")
    p.add_argument("--top", type=int, default=5, help="how many repeated spans to list")
    _common(p, fingerprint=False)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("convert", help="convert between text and binary (lossless)")
    p.add_argument("input", metavar="IN")
    p.add_argument("--out", "-o", required=True, metavar="OUT")
    p.add_argument("--to", choices=("text", "binary"), required=True)
    _common(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("compact", help="rebuild CORPUS with one fresh index")
    p.add_argument("corpus", metavar="CORPUS")
    _common(p)
    p.set_defaults(func=_cmd_compact)
    _add_verify_parser(sub)
    return corpus


def _add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="check CORPUS fully: checksums, and the index rebuilt from the token stream")
    p.add_argument("corpus", metavar="CORPUS")
    _common(p, fingerprint=False)
    p.set_defaults(func=_cmd_verify)


@_guard
def _cmd_verify(args) -> int:
    r = verify_corpus(args.corpus, vocab_size=args.vocab_size)
    what = f"binary corpus version {r['version']}" if r["format"] == "binary" else "text corpus"
    print(f"ok {args.corpus}: {what}, {r['n_tokens']:,} tokens in {r['n_spans']:,} spans")


def main(argv=None) -> int:
    """`python -m redraft.corpus.tools corpus ...` without the main CLI."""
    parser = argparse.ArgumentParser(prog="redraft")
    add_corpus_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
