"""Corpus files: text and binary formats, every bad input, fingerprints, round trips."""

import json
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# imported at module level: importing it inside a @given test would define @given tests within one (a health-check
# failure whenever this module runs without test_corpus.py)
from test_corpus import ref_propose

from redraft.corpus import Corpus, CorpusError, load_corpus, tokenizer_fingerprint
from redraft.corpus.format import MAGIC, append_text, write_text


def write(tmp_path, name, data):
    p = tmp_path / name
    (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
    return p


# ---- text ---------------------------------------------------------------------------------------------------------
def test_non_integer_token_names_file_line_and_token(tmp_path):
    p = write(tmp_path, "corpus.txt", "1 2 3\n4 5 -1\n6 abc 7\n")
    with pytest.raises(CorpusError) as e:
        load_corpus(p)
    assert str(e.value) == (f"{p}:3: token 'abc' is not an integer "
                            "(expected whitespace-separated token ids, -1 between spans)")


@pytest.mark.parametrize("tok", ["1.5", "+3", "1_000", "--1", "5-", "héllo", "0x10"])
def test_other_non_integers(tmp_path, tok):
    p = write(tmp_path, "c.txt", f"1 2\n3 {tok} 4\n")
    with pytest.raises(CorpusError, match=re.escape(f":2: token '{tok}' is not an integer")):
        load_corpus(p)


def test_out_of_vocab_id_names_position_and_line(tmp_path):
    p = write(tmp_path, "c.txt", "1 2 -1\n3 4\n5 100 6\n")
    with pytest.raises(CorpusError) as e:
        load_corpus(p, vocab_size=100)
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: id 100 at position 6") and "vocab size 100" in msg
    assert load_corpus(p, vocab_size=101).n_tokens == 7
    assert load_corpus(p).n_tokens == 7  # no vocabulary known: any id >= 0 is fine


def test_id_below_minus_one(tmp_path):
    p = write(tmp_path, "c.txt", "1 2\n-2 3\n")
    with pytest.raises(CorpusError, match=r":2: id -2 at position 2 is negative"):
        load_corpus(p)


@pytest.mark.parametrize("text", ["", "\n\n", "-1", " -1 -1\n-1 "])
def test_empty_file_gives_empty_corpus(tmp_path, text):
    c = load_corpus(write(tmp_path, "e.txt", text))
    assert c.n_tokens == 0 and c.n_spans == 0
    assert c.propose(np.array([1, 2, 3]), 4)[0] == 0


def test_missing_and_unreadable_files(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match="nope.txt"):
        load_corpus(missing)
    with pytest.raises(CorpusError, match=str(tmp_path)):
        load_corpus(tmp_path)  # a directory
    assert isinstance(CorpusError("x"), ValueError)


def test_format_detected_by_content_not_name(tmp_path):
    c = Corpus.from_spans([[1, 2, 3, 4]])
    c.save(tmp_path / "looks_like.txt")  # binary under a .txt name
    assert load_corpus(tmp_path / "looks_like.txt").n_tokens == 4
    write(tmp_path, "looks_like.bin", "1 2 3 4 -1 5\n")
    assert load_corpus(tmp_path / "looks_like.bin").n_spans == 2


def test_binary_garbage_is_bad_magic(tmp_path):
    p = write(tmp_path, "g.bin", b"\x00\x01garbage\x00" * 10)
    with pytest.raises(CorpusError, match="bad magic"):
        load_corpus(p)


# ---- binary -------------------------------------------------------------------------------------------------------
def saved(tmp_path, spans=([1, 2, 3, 4, 5], [2, 3, 4, 9]), **kw):
    p = tmp_path / "c.rdc"
    Corpus.from_spans(list(spans), **kw).save(p)
    return p


def test_binary_round_trip_and_lookups(tmp_path):
    p = saved(tmp_path, vocab_size=50, fingerprint="sha256:aa")
    c = load_corpus(p)
    assert (c.n_tokens, c.n_spans, c.vocab_size, c.fingerprint) == (9, 2, 50, "sha256:aa")
    assert p.read_bytes().startswith(MAGIC)
    assert c.propose(np.array([2, 3, 4]), 3)[1].tolist() == [9]
    assert c.propose(np.array([1, 2, 3, 4]), 3)[1].tolist() == [5]


def test_truncated_binary(tmp_path):
    p = saved(tmp_path)
    data = p.read_bytes()
    for cut in (4, 20, len(data) - 1):
        q = write(tmp_path, f"t{cut}.rdc", data[:cut])
        with pytest.raises(CorpusError, match="truncated"):
            load_corpus(q)


def test_bad_magic_and_unknown_version(tmp_path):
    data = saved(tmp_path).read_bytes()
    with pytest.raises(CorpusError, match="bad magic"):
        load_corpus(write(tmp_path, "m.rdc", b"RDCORPUZ" + data[8:]))
    bumped = data[:8] + struct.pack("<I", 99) + data[12:]
    with pytest.raises(CorpusError, match="unknown binary corpus version 99"):
        load_corpus(write(tmp_path, "v.rdc", bumped))


def test_malformed_header(tmp_path):
    data = saved(tmp_path).read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    bad = data[:16] + b"{" + b" " * (hlen - 1) + data[16 + hlen:]
    with pytest.raises(CorpusError, match="malformed binary corpus header"):
        load_corpus(write(tmp_path, "h.rdc", bad))


def test_binary_ids_beyond_vocab(tmp_path):
    p = saved(tmp_path)
    with pytest.raises(CorpusError, match=r"id 9 is out of range \(vocab size 9"):
        load_corpus(p, vocab_size=9)
    assert load_corpus(p, vocab_size=10).vocab_size == 10


def test_fingerprint_mismatch_and_force(tmp_path):
    p = saved(tmp_path, fingerprint="sha256:1111")
    with pytest.raises(CorpusError) as e:
        load_corpus(p, fingerprint="sha256:2222")
    assert "sha256:1111" in str(e.value) and "sha256:2222" in str(e.value) and str(p) in str(e.value)
    c = load_corpus(p, fingerprint="sha256:2222", force=True)
    assert c.fingerprint == "sha256:1111" and c.n_tokens == 9
    assert load_corpus(p, fingerprint="sha256:1111").n_tokens == 9


def test_empty_corpus_binary(tmp_path):
    p = tmp_path / "e.rdc"
    Corpus.from_spans([]).save(p)
    c = load_corpus(p)
    assert c.n_tokens == 0 and c.propose(np.array([1, 2, 3]), 2)[0] == 0


def test_wide_vocab_binary(tmp_path):
    p = saved(tmp_path, spans=[[100000, 100001, 100002, 7], [5, 100001, 100002, 8]], vocab_size=151000)
    c = load_corpus(p, vocab_size=151000)
    assert c.stats()["token_width"] == 4
    assert c.propose(np.array([100001, 100002]), 2, min_n=2)[1].tolist() == [8]


def test_save_unknown_format(tmp_path):
    with pytest.raises(CorpusError, match="unknown corpus format"):
        Corpus.from_spans([[1]]).save(tmp_path / "x", fmt="yaml")


def test_save_compacts_appended_tail(tmp_path):
    c = Corpus.from_spans([[1, 2, 3, 4]])
    c.append([1, 2, 3, 5])
    c.save(tmp_path / "c.rdc")
    d = load_corpus(tmp_path / "c.rdc")
    assert d.n_spans == 2 and d.propose(np.array([1, 2, 3]), 2)[1].tolist() == [5]


@settings(max_examples=40, deadline=None)
@given(spans=st.lists(st.lists(st.integers(0, 70000), min_size=1, max_size=12), max_size=6))
def test_text_binary_text_round_trip_is_lossless(tmp_path_factory, spans):
    d = tmp_path_factory.mktemp("rt")
    Corpus.from_spans(spans).save(d / "a.txt", fmt="text")
    load_corpus(d / "a.txt").save(d / "b.rdc")
    load_corpus(d / "b.rdc").save(d / "c.txt", fmt="text")
    assert (d / "a.txt").read_text() == (d / "c.txt").read_text()
    assert [s.tolist() for s in load_corpus(d / "b.rdc").span_list()] == spans


# ---- the one text writer -----------------------------------------------------------------------------------------
def test_text_layout_is_one_span_per_line_with_separator_lines(tmp_path):
    Corpus.from_spans([[1, 2, 3], [4, 5]]).save(tmp_path / "a.txt", fmt="text")
    assert (tmp_path / "a.txt").read_text() == "1 2 3\n-1\n4 5\n"
    assert write_text(tmp_path / "a.txt", [[7], np.array([8, 9])]) == 2  # truncates, same layout
    assert (tmp_path / "a.txt").read_text() == "7\n-1\n8 9\n"
    assert append_text(tmp_path / "a.txt", [[], [10]]) == 1  # empty spans carry nothing: skipped
    assert (tmp_path / "a.txt").read_text() == "7\n-1\n8 9\n-1\n10\n"


@pytest.mark.parametrize("existing,want", [
    ("5 6 7" + " " * 100, [[5, 6, 7], [8, 9]]),  # trailing blanks longer than one read-back: still a new span
    ("5 6 7\n" + "\n" * 200, [[5, 6, 7], [8, 9]]),
    ("1 2\n-1" + " " * 100, [[1, 2], [8, 9]]),  # a trailing separator far back: no second one
    ("-1\n", [[8, 9]]),
    ("", [[8, 9]]),
])
def test_append_text_never_glues_spans(tmp_path, existing, want):
    p = tmp_path / "c.txt"
    p.write_text(existing)
    append_text(p, [[8, 9]])
    assert [s.tolist() for s in load_corpus(p).span_list()] == want


def test_append_text_refuses_negative_ids(tmp_path):
    with pytest.raises(CorpusError, match=r"c.txt: cannot write id -1"):
        append_text(tmp_path / "c.txt", [[1, 2], [3, -1, 4]])
    with pytest.raises(CorpusError, match="cannot write corpus"):
        append_text(tmp_path / "missing-dir" / "c.txt", [[1]])


# ---- fingerprint --------------------------------------------------------------------------------------------------
class FakeTokenizer:
    def __init__(self, vocab, specials=("<s>", "</s>")):
        self.vocab = dict(vocab)
        self.all_special_tokens = list(specials)
        self.all_special_ids = [self.vocab[s] for s in specials if s in self.vocab]

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint_is_stable_and_sensitive():
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    fp = tokenizer_fingerprint(FakeTokenizer(vocab))
    assert fp.startswith("sha256:") and fp == tokenizer_fingerprint(FakeTokenizer(dict(reversed(vocab.items()))))
    assert fp != tokenizer_fingerprint(FakeTokenizer({**vocab, "c": 4}))
    assert fp != tokenizer_fingerprint(FakeTokenizer({**vocab, "a": 3, "b": 2}))
    assert fp != tokenizer_fingerprint(FakeTokenizer(vocab, specials=("<s>",)))
    with pytest.raises(TypeError):
        tokenizer_fingerprint(object())
    json.dumps(fp)


@settings(max_examples=40, deadline=None)
@given(spans=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), max_size=5),
       contexts=st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=9), min_size=1, max_size=5))
def test_mapped_corpus_answers_like_brute_force(tmp_path_factory, spans, contexts):
    p = tmp_path_factory.mktemp("mm") / "c.rdc"
    Corpus.from_spans(spans).save(p)
    c = load_corpus(p)
    for ctx in contexts:
        n, ids = c.propose(np.array(ctx), 6, min_n=2, max_n=9)
        assert (n, ids.tolist()) == ref_propose(spans, ctx, 6, 2, 9)


def test_match_at_corpus_start_reads_nothing_past_the_stream(tmp_path):
    # 32 ids = 64 stream bytes: no alignment padding after the stream, the case where a suffix comparison could
    # have read another array's bytes.
    spans = [list(range(1, 33))]
    p = tmp_path / "c.rdc"
    Corpus.from_spans(spans).save(p)
    c = load_corpus(p)
    for ctx in ([1, 2, 3], [0, 1, 2, 3], [9, 9, 1, 2], [5, 5, 5, 1]):
        n, ids = c.propose(np.array(ctx), 4, min_n=1, max_n=8)
        assert (n, ids.tolist()) == ref_propose(spans, ctx, 4, 1, 8)


def test_trailing_bytes_are_a_layout_error(tmp_path):
    p = saved(tmp_path)
    with open(p, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorpusError, match="layout"):
        load_corpus(p)
