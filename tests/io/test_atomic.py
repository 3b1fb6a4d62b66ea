"""Atomic writes: a write that fails midway leaves the old file whole (or no file) and no temporary file, for each
kind of writer redraft has: text/JSON (:mod:`redraft.io.atomic`: bench results and cost tables, demo / oracle /
glide eval JSON, training state, the policy's cost-curve cache), writers that take a file name (plots, safetensors
checkpoints, through :func:`redraft.io.atomic.atomic_path`), and corpus files (binary and text, the corpus tools).

The GliDe checkpoint, the bench outputs and ``freeze`` into a binary corpus are covered beside their features
(test_glide_train.py, test_bench.py, test_cli_badinput.py) with the helpers of tests/atomickit.py."""

from __future__ import annotations

import errno
import json
import os
import pathlib

import pytest
from atomickit import disk_full, fail_corpus_writes, fail_midway, leftovers

from redraft.corpus import Corpus, CorpusError, load_corpus
from redraft.corpus.tools import append_to_corpus, compact_corpus
from redraft.io import atomic


def test_write_json_failing_midway_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    atomic.write_json(target, {"old": 1})
    fail_midway(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        atomic.write_json(target, {"new": list(range(1000))})
    assert json.loads(target.read_text()) == {"old": 1}
    assert leftovers(tmp_path) == []

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OSError) as e:
        atomic.write_json(target, {})
    assert e.value.filename == str(target)  # the error names the file asked for, not the temporary one
    with pytest.raises(OSError):
        atomic.write_text(tmp_path / "new.md", "x" * 100)
    assert not (tmp_path / "new.md").exists() and leftovers(tmp_path) == []


def test_atomic_path_removes_the_temporary_file_on_interrupt(tmp_path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".png"  # writers that read the suffix still work
            tmp.write_bytes(b"half a pl")
            raise KeyboardInterrupt
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []
    with atomic.atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and leftovers(tmp_path) == []


def test_plot_failing_midway_leaves_no_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from redraft.bench.report import plot_cost

    def half_savefig(self, fname, *args, **kwargs):
        pathlib.Path(fname).write_bytes(b"\x89PNG half")
        raise disk_full()

    monkeypatch.setattr(Figure, "savefig", half_savefig)
    cost = {"curves": {"chain": {"s": [1, 2, 3], "c": [1.0, 1.2, 1.5]}}, "max_s": 3, "model": "tiny", "prefix": 8,
            "t1_s": 0.01}
    with pytest.raises(OSError):
        plot_cost(cost, tmp_path / "cost_curve.png")
    assert os.listdir(tmp_path) == []


def test_cost_curve_cache_failing_midway_keeps_the_old_cache(tmp_path, monkeypatch):
    from redraft.pricing.cache import save_curve
    from redraft.pricing.curve import CostCurve

    path = tmp_path / "curve.json"
    assert save_curve(path, {"k": 1}, CostCurve((0, 1), (1.0, 1.5)))
    before = path.read_text()
    fail_midway(monkeypatch)
    with pytest.warns(RuntimeWarning, match="not written"):
        assert not save_curve(path, {"k": 2}, CostCurve((0, 1, 2), (1.0, 1.5, 2.0)))
    assert path.read_text() == before and leftovers(tmp_path) == []


SPANS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]


@pytest.mark.parametrize("fmt", ["binary", "text"])
def test_corpus_save_failing_midway_keeps_the_old_corpus(tmp_path, monkeypatch, fmt):
    path = tmp_path / "c.rdc"
    Corpus.from_spans(SPANS[:1]).save(path, fmt=fmt)
    before = path.read_bytes()
    fail_corpus_writes(monkeypatch)
    with pytest.raises(CorpusError, match="cannot write corpus"):
        Corpus.from_spans([list(range(100, 160))] * 3).save(path, fmt=fmt)
    assert path.read_bytes() == before and leftovers(tmp_path) == []
    assert [s.tolist() for s in load_corpus(path).span_list()] == SPANS[:1]


def test_corpus_tools_failing_midway_keep_the_old_corpus(tmp_path, monkeypatch):
    path, more = tmp_path / "c.rdc", tmp_path / "more.txt"
    Corpus.from_spans(SPANS).save(path)
    more.write_text("1 2 3 4 5\n")
    before = path.read_bytes()
    fail_corpus_writes(monkeypatch)
    with pytest.raises(CorpusError):
        append_to_corpus(path, [more])
    with pytest.raises(CorpusError):
        compact_corpus(path)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_interrupted_binary_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Not only an OSError: an interruption (KeyboardInterrupt) during the write also removes the temporary file."""
    fail_corpus_writes(monkeypatch, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        Corpus.from_spans(SPANS).save(tmp_path / "c.rdc")
    assert os.listdir(tmp_path) == []


def test_journal_write_failing_midway_keeps_the_old_journal(tmp_path, monkeypatch):
    """The online corpus rewrites whole journals (compaction, a damaged journal's valid records) through the one
    atomic writer: a failure midway leaves the previous journal whole and no temporary file."""
    from redraft.corpus import journal

    path = tmp_path / "journal-000000.rdj"
    journal.write_journal(path, [[1, 2, 3], [4, 5]])
    before = path.read_bytes()
    real, calls = journal.encode_record, []

    def second_fails(span):
        calls.append(span)
        if len(calls) == 2:
            raise disk_full()
        return real(span)

    monkeypatch.setattr(journal, "encode_record", second_fails)
    with pytest.raises(OSError, match="No space"):
        journal.write_journal(path, [[7, 8], [9], [10]])
    assert path.read_bytes() == before
    assert [r.tolist() for r in journal.read_journal(path).spans] == [[1, 2, 3], [4, 5]]
    assert leftovers(tmp_path) == []
