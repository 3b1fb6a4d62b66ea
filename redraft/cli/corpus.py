"""``redraft corpus build|append|merge|stats|convert|compact|verify``: corpus file tools (no model loading).

Each sub-command wraps a function of :mod:`redraft.corpus.tools` and sets ``func``, which returns an exit code
(0 ok, 2 bad input).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager, nullcontext

from redraft.cli.common import nonneg, output_file, positive
from redraft.corpus import Corpus, CorpusError
from redraft.corpus.tools import (
    append_to_corpus,
    build_corpus,
    compact_corpus,
    convert_corpus,
    corpus_stats,
    merge_corpora,
    verify_corpus,
)


def _common(p: argparse.ArgumentParser, fingerprint: bool = True) -> None:
    p.add_argument("--vocab-size", type=positive, default=None,
                   help="refuse ids >= this vocabulary size (default: no check)")
    if fingerprint:
        p.add_argument("--fingerprint", default=None,
                       help="tokenizer fingerprint to record / check (see redraft.corpus.tokenizer_fingerprint; "
                            "default: none)")
        p.add_argument("--force", action="store_true", help="accept a tokenizer fingerprint mismatch")


INPUT_HELP = ("text or binary corpus, JSONL records with a 'tokens' list (and 'prompt_tokens'), a log of "
              "'redraft run --tokens', or a corpus directory (redraft serve --corpus-dir); the kind is detected by "
              "content; '-' reads stdin (a pipe is read once)")


@contextmanager
def _regular_files(paths: list[str]):
    """``paths`` as regular files: ``-`` (stdin) and pipes or devices (``/dev/stdin``, ``<(cmd)``) are copied once
    into a temporary file, because the readers detect a file's kind from its head and then read it again, which a
    pipe does not survive (it would give an empty corpus). Yields (paths, {copy: the name to show in messages})."""
    with tempfile.TemporaryDirectory(prefix="redraft-corpus-") as tmp:
        out, names = [], {}
        for i, path in enumerate(paths):
            if path != "-" and (os.path.isfile(path) or not os.path.exists(path) or os.path.isdir(path)):
                out.append(path)  # the readers report a missing file or a directory themselves
                continue
            copy = os.path.join(tmp, f"input{i}")
            names[copy] = "stdin" if path == "-" else path
            try:
                with (nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb")) as src, \
                        open(copy, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except OSError as e:
                raise CorpusError(f"{names[copy]}: cannot read ({e.strerror or e})") from e
            out.append(copy)
        yield out, names


def _guard(fn):
    """Run a sub-command with its INPUTs as regular files (:func:`_regular_files`); turn CorpusError into a
    one-line message (naming the input as given) and exit code 2."""

    def run(args) -> int:
        names = {}
        try:
            with _regular_files(getattr(args, "inputs", None) or []) as (inputs, names):
                if names:
                    args.inputs = inputs
                return fn(args) or 0
        except CorpusError as e:
            msg = str(e)
            for copy, name in names.items():
                msg = msg.replace(copy, name)
            print(f"redraft corpus: error: {msg}", file=sys.stderr)
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
    if s.get("problems"):
        print(f"damaged:       {s['problems']} region(s) skipped (redraft corpus verify lists the first)")
    print(f"tokens:        {s['n_tokens']:,} in {s['n_spans']:,} spans")
    print(f"vocab size:    {s['vocab_size']}")
    print(f"fingerprint:   {s['fingerprint']}")
    print(f"bytes/token:   {s['file_bytes_per_token']:.2f} on disk, {s['bytes_per_token']:.2f} resident "
          f"(tokens + index, {s['token_width']}-byte ids)")
    grams = ", ".join(f"{n}-grams {v:,}" for n, v in s["distinct_ngrams"].items())
    print(f"distinct:      {grams}")
    if s.get("writers") is not None:
        print(f"generation:    {s['generation']}; {len(s['writers'])} journal(s) past its base:")
        for w in s["writers"]:
            who = f"{w['writer']} (pid {w['pid']} on {w['host']})" if w["writer"] else "single-writer journal"
            state = "writing" if w["live"] else "gone"
            bad = f", {w['problems']} damaged region(s)" if w["problems"] else ""
            print(f"  {w['journal']}: {who}, {state}; {w['spans']:,} spans / {w['tokens']:,} ids not yet in the "
                  f"base, {w['bytes']:,} bytes ({w['folded_bytes']:,} folded){bad}")
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


@_guard
def _cmd_verify(args) -> int:
    r = verify_corpus(args.corpus, vocab_size=args.vocab_size)
    what = {"binary": f"binary corpus version {r['version']}", "text": "text corpus",
            "directory": "corpus directory, every record's checksum"}[r["format"]]
    print(f"ok {args.corpus}: {what}, {r['n_tokens']:,} tokens in {r['n_spans']:,} spans")


def register(subparsers) -> argparse.ArgumentParser:
    """Register `corpus` with subcommands build / append / merge / stats / convert / compact / verify.

    Each subcommand sets `func(args) -> int`. Returns the `corpus` parser.
    """
    corpus = subparsers.add_parser("corpus", help="build and inspect frozen-corpus files",
                                   description="Corpus file tools (no model loading): build, append, merge, stats, "
                                               "convert, compact, verify.")
    sub = corpus.add_subparsers(dest="corpus_command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("build", help="build a corpus from text/binary corpora, JSONL token records or run logs")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUT_HELP)
    p.add_argument("--out", "-o", required=True, metavar="CORPUS", type=output_file,
                   help="corpus file to write (replaced atomically if it exists)")
    p.add_argument("--format", choices=("binary", "text"), default="binary",
                   help="binary (indexed, mmap-able; default) or text (whitespace-separated ids, -1 between spans)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    _common(p)
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("append", help="append the spans of INPUT(s) to CORPUS (a text corpus grows in place, a "
                                      "binary one is rebuilt)")
    p.add_argument("corpus", metavar="CORPUS", help="existing corpus file to extend (its format is kept)")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUT_HELP)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    _common(p)
    p.set_defaults(func=_cmd_append)

    p = sub.add_parser("merge", help="merge corpora (later ones are newer)")
    p.add_argument("inputs", nargs="+", metavar="CORPUS", help="corpora to merge, oldest first (later ones win ties)")
    p.add_argument("--out", "-o", required=True, metavar="CORPUS", type=output_file,
                   help="binary corpus file to write (replaced atomically if it exists)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    _common(p)
    p.set_defaults(func=_cmd_merge)

    p = sub.add_parser("stats", help="tokens, spans, distinct n-grams, repeated spans, bytes/token, fingerprint")
    p.add_argument("corpus", metavar="CORPUS", help="corpus file (text or binary) or corpus directory (redraft serve "
                                                    "--corpus-dir, the vLLM proposer's REDRAFT_LEARN_CORPUS)")
    p.add_argument("--top", type=nonneg, default=5, help="how many repeated spans to list (default 5)")
    _common(p, fingerprint=False)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("convert", help="convert between text and binary (lossless)")
    p.add_argument("input", metavar="IN", help="corpus file to read (text or binary)")
    p.add_argument("--out", "-o", required=True, metavar="OUT", type=output_file,
                   help="corpus file to write (replaced atomically if it exists)")
    p.add_argument("--to", choices=("text", "binary"), required=True, help="format of OUT")
    _common(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("compact", help="rebuild CORPUS with one fresh index")
    p.add_argument("corpus", metavar="CORPUS", help="corpus file to rewrite in place, atomically (format kept), or "
                                                    "corpus directory to compact into one binary base (not while a "
                                                    "server or proposer writes it)")
    _common(p)
    p.set_defaults(func=_cmd_compact)

    p = sub.add_parser("verify", help="check CORPUS fully: checksums, and the index rebuilt from the token stream")
    p.add_argument("corpus", metavar="CORPUS", help="corpus file (text or binary) or corpus directory (every journal "
                                                    "record's checksum)")
    _common(p, fingerprint=False)
    p.set_defaults(func=_cmd_verify)
    return corpus
