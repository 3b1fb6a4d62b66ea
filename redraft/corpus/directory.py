"""The corpus directory: one on-disk layout for every writer of learned spans (numpy only).

``redraft serve --corpus-dir D`` and the vLLM proposer (``REDRAFT_LEARN_CORPUS=D``) both keep their learned spans
here, so either drafts from what the other learned:

    D/meta.json          {"fingerprint": tokenizer fingerprint or null, "vocab_size": int}
    D/<tenant>/          one tenant's OnlineCorpus: base-G.bin (binary corpus) + journal-G.rdj (checksummed
                         records), see :mod:`redraft.corpus.online` and :mod:`redraft.corpus.journal`

The proposer and an open server learn into ``D/default`` unless told another tenant. One process writes a tenant's
directory at a time: two writers would each compact it into their own generation.
"""

from __future__ import annotations

import json
import os
import re

from .corpus import Corpus, load_corpus
from .errors import CorpusError
from .journal import read_journal

META = "meta.json"
DEFAULT_TENANT = "default"
GENERATION_FILE = re.compile(r"^(base|journal)-(\d{6,})\.(bin|rdj)$")
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a tenant's name is its directory's name


def check_meta(directory, vocab_size: int, fingerprint: str | None) -> None:
    """Create ``directory`` and its meta.json, or check that an existing one was made for this tokenizer.

    A fingerprint of None (the writer could not read its tokenizer) matches any; the vocabulary size must always
    agree. Raises CorpusError naming the directory: it cannot be created or read, meta.json is not JSON, or it
    records another tokenizer.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, META)
    want = {"fingerprint": fingerprint, "vocab_size": vocab_size}
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(want, f)
            return
        with open(path, encoding="utf-8") as f:
            have = json.load(f)
    except OSError as e:
        raise CorpusError(f"{directory}: cannot use it as a corpus directory ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise CorpusError(f"{directory}: {META} is not valid JSON ({e})") from e
    ok = isinstance(have, dict) and have.get("vocab_size") == vocab_size and (
        fingerprint is None or have.get("fingerprint") in (None, fingerprint))
    if not ok:
        raise CorpusError(f"{directory} was made for another tokenizer ({META}: {have}, this model: {want}); "
                          f"use another directory")


def tenant_dir(root, tenant: str = DEFAULT_TENANT) -> str:
    """Where a tenant's OnlineCorpus lives under a corpus directory."""
    return os.path.join(os.fspath(root), tenant)


def is_generation_dir(path) -> bool:
    """Whether ``path`` is a directory holding an OnlineCorpus generation (a journal or a binary base)."""
    try:
        return any(GENERATION_FILE.match(n) for n in os.listdir(path))
    except OSError:
        return False


def resolve(path) -> str:
    """The OnlineCorpus directory a path names: itself when it holds a generation, else its default tenant's
    directory when it is a corpus directory (has meta.json). Raises CorpusError otherwise."""
    path = os.fspath(path)
    if is_generation_dir(path):
        return path
    if os.path.isfile(os.path.join(path, META)):
        return tenant_dir(path)
    raise CorpusError(f"{path}: not a corpus directory (expected {META} from `redraft serve --corpus-dir`, or a "
                      f"tenant's journal-*.rdj / base-*.bin)")


def read_directory(path, *, vocab_size: int | None = None, fingerprint: str | None = None
                   ) -> tuple[Corpus, list[str]]:
    """Read a corpus directory (or one tenant's) without changing it: its newest generation's binary base plus the
    journal's valid records, oldest first, as one Corpus; and one line per problem skipped (a torn or corrupt
    journal record, an unreadable base). An empty tenant directory gives an empty corpus.

    Raises CorpusError when ``path`` is not a corpus directory; OSError when a file cannot be read.
    """
    d = resolve(path)
    gens = [int(m.group(2)) for m in map(GENERATION_FILE.match, _listdir(d)) if m and m.group(1) == "journal"]
    gen = max(gens, default=0)
    problems: list[str] = []
    segments = []
    base = os.path.join(d, f"base-{gen:06d}.bin")
    if os.path.exists(base):
        try:
            segments += load_corpus(base, vocab_size=vocab_size, fingerprint=fingerprint).segments
        except CorpusError as e:
            problems.append(f"{base}: binary base unreadable ({e}); its spans are not used")
    replay = read_journal(os.path.join(d, f"journal-{gen:06d}.rdj"), vocab_size=vocab_size)
    problems += replay.problems
    tail = Corpus.from_spans(replay.spans, vocab_size=vocab_size, fingerprint=fingerprint)
    return Corpus(segments + list(tail.segments), path=d, vocab_size=vocab_size, fingerprint=fingerprint), problems


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
