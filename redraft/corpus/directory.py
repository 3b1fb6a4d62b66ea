"""The corpus directory: one on-disk layout for every writer of learned spans (numpy only).

``redraft serve --corpus-dir D`` and the vLLM proposer (``REDRAFT_LEARN_CORPUS=D``) both keep their learned spans
here, so either drafts from what the other learned:

    D/meta.json          {"fingerprint": tokenizer fingerprint or null, "vocab_size": int}
    D/<tenant>/          one tenant's OnlineCorpus (:mod:`redraft.corpus.online`):
        generation-G.json    the current generation G: {"generation", "base", "folded": {journal: bytes}}
        base-G.bin           the binary corpus compacted at generation G (absent while empty)
        journal-W.rdj        writer W's checksummed records (:mod:`redraft.corpus.journal`), one per process;
        journal-W.N.rdj      its Nth segment, begun once a generation folded at least half of the one before
        journal-W[.N].json   who wrote that segment: {"writer", "host", "pid", "started", "segment", "fingerprint",
                             "vocab_size"}
        compact.lock         held by the one writer compacting now (:mod:`redraft.corpus.lease`)

A tenant's spans are the base's followed by each journal's records past the bytes its generation folded into the
base. Any number of processes write one tenant directory, each to its own journal; each reads the others' journals
as they grow. The generation file is the commit point of a compaction: written (atomically) after its base, and
only then are the previous generation's files and the fully folded journals of writers that are gone removed.
A live writer's folded segment counts as gone once it rotated: it closes it (its records past the fold are still
read from it by name and byte offset, like any journal's) and the next compaction folds the rest and removes it, so
a live writer keeps at most two segments (:mod:`redraft.corpus.segments`).
A directory of the single-writer layout (``base-G.bin`` + ``journal-G.rdj``, no generation file) reads as
generation G with that journal unfolded; its first compaction moves it to this layout.

The proposer and an open server learn into ``D/default`` unless told another tenant.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from redraft.io.atomic import atomic_path

from .corpus import Corpus, load_corpus
from .errors import CorpusError
from .journal import has_live_writer, read_tail

META = "meta.json"
DEFAULT_TENANT = "default"
GENERATION_FILE = re.compile(r"^(base|journal)-(\d{6,})\.(bin|rdj)$")  # the single-writer layout's files
MANIFEST_FILE = re.compile(r"^generation-(\d{6,})\.json$")
JOURNAL_FILE = re.compile(r"^journal-([A-Za-z0-9_.-]+)\.rdj$")
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a tenant's name is its directory's name


def check_meta(directory, vocab_size: int, fingerprint: str | None) -> None:
    """Create ``directory`` and its meta.json, or check that an existing one was made for this tokenizer.

    A fingerprint of None (the writer could not read its tokenizer) matches any; the vocabulary size must always
    agree. Raises CorpusError naming the directory: it is a file, cannot be created or read, meta.json is not JSON, or it
    records another tokenizer.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, META)
    want = {"fingerprint": fingerprint, "vocab_size": vocab_size}
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CorpusError(f"{directory} is a file, not a directory; a corpus directory is expected (created if missing)")
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(want, f)
            return
        with open(path, encoding="utf-8") as f:
            have = json.load(f)
    except OSError as e:
        where = f" on {e.filename}" if e.filename else ""
        raise CorpusError(f"{directory}: cannot use it as a corpus directory ({e.strerror or e}{where}; a writable "
                          "directory is expected, created if missing)") from e
    except json.JSONDecodeError as e:
        raise CorpusError(f"{directory}: {META} is not valid JSON ({e})") from e
    ok = isinstance(have, dict) and have.get("vocab_size") == vocab_size and (
        fingerprint is None or have.get("fingerprint") in (None, fingerprint))
    if not ok:
        raise CorpusError(f"{directory} was made for another tokenizer ({META}: {have}, this model: {want}); "
                          f"use another directory")


def directory_meta(path) -> tuple[int | None, str | None]:
    """(vocab_size, fingerprint) of the corpus directory ``path`` is or belongs to (its ``meta.json``, in
    ``path`` or its parent); (None, None) when there is none or it cannot be read."""
    path = os.fspath(path)
    for d in (path, os.path.dirname(os.path.abspath(path))):
        try:
            with open(os.path.join(d, META), encoding="utf-8") as f:
                have = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(have, dict):
            return have.get("vocab_size"), have.get("fingerprint")
    return None, None


def tenant_dir(root, tenant: str = DEFAULT_TENANT) -> str:
    """Where a tenant's OnlineCorpus lives under a corpus directory."""
    return os.path.join(os.fspath(root), tenant)


def is_generation_dir(path) -> bool:
    """Whether ``path`` is a directory holding an OnlineCorpus generation (a generation file, a journal or a
    binary base)."""
    try:
        return any(GENERATION_FILE.match(n) or MANIFEST_FILE.match(n) or JOURNAL_FILE.match(n)
                   for n in os.listdir(path))
    except OSError:
        return False


@dataclass
class Generation:
    """A tenant directory's current generation: ``number``, its ``base`` file name (None: no base), and
    ``folded``: per journal file name, the bytes of it already in the base (a journal not listed: none)."""

    number: int = 0
    base: str | None = None
    folded: dict[str, int] = field(default_factory=dict)


def base_name(number: int) -> str:
    return f"base-{number:06d}.bin"


def manifest_name(number: int) -> str:
    return f"generation-{number:06d}.json"


def current_generation(d: str) -> Generation:
    """The newest generation of tenant directory ``d`` (empty generation 0 when it has none; a single-writer
    directory's newest ``journal-G.rdj`` and ``base-G.bin`` otherwise). Raises OSError when it cannot be listed."""
    names = _listdir(d)
    numbers = sorted((int(m.group(1)) for m in map(MANIFEST_FILE.match, names) if m), reverse=True)
    for n in numbers:
        try:
            with open(os.path.join(d, manifest_name(n)), encoding="utf-8") as f:
                got = json.load(f)
            return Generation(n, got.get("base"), {str(k): int(v) for k, v in got.get("folded", {}).items()})
        except FileNotFoundError:
            continue  # removed by a compaction that just committed a newer one: read the newer one
        except (OSError, ValueError, AttributeError) as e:
            raise CorpusError(f"{os.path.join(d, manifest_name(n))}: unreadable generation file ({e})") from e
    legacy = [int(m.group(2)) for m in map(GENERATION_FILE.match, names) if m and m.group(1) == "journal"]
    g = max(legacy, default=0)
    return Generation(g, base_name(g) if base_name(g) in names else None, {})


def write_generation(d: str, gen: Generation) -> None:
    """Commit ``gen`` (atomically: it is complete or absent). Raises OSError."""
    with atomic_path(os.path.join(d, manifest_name(gen.number))) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"generation": gen.number, "base": gen.base, "folded": gen.folded}, f)


def journal_files(d: str, gen: Generation) -> list[str]:
    """The journal file names whose records count in generation ``gen``, oldest segment of each writer first
    (:func:`journal_order`): every writer's, and a single-writer directory's ``journal-G.rdj`` while it is not
    folded away."""
    out = []
    for n in sorted(_listdir(d), key=journal_order):
        m = JOURNAL_FILE.match(n)
        if not m:
            continue
        legacy = GENERATION_FILE.match(n)
        if legacy and int(legacy.group(2)) != gen.number and n not in gen.folded:
            continue  # a single-writer directory's leftover of an older or unfinished generation
        out.append(n)
    return out


def journal_order(name: str) -> tuple:
    """Sort key of journal file names: by their dot-separated parts, numbers compared as numbers, so a writer's
    ``journal-W.rdj`` comes before its ``journal-W.2.rdj``, which comes before ``journal-W.10.rdj``."""
    stem = name[:-len(".rdj")] if name.endswith(".rdj") else name
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in stem.split("."))


def journal_identity(d: str, journal: str) -> dict:
    """The ``journal-W.json`` next to a journal (``{}`` when it has none, e.g. a single-writer journal)."""
    try:
        with open(os.path.join(d, journal[:-len(".rdj")] + ".json"), encoding="utf-8") as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def check_identity(d: str, journal: str, vocab_size: int | None, fingerprint: str | None) -> str | None:
    """Why ``journal``'s records cannot be read with this tokenizer (None: they can), naming the file."""
    ident = journal_identity(d, journal)
    theirs_fp, theirs_v = ident.get("fingerprint"), ident.get("vocab_size")
    if (vocab_size is not None and theirs_v is not None and theirs_v != vocab_size) or (
            fingerprint is not None and theirs_fp is not None and theirs_fp != fingerprint):
        return (f"{os.path.join(d, journal)} was written for another tokenizer (fingerprint {theirs_fp}, vocabulary "
                f"{theirs_v}; this model: {fingerprint}, {vocab_size}); its records are not used")
    return None


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
    """Read a corpus directory (or one tenant's) without changing it: its current generation's binary base plus
    every journal's valid records past what the base folded, as one Corpus; and one line per problem skipped (a
    torn or corrupt journal record, an unreadable base, a journal of another tokenizer). An empty tenant
    directory gives an empty corpus.

    Raises CorpusError when ``path`` is not a corpus directory; OSError when a file cannot be read.
    """
    d = resolve(path)
    meta_vocab, meta_fp = directory_meta(d)
    vocab_size = vocab_size if vocab_size is not None else meta_vocab
    fingerprint = fingerprint if fingerprint is not None else meta_fp
    base, spans, problems = read_generation(d, current_generation(d), vocab_size=vocab_size, fingerprint=fingerprint)
    tail = Corpus.from_spans([s for j in spans for s in j.spans], vocab_size=vocab_size, fingerprint=fingerprint)
    return Corpus(list(base.segments) + list(tail.segments), path=d, vocab_size=vocab_size,
                  fingerprint=fingerprint), problems


def read_generation(d: str, gen: Generation, *, vocab_size: int | None = None, fingerprint: str | None = None,
                    skip: str | None = None) -> tuple[Corpus, list[JournalTail], list[str]]:
    """Generation ``gen`` of tenant directory ``d``: its base (empty when unreadable, with a problem line), each
    journal's (but ``skip``'s) records past the folded bytes, in name order, and the problem lines (a record cut
    short at the end counts as one only when no live writer is appending to that journal). Raises OSError when a
    file cannot be read (a base removed meanwhile: FileNotFoundError, read the newer generation)."""
    problems: list[str] = []
    base = Corpus([], vocab_size=vocab_size, fingerprint=fingerprint)
    if gen.base is not None:
        path = os.path.join(d, gen.base)
        try:
            base = load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint)
        except CorpusError as e:
            if not os.path.exists(path):
                raise FileNotFoundError(path) from e
            problems.append(f"{path}: binary base unreadable ({e}); its spans are not used")
    spans = []
    for name in journal_files(d, gen):
        if name == skip:
            continue
        why = check_identity(d, name, vocab_size, fingerprint)
        if why is not None:
            problems.append(why)
            continue
        path = os.path.join(d, name)
        tail = read_tail(path, gen.folded.get(name, 0), vocab_size=vocab_size)
        problems += tail.problems
        if tail.torn and not has_live_writer(path):
            problems.append(f"{path}: torn tail at byte {tail.end} ({tail.torn} bytes, cut short; its writer is "
                            f"gone) skipped")
        spans.append(JournalTail(name, tail.spans, tail.end, tail.torn, tail.skipped_bytes))
    return base, spans, problems


def writers(path, *, vocab_size: int | None = None) -> list[dict]:
    """Per journal of a tenant directory's current generation (the tenant ``path`` names, see :func:`resolve`):
    ``{"journal", "writer", "host", "pid", "live", "bytes", "folded_bytes", "spans", "tokens", "problems"}`` --
    who wrote it (from ``journal-W.json``; None for a single-writer journal), whether that process still writes it,
    its size, the bytes already in the base, and the valid records past them. Raises OSError."""
    d = resolve(path)
    gen = current_generation(d)
    out = []
    for name in journal_files(d, gen):
        p = os.path.join(d, name)
        ident = journal_identity(d, name)
        tail = read_tail(p, gen.folded.get(name, 0), vocab_size=vocab_size)
        live = has_live_writer(p)
        problems = len(tail.problems) + (1 if tail.torn and not live else 0)
        out.append({"journal": name, "writer": ident.get("writer"), "host": ident.get("host"), "pid": ident.get("pid"),
                    "live": live, "bytes": os.path.getsize(p), "folded_bytes": gen.folded.get(name, 0),
                    "spans": len(tail.spans), "tokens": int(sum(len(x) for x in tail.spans)), "problems": problems})
    return out


@dataclass
class JournalTail:
    """One journal's records read from a byte offset: ``spans`` (int64 each), ``end`` (the byte after the last
    complete record), ``torn`` (bytes of a record cut short after it), ``skipped`` (damaged bytes before it)."""

    name: str
    spans: list[np.ndarray]
    end: int
    torn: int = 0
    skipped: int = 0


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
