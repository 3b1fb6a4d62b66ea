"""The span journal (checksummed records, damage skipped at replay) and the online corpus built on it
(copy-on-write snapshots, persistence across reopen, the token cap, compaction, concurrent lookups and appends)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from redraft.corpus import Corpus
from redraft.corpus.journal import JournalWriter, encode_record, read_journal, scan
from redraft.corpus.online import OnlineCorpus

VOCAB = 1000


def spans_of(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    """n distinct spans: each starts with its own 3-id key so a lookup can name it."""
    rng = np.random.default_rng(seed)
    return [[900 + i // 100, 950 + i % 50, i % 7] + rng.integers(10, 800, length - 3).tolist() for i in range(n)]


def as_lists(oc: OnlineCorpus) -> list[list[int]]:
    return [s.tolist() for s in oc.corpus.span_list()]


def journal_file(d) -> str:
    names = sorted(n for n in os.listdir(d) if n.startswith("journal-") and n.endswith(".rdj"))
    assert len(names) == 1, names
    return os.path.join(d, names[0])


# ---- records --------------------------------------------------------------------------------------------------

def test_records_round_trip():
    spans = spans_of(5)
    rep = scan(b"".join(encode_record(s) for s in spans))
    assert [s.tolist() for s in rep.spans] == spans and not rep.problems and rep.skipped_bytes == 0


def test_torn_tail_is_skipped_with_one_problem():
    spans = spans_of(4)
    data = b"".join(encode_record(s) for s in spans)
    cut = data[:len(data) - 7]  # the last record loses its end
    rep = scan(cut)
    assert [s.tolist() for s in rep.spans] == spans[:3]
    assert len(rep.problems) == 1 and "torn tail" in rep.problems[0]
    assert rep.end == len(b"".join(encode_record(s) for s in spans[:3]))


@pytest.mark.parametrize("where", ["payload", "length", "magic", "crc"])
def test_flipped_byte_costs_one_record(where):
    spans = spans_of(5)
    recs = [encode_record(s) for s in spans]
    start = sum(len(r) for r in recs[:2])  # damage the third record
    offset = {"magic": 1, "length": 5, "crc": 9, "payload": 20}[where]
    data = bytearray(b"".join(recs))
    data[start + offset] ^= 0x40
    rep = scan(bytes(data))
    assert [s.tolist() for s in rep.spans] == spans[:2] + spans[3:]
    assert len(rep.problems) == 1 and "corrupt record" in rep.problems[0] and f"byte {start}" in rep.problems[0]


def test_ids_outside_the_vocabulary_are_skipped():
    spans = [[1, 2, 3], [4, VOCAB + 5, 6], [7, 8, 9]]
    rep = scan(b"".join(encode_record(s) for s in spans), vocab_size=VOCAB)
    assert [s.tolist() for s in rep.spans] == [spans[0], spans[2]]
    assert "outside the vocabulary" in rep.problems[0]


def test_writer_appends_and_reader_replays(tmp_path):
    path = tmp_path / "j.rdj"
    w = JournalWriter(path, sync=True)
    for s in spans_of(3):
        w.append(s)
    w.close()
    assert w.size == os.path.getsize(path)
    assert [s.tolist() for s in read_journal(path).spans] == spans_of(3)
    assert read_journal(tmp_path / "missing.rdj").spans == []


# ---- online corpus ----------------------------------------------------------------------------------------------

def test_appended_span_drafts_at_once_and_survives_reopen(tmp_path):
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    spans = spans_of(6)
    for s in spans:
        assert oc.append(s)
    n, ids = oc.propose(spans[2][:5], 4)
    assert n == 5 and ids.tolist() == spans[2][5:9]
    oc.close()
    again = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    assert as_lists(again) == spans and not again.problems
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_journal_is_skipped_with_a_warning_and_repaired(tmp_path, damage):
    spans = spans_of(5)
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    for s in spans:
        oc.append(s)
    oc.close()
    path = journal_file(tmp_path)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-10]
        kept = spans[:4]
    else:
        data[len(encode_record(spans[0])) + 30] ^= 0xFF  # inside the second record's payload
        kept = spans[:1] + spans[2:]
    open(path, "wb").write(bytes(data))
    warnings: list[str] = []
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB, warn=warnings.append)
    assert as_lists(oc) == kept
    assert any(("torn tail" if damage == "truncate" else "corrupt record") in w for w in warnings)
    oc.compact()  # folds the valid records; the damaged journal (its writer is gone) is kept aside
    assert as_lists(oc) == kept and os.path.exists(path + ".damaged") and not os.path.exists(path)
    oc.append(spans_of(1, seed=9)[0])  # appends after the repair replay cleanly
    oc.close()
    warnings.clear()
    again = OnlineCorpus(tmp_path, vocab_size=VOCAB, warn=warnings.append)
    assert as_lists(again) == kept + spans_of(1, seed=9) and not warnings
    again.close()


def test_cap_evicts_oldest_spans_in_memory_and_on_disk(tmp_path):
    cap = 100
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB, cap_tokens=cap)
    spans = spans_of(30, length=10)
    for s in spans:
        oc.append(s)
        assert oc.n_tokens <= 2 * cap  # appends wait for a running eviction rather than pass twice the cap
    oc.compact()
    assert oc.n_tokens <= cap and oc.evicted_spans > 0
    held = as_lists(oc)
    assert held == spans[len(spans) - len(held):]  # the newest ones, in order
    assert oc.propose(spans[0][:5], 4)[0] == 0  # an evicted span no longer drafts
    oc.close()
    again = OnlineCorpus(tmp_path, vocab_size=VOCAB, cap_tokens=cap)
    assert as_lists(again) == held  # journal and index agree
    again.close()
    assert not OnlineCorpus(None, cap_tokens=5).append(list(range(6)))  # longer than the cap: not kept


def test_compaction_writes_a_base_and_keeps_every_span(tmp_path):
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB, compact_tokens=50)
    spans = spans_of(20)
    for s in spans:
        oc.append(s)
    oc.compact()
    names = os.listdir(tmp_path)
    # a folded journal is closed (the next compaction removes it) and appends go to a new, empty segment
    journals = [n for n in names if n.endswith(".rdj")]
    assert any(n.startswith("base-") for n in names) and 1 <= len(journals) <= 2
    assert os.path.basename(oc.journal) in journals and os.path.getsize(oc.journal) == 0
    assert as_lists(oc) == spans
    oc.close()
    again = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    assert as_lists(again) == spans and again.corpus.propose(spans[7][:4], 3)[1].tolist() == spans[7][4:7]
    again.close()


def test_unfinished_compaction_leftovers_are_ignored(tmp_path):
    spans = spans_of(4)
    oc = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    for s in spans:
        oc.append(s)
    oc.close()
    # a crash after the next generation's base was written, before its generation file (the commit point)
    Corpus.from_spans(spans_of(2, seed=5), vocab_size=VOCAB).save(tmp_path / "base-000001.bin")
    open(tmp_path / "generation-000001.json.tmp", "wb").write(b"partial")
    old = tmp_path / ".generation-000001.tmp-999-0.json"  # an interrupted atomic write's
    old.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    again = OnlineCorpus(tmp_path, vocab_size=VOCAB)
    assert as_lists(again) == spans
    again.compact()
    assert as_lists(again) == spans
    names = sorted(os.listdir(tmp_path))
    assert names[:2] == ["base-000001.bin", "generation-000001.json"] and old.name not in names
    assert [n for n in names if n.endswith(".rdj")] == [os.path.basename(again.journal)]  # the closed writer's folded journal is gone
    again.close()


def test_lookups_during_appends_always_see_finished_appends():
    """A lookup started after append() returned finds that span, while another thread keeps appending (and so
    merging segments)."""
    oc = OnlineCorpus(None, vocab_size=VOCAB)
    spans = spans_of(300, length=8)
    done = [0]
    errors: list[str] = []

    def writer():
        for i, s in enumerate(spans):
            oc.append(s)
            done[0] = i + 1

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 30
    rng = np.random.default_rng(1)
    checks = 0
    while (t.is_alive() or checks < 50) and time.monotonic() < deadline and checks < 20000:
        n = done[0]
        if n == 0:
            continue
        j = int(rng.integers(0, n))
        got = oc.propose(spans[j][:3], 5)[1].tolist()
        if got != spans[j][3:8]:
            errors.append(f"span {j} of {n}: {got}")
        checks += 1
    t.join(timeout=30)
    assert not errors and checks >= 50
