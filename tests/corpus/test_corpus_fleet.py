"""Many writers on one corpus directory (in one process here; tests/server/test_fleet_servers.py runs separate servers):
each follows the others' journals, compaction folds every journal without losing or repeating a span, the
compaction lock is taken over from a dead holder and refused while a live one holds it, a record still being
written is never read, and bad states name their file."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from redraft.corpus import CorpusError
from redraft.corpus.directory import read_directory, writers
from redraft.corpus.journal import encode_record
from redraft.corpus.lease import LOCK_FILE, CompactionLock, host_name
from redraft.corpus.online import OnlineCorpus
from redraft.corpus.tools import compact_corpus

VOCAB = 1000


def span(i: int, n: int = 12) -> list[int]:
    rng = np.random.default_rng(i)
    return [900 + i % 100, 10 + i % 7] + rng.integers(20, 800, n - 2).tolist()


def held(oc: OnlineCorpus) -> list[list[int]]:
    return sorted(s.tolist() for s in oc.corpus.span_list())


def writer(d, **kw) -> OnlineCorpus:
    return OnlineCorpus(d, vocab_size=VOCAB, follow_seconds=None, **kw)


def test_writers_follow_each_other_and_learn_once(tmp_path):
    a, b = writer(tmp_path), writer(tmp_path)
    assert a.learn(span(1)) and b.learn(span(2))
    assert a.follow() == 1 and b.follow() == 1
    assert held(a) == held(b) == sorted([span(1), span(2)])
    assert not b.learn(span(1))  # already stored by the other writer: not stored again
    assert b.stats()["followed_spans"] == 1 and a.followed_spans == 1
    a.close(), b.close()
    assert sorted(s.tolist() for s in read_directory(tmp_path)[0].span_list()) == sorted([span(1), span(2)])


def test_follower_thread_picks_up_spans_within_its_interval(tmp_path):
    a = OnlineCorpus(tmp_path, vocab_size=VOCAB, follow_seconds=0.05)
    b = OnlineCorpus(tmp_path, vocab_size=VOCAB, follow_seconds=0.05)
    b.learn(span(3))
    deadline = time.monotonic() + 5
    while a.n_spans < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held(a) == [span(3)] and a.follow_delay < 5
    a.close(), b.close()


def test_compaction_by_one_writer_keeps_every_writers_spans_once(tmp_path):
    a, b, c = writer(tmp_path), writer(tmp_path), writer(tmp_path)
    for i in range(30):
        (a, b, c)[i % 3].append(span(i))
    b.compact()  # folds all three journals, as the files hold them
    for w in (a, c):
        w.follow()  # sees the new generation
    want = sorted(span(i) for i in range(30))
    assert held(a) == held(b) == held(c) == want
    a.append(span(99))  # appends after the compaction land past the folded bytes
    c.compact()
    b.follow()
    assert held(b) == sorted([*want, span(99)])
    for w in (a, b, c):
        w.close()
    corpus, problems = read_directory(tmp_path)
    assert sorted(s.tolist() for s in corpus.span_list()) == sorted([*want, span(99)]) and not problems
    assert [n for n in os.listdir(tmp_path) if n.endswith(".rdj")]  # their writers were alive at each compaction
    compact_corpus(str(tmp_path))  # now they are gone: folded and removed
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".rdj")]
    assert sorted(s.tolist() for s in read_directory(tmp_path)[0].span_list()) == sorted([*want, span(99)])


def test_a_record_being_written_is_not_read_until_complete(tmp_path):
    a = writer(tmp_path)
    path = tmp_path / "journal-other.1.x.rdj"
    rec = encode_record(span(5))
    with open(path, "wb") as f:
        f.write(rec[:-4])  # the other writer is half way through its write
    assert a.follow() == 0 and a.n_spans == 0 and not a.problems
    with open(path, "ab") as f:
        f.write(rec[-4:])
    assert a.follow() == 1 and held(a) == [span(5)]
    a.close()


def test_compaction_lock_is_taken_over_from_a_dead_holder(tmp_path):
    a = writer(tmp_path)
    a.append(span(1))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid of this host that is gone
    (tmp_path / LOCK_FILE).write_text(json.dumps({"writer": "dead", "host": host_name(), "pid": dead,
                                                  "expires": time.time() + 600}))
    a.compact()
    assert (tmp_path / "generation-000001.json").exists() and not (tmp_path / LOCK_FILE).exists()
    a.close()


def test_a_lock_held_by_a_live_process_on_another_host_is_an_error_naming_it(tmp_path):
    a = writer(tmp_path)
    a.append(span(1))
    (tmp_path / LOCK_FILE).write_text(json.dumps({"writer": "far.7.abc", "host": "elsewhere", "pid": 7,
                                                  "expires": time.time() + 600}))
    a.compact()  # a server leaves it to the holder: no new generation, nothing lost
    assert not (tmp_path / "generation-000001.json").exists() and held(a) == [span(1)]
    with pytest.raises(CorpusError, match=r"compact\.lock is held by writer far\.7\.abc \(pid 7 on host elsewhere\)"):
        compact_corpus(str(tmp_path))
    assert CompactionLock(tmp_path, "me").acquire() is False
    (tmp_path / LOCK_FILE).write_text(json.dumps({"writer": "far.7.abc", "host": "elsewhere", "pid": 7,
                                                  "expires": time.time() - 1}))  # its lease ran out
    compact_corpus(str(tmp_path))
    assert (tmp_path / "generation-000001.json").exists()
    a.close()


def test_a_journal_of_another_tokenizer_is_refused_by_name(tmp_path):
    other = OnlineCorpus(tmp_path, vocab_size=500, fingerprint="other", follow_seconds=None)
    other.append([1, 2, 3, 4])
    warnings: list[str] = []
    a = OnlineCorpus(tmp_path, vocab_size=VOCAB, fingerprint="mine", follow_seconds=None, warn=warnings.append)
    assert a.n_spans == 0
    assert any(os.path.basename(other.journal) in w and "another tokenizer" in w for w in warnings)
    other.close(), a.close()


def test_a_directory_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):  # root may write anywhere: a path below a plain file cannot be written by anyone
            (tmp_path / "plain").write_text("x")
            d = tmp_path / "plain" / "ro"
        with pytest.raises(CorpusError, match="ro: cannot write a journal there"):
            writer(d)
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_stats_report_each_writer(tmp_path):
    a, b = writer(tmp_path), writer(tmp_path)
    a.append(span(1))
    b.append(span(2))
    b.append(span(3))
    rows = {r["writer"]: r for r in writers(tmp_path, vocab_size=VOCAB)}
    assert rows[a.writer]["spans"] == 1 and rows[b.writer]["spans"] == 2
    assert rows[a.writer]["live"] and rows[a.writer]["pid"] == os.getpid()
    a.close()
    assert not {r["writer"]: r for r in writers(tmp_path)}[a.writer]["live"]
    b.close()


def test_corpus_compact_records_the_directorys_tokenizer_in_the_base(tmp_path):
    from redraft.corpus.directory import check_meta
    from redraft.corpus.tools import corpus_stats

    check_meta(tmp_path, VOCAB, "fp-1")
    w = OnlineCorpus(tmp_path / "default", vocab_size=VOCAB, fingerprint="fp-1", follow_seconds=None)
    w.append(span(1))
    w.close()
    compact_corpus(str(tmp_path))
    s = corpus_stats(str(tmp_path))
    assert (s["vocab_size"], s["fingerprint"]) == (VOCAB, "fp-1") and s["n_spans"] == 1


def rdj_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".rdj"))


def test_a_live_writers_journal_rotates_and_its_folded_segments_are_removed(tmp_path):
    a, b = writer(tmp_path), writer(tmp_path)
    written, sizes = [], []
    for round_ in range(6):
        for i in range(20):
            written.append(span(100 * round_ + i))
            (a, b)[i % 2].append(written[-1])
        b.follow(), a.follow()
        assert held(a) == held(b) == sorted(written)  # each sees every span once, across rotations
        (a, b)[round_ % 2].compact()
        a.follow(), b.follow()
        sizes.append(rdj_bytes(tmp_path))
        assert held(a) == held(b) == sorted(written)
    # one round's records are ~20 * 110 bytes: what is on disk stays at most two rounds' worth, never all six
    one_round = sum(len(encode_record(s)) for s in written[:20])
    assert max(sizes[1:]) <= 2 * one_round < sum(len(encode_record(s)) for s in written)
    assert a.journal.endswith(".rdj") and a.journal != str(tmp_path / f"journal-{a.writer}.rdj")  # it rotated
    names = [n for n in os.listdir(tmp_path) if n.endswith(".rdj")]
    assert len(names) <= 4, names  # per writer: the segment in use and at most one folded one
    a.close(), b.close()
    corpus, problems = read_directory(tmp_path)
    assert sorted(s.tolist() for s in corpus.span_list()) == sorted(written) and not problems


def test_a_writer_that_dies_right_after_rotating_loses_nothing(tmp_path):
    a = writer(tmp_path)
    for i in range(10):
        a.append(span(i))
    a.compact()  # folds its journal: it rotates to a new segment
    a.append(span(50))
    a._journal._file._f.close()  # dies: its flock goes with it, no clean close
    b = writer(tmp_path)
    assert held(b) == sorted([*(span(i) for i in range(10)), span(50)])
    b.compact()  # folds and removes the dead writer's segments
    assert not [n for n in os.listdir(tmp_path) if n.startswith(f"journal-{a.writer}")]
    assert held(b) == sorted([*(span(i) for i in range(10)), span(50)])
    b.close()
    assert sorted(s.tolist() for s in read_directory(tmp_path)[0].span_list()) == held(b)


def fold_now(d, writer_name: str = "compactor") -> None:
    """One compaction of ``d`` by a process that is not one of the test's writers (no reload of any of them)."""
    from redraft.corpus.compaction import fold

    assert fold(os.fspath(d), writer_name, lambda spans: (spans, 0), vocab_size=VOCAB) == 0


def test_a_busy_writer_rotates_though_it_appends_while_every_compaction_runs(tmp_path):
    """Each compaction folds most of a live writer's segment but not the spans appended after it read the file:
    the writer still starts a new segment, the closed one's unfolded tail is folded (and the file removed) by the
    next compaction, so the journals stay bounded while nothing is lost or repeated."""
    a = writer(tmp_path)
    written, sizes = [], []
    for round_ in range(8):
        for i in range(20):
            written.append(span(1000 + 100 * round_ + i))
            a.append(written[-1])
        fold_now(tmp_path)
        for i in range(3):  # appended after the compaction read the journal: not folded by it
            written.append(span(1090 + 100 * round_ + i))
            a.append(written[-1])
        a.follow()  # reads the new generation: rotates, the three late spans stay in the closed segment's tail
        assert held(a) == sorted(written)
        sizes.append(rdj_bytes(tmp_path))
    one_round = sum(len(encode_record(s)) for s in written[:23])
    assert max(sizes) <= 2 * one_round < sum(len(encode_record(s)) for s in written)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".rdj")]) <= 2
    a.close()
    corpus, problems = read_directory(tmp_path)
    assert sorted(s.tolist() for s in corpus.span_list()) == sorted(written) and not problems


def test_a_reader_following_across_rotations_sees_every_span_once(tmp_path):
    """A process that only reads follows a writer's segments by name and offset through rotations (with and
    without an unfolded tail in the closed segment) and compactions; whenever it reads, it holds exactly the
    spans written so far, each once, in no matter which order it met the files."""
    a, reader = writer(tmp_path), writer(tmp_path)
    written = []
    for round_ in range(6):
        for i in range(10):
            written.append(span(3000 + 100 * round_ + i))
            a.append(written[-1])
            if i == 4:
                reader.follow()  # a partial read of the segment about to be folded
                assert held(reader) == sorted(written)
        if round_ % 2:
            a.compact()  # folds all of a's segment: it rotates with nothing left in the old one
        else:
            fold_now(tmp_path)
            written.append(span(3090 + 100 * round_))
            a.append(written[-1])  # after the fold: left in the tail of the segment a closes at its next read
            a.follow()
        written.append(span(3095 + 100 * round_))
        a.append(written[-1])  # into the new segment
        reader.follow()
        assert held(reader) == held(a) == sorted(written)
    assert reader.stats()["journal_bytes"] == 0  # the reader stored nothing
    reader.close(), a.close()
    assert sorted(s.tolist() for s in read_directory(tmp_path)[0].span_list()) == sorted(written)


def test_a_writer_that_dies_right_after_rotating_with_an_unfolded_tail_loses_nothing(tmp_path):
    a = writer(tmp_path)
    first = [span(i) for i in range(200, 210)]
    for s in first:
        a.append(s)
    fold_now(tmp_path)
    late = span(250)
    a.append(late)  # not folded yet
    a.follow()  # rotates: the closed segment keeps the late span past its folded bytes
    assert a.journal != str(tmp_path / f"journal-{a.writer}.rdj")
    newest = span(251)
    a.append(newest)
    a._journal._file._f.close()  # dies (kill -9): no clean close, its flock goes with it
    b = writer(tmp_path)
    assert held(b) == sorted([*first, late, newest])
    b.compact()  # folds both of a's segments and removes them with their identity files
    assert not [n for n in os.listdir(tmp_path) if n.startswith(f"journal-{a.writer}")]
    assert held(b) == sorted([*first, late, newest])
    b.close()
    corpus, problems = read_directory(tmp_path)
    assert sorted(s.tolist() for s in corpus.span_list()) == sorted([*first, late, newest]) and not problems


def test_an_identity_file_left_without_its_segment_is_removed(tmp_path):
    """A writer killed between writing a segment's identity file and creating the segment leaves the identity file
    alone; a compaction removes it once it is older than a lease."""
    a = writer(tmp_path)
    a.append(span(1))
    orphan = tmp_path / "journal-gone.1.2.json"
    orphan.write_text('{"writer": "gone.1", "segment": 2}')
    fresh = tmp_path / "journal-starting.1.json"  # a writer starting now: its segment comes next
    fresh.write_text('{"writer": "starting.1", "segment": 0}')
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    a.compact()
    names = os.listdir(tmp_path)
    assert orphan.name not in names and fresh.name in names
    assert f"journal-{a.writer}.json" in names  # a live segment's identity stays
    a.close()


def test_a_record_finished_while_a_compaction_reads_its_journal_is_kept(tmp_path, monkeypatch):
    """A writer mid-append when a compaction reads its journal, then closing it (a rotation, a clean close) before
    the compaction decides whether its writer is gone: the half-read record is not folded away as a dead writer's
    torn tail; the next compaction folds it whole."""
    from redraft.corpus import compaction

    a = writer(tmp_path)
    for i in range(3):
        a.append(span(400 + i))
    rec = encode_record(span(403))
    f = a._journal._file._f
    f.write(rec[:7])  # an append under way: half a record on disk
    real = compaction.read_generation

    def read_then_finish(*args, **kw):
        got = real(*args, **kw)
        f.write(rec[7:])  # the append completes, then the writer closes this segment
        f.close()
        return got

    monkeypatch.setattr(compaction, "read_generation", read_then_finish)
    fold_now(tmp_path)
    monkeypatch.setattr(compaction, "read_generation", real)
    b = writer(tmp_path)
    want = sorted(span(400 + i) for i in range(4))
    assert held(b) == want
    b.compact()
    assert held(b) == want and not [n for n in os.listdir(tmp_path) if n.endswith(".damaged")]
    b.close()
    assert sorted(s.tolist() for s in read_directory(tmp_path)[0].span_list()) == want


def test_a_new_owned_journal_appears_already_locked(tmp_path, monkeypatch):
    """A compaction that lists the directory while a writer starts a segment never finds it unlocked (it would
    remove it as a dead writer's empty journal)."""
    from redraft.corpus import journal
    from redraft.corpus.journal import JournalWriter, has_live_writer

    path = tmp_path / "journal-w.1.rdj"
    real_link, seen = os.link, []

    def link(src, dst):
        seen.append(has_live_writer(src))
        real_link(src, dst)

    monkeypatch.setattr(journal.os, "link", link)
    w = JournalWriter(path, owned=True)
    assert seen == [True] and has_live_writer(path) and os.listdir(tmp_path) == [path.name]
    with pytest.raises(BlockingIOError):
        JournalWriter(path, owned=True)
    w.append([1, 2, 3])
    w.close()
    assert not has_live_writer(path) and len(journal.read_journal(path).spans) == 1


def test_a_corpus_directory_that_is_a_file_is_an_error_naming_it(tmp_path):
    from redraft.corpus.directory import check_meta

    f = tmp_path / "corpus"
    f.write_text("not a directory")
    with pytest.raises(CorpusError, match="is a file, not a directory"):
        check_meta(f, VOCAB, None)
