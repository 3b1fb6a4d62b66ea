"""Reading spans from the files the tools accept: corpora (text or binary), JSONL records and run logs.

The kind is detected by content, not by file name:
  - binary corpus: starts with b"RDCORPUS";
  - JSONL: first non-blank byte is '{'; each record gives one span: its "prompt_tokens" (if present) followed by
    its "tokens";
  - run log: contains "[TOKENS]" lines as printed by `redraft run --tokens` ("[TOKENS] N generated: ids..."),
    one span per line, preceded by the ids of the "[PROMPT_TOKENS] N: ids..." line just before it, if any;
    other lines are ignored.

A span is prompt + output everywhere (as `redraft freeze` writes it), so a replayed prompt is matched from its
first generated token on.
  - otherwise a text corpus (whitespace-separated ids, -1 between spans);
  - a directory: a corpus directory (``redraft serve --corpus-dir``, the vLLM proposer's REDRAFT_LEARN_CORPUS; its
    default tenant) or one tenant's directory: the valid spans of its binary base and journal.
"""

from __future__ import annotations

import json
import os
import re
from typing import TypeGuard

import numpy as np

from .corpus import check_ids, load_corpus, spans_to_flat
from .directory import read_directory
from .errors import CorpusError
from .format import MAGIC, read_text

_TOKENS_LINE = re.compile(rb"\[TOKENS\]\s+(\d+)\s+generated:(.*)")
_PROMPT_LINE = re.compile(rb"\[PROMPT_TOKENS\]\s+(\d+):(.*)")


def detect_kind(path) -> str:
    """'binary', 'jsonl', 'log' or 'text' (see the module doc). Raises CorpusError if unreadable, or not a regular
    file: a pipe or device would lose the head read here before :func:`read_spans` reads it again."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise CorpusError(f"{path}: not a regular file (a pipe or device cannot be read twice); save it to a file "
                          f"first (the redraft corpus commands take '-' for stdin)")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror or e})") from e
    if head.startswith(MAGIC):
        return "binary"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    if b"[TOKENS]" in head:
        return "log"
    return "text"


def read_spans(path, *, vocab_size: int | None = None, fingerprint: str | None = None, force: bool = False,
               progress: bool = False) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Spans of any accepted input: (tokens int64 [n], offsets int64 [n_spans + 1], fingerprint or None).

    Raises CorpusError naming the file (and line, for JSONL and logs) on malformed input or out-of-vocab ids.
    """
    path = os.fspath(path)
    if os.path.isdir(path):  # a corpus directory (redraft serve --corpus-dir, the vLLM proposer's): its valid spans
        corpus, _ = read_directory(path, vocab_size=vocab_size, fingerprint=fingerprint)
        tokens, offsets = corpus.spans()
        return tokens, offsets, None
    kind = detect_kind(path)
    if kind == "binary":
        c = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
        tokens, offsets = c.spans()
        return tokens, offsets, c.fingerprint
    if kind == "text":
        tokens, offsets = read_text(path, vocab_size=vocab_size, progress=progress)
        return tokens, offsets, None
    spans = read_jsonl(path) if kind == "jsonl" else read_log(path)
    tokens, offsets = spans_to_flat(spans)
    check_ids(tokens, vocab_size, path)
    return tokens, offsets, None


def read_jsonl(path) -> list[list[int]]:
    """One span per JSON record: "prompt_tokens" (optional) + "tokens". CorpusError with the line on a bad record."""
    spans = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise CorpusError(f"{path}:{lineno}: not a JSON record ({e})") from e
            tokens = record.get("tokens") if isinstance(record, dict) else None
            prompt = record.get("prompt_tokens", []) if isinstance(record, dict) else None
            if not _int_list(tokens):
                raise CorpusError(f"{path}:{lineno}: record has no \"tokens\" list of integer ids")
            if not _int_list(prompt):
                raise CorpusError(f"{path}:{lineno}: \"prompt_tokens\" is not a list of integer ids")
            spans.append(prompt + tokens)
    return spans


def _int_list(x) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def read_log(path) -> list[list[int]]:
    """One span per "[TOKENS] N generated: ids..." line, prefixed by the preceding "[PROMPT_TOKENS] N: ids..." line.

    Raises CorpusError (with line) when a line's id count differs from N or an id is not an integer.
    """
    spans = []
    prompt: list[int] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            m = _TOKENS_LINE.search(line)
            if not m:
                pm = _PROMPT_LINE.search(line)
                if pm:
                    prompt = _log_ids(pm, path, lineno, "[PROMPT_TOKENS]")
                continue
            spans.append(prompt + _log_ids(m, path, lineno, "[TOKENS]"))
            prompt = []
    return spans


def _log_ids(m, path, lineno: int, what: str) -> list[int]:
    words = m.group(2).replace(b",", b" ").split()
    try:
        ids = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not re.fullmatch(rb"-?\d+", w))
        raise CorpusError(f"{path}:{lineno}: token {bad.decode('utf-8', 'replace')!r} is not an integer") from None
    if len(ids) != int(m.group(1)):
        raise CorpusError(f"{path}:{lineno}: line says {int(m.group(1))} ids but has "
                          f"{len(ids)} (truncated {what} line?)")
    return ids
