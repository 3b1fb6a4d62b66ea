"""`redraft corpus ...` tools: build from every input kind, append, merge, convert, stats, compact."""

import argparse
import os

import numpy as np
import pytest

from redraft.cli import corpus as corpus_cli
from redraft.corpus import Corpus, CorpusError, load_corpus
from redraft.corpus.sources import detect_kind, read_spans
from redraft.corpus.tools import corpus_stats, distinct_ngrams


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="redraft")
    corpus_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["corpus", *map(str, argv)])
    return args.func(args)


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "a.txt").write_text("1 2 3 4 5 -1 6 7 8\n")
    (tmp_path / "b.jsonl").write_text('{"prompt_tokens": [5, 5], "tokens": [1, 2, 3, 11]}\n\n'
                                      '{"tokens": [4, 4, 4, 4]}\n{"tokens": [4, 4, 4, 4]}\n')
    (tmp_path / "c.log").write_text("loading model\n[PROMPT_TOKENS] 2: 9 9\n[TOKENS] 4 generated: 1 2 3 12\n"
                                    "speculation: 2.00 tokens/forward\n")
    return tmp_path


def test_detect_kinds(inputs):
    assert [detect_kind(inputs / n) for n in ("a.txt", "b.jsonl", "c.log")] == ["text", "jsonl", "log"]
    Corpus.from_spans([[1]]).save(inputs / "d")
    assert detect_kind(inputs / "d") == "binary"


def test_build_from_all_kinds_newest_last(inputs, capsys):
    out = inputs / "out.rdc"
    assert cli("build", inputs / "a.txt", inputs / "b.jsonl", inputs / "c.log", "--out", out,
               "--vocab-size", 100, "--fingerprint", "sha256:ab") == 0
    c = load_corpus(out)
    # a span is prompt + output: JSONL prompt_tokens and the log's [PROMPT_TOKENS] line come first
    assert [s.tolist() for s in c.span_list()] == [[1, 2, 3, 4, 5], [6, 7, 8], [5, 5, 1, 2, 3, 11], [4, 4, 4, 4],
                                                   [4, 4, 4, 4], [9, 9, 1, 2, 3, 12]]
    assert c.fingerprint == "sha256:ab" and c.vocab_size == 100
    assert c.propose(np.array([1, 2, 3]), 1)[1].tolist() == [12]  # k = 1: the newest span's continuation suffices
    assert "built" in capsys.readouterr().out


def test_build_refuses_out_of_vocab_and_reports(inputs, capsys):
    assert cli("build", inputs / "a.txt", "--out", inputs / "o.rdc", "--vocab-size", 8) == 2
    err = capsys.readouterr().err
    assert "a.txt:1: id 8 at position 8" in err  # separators count as positions
    assert not (inputs / "o.rdc").exists()


def test_bad_jsonl_and_log_lines(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1, 2]}\n{"tokens": [1, "x"]}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: record has no \"tokens\" list"):
        read_spans(tmp_path / "bad.jsonl")
    (tmp_path / "bad2.jsonl").write_text('{"tokens": [1, 2]}\n{nope\n')
    with pytest.raises(CorpusError, match=r"bad2.jsonl:2: not a JSON record"):
        read_spans(tmp_path / "bad2.jsonl")
    (tmp_path / "bad.log").write_text("[TOKENS] 3 generated: 1 2\n")
    with pytest.raises(CorpusError, match=r"bad.log:1: line says 3 ids but has 2"):
        read_spans(tmp_path / "bad.log")
    (tmp_path / "bad2.log").write_text("x\n[TOKENS] 2 generated: 1 z\n")
    with pytest.raises(CorpusError, match=r"bad2.log:2: token 'z' is not an integer"):
        read_spans(tmp_path / "bad2.log")
    (tmp_path / "neg.jsonl").write_text('{"tokens": [1, -4]}\n')
    with pytest.raises(CorpusError, match="neg.jsonl: id -4 at position 1"):
        read_spans(tmp_path / "neg.jsonl")


def test_append_keeps_format_and_puts_new_spans_last(inputs):
    Corpus.from_spans([[1, 2, 3, 4]], fingerprint="sha256:ab").save(inputs / "c.rdc")
    assert cli("append", inputs / "c.rdc", inputs / "c.log") == 0
    c = load_corpus(inputs / "c.rdc")
    assert c.n_spans == 2 and c.fingerprint == "sha256:ab"
    assert c.propose(np.array([1, 2, 3]), 1)[1].tolist() == [12]
    before, inode = (inputs / "a.txt").read_text(), os.stat(inputs / "a.txt").st_ino
    assert cli("append", inputs / "a.txt", inputs / "c.log") == 0  # text stays text, and grows in place
    assert (inputs / "a.txt").read_text() == before + "-1\n9 9 1 2 3 12\n"
    assert os.stat(inputs / "a.txt").st_ino == inode  # appended, not rewritten and replaced
    assert cli("append", inputs / "c.rdc", inputs / "c.log", "--fingerprint", "sha256:zz") == 2
    assert cli("append", inputs / "c.rdc", inputs / "c.log", "--fingerprint", "sha256:zz", "--force") == 0


def test_merge(inputs):
    Corpus.from_spans([[1, 2, 3, 4]], fingerprint="sha256:ab").save(inputs / "x.rdc")
    Corpus.from_spans([[1, 2, 3, 5]], fingerprint="sha256:ab").save(inputs / "y.rdc")
    assert cli("merge", inputs / "x.rdc", inputs / "y.rdc", "--out", inputs / "m.rdc") == 0
    m = load_corpus(inputs / "m.rdc")
    assert m.n_spans == 2 and m.fingerprint == "sha256:ab"
    assert m.propose(np.array([1, 2, 3]), 1)[1].tolist() == [5]  # later input is newer
    Corpus.from_spans([[1]], fingerprint="sha256:cd").save(inputs / "z.rdc")
    assert cli("merge", inputs / "x.rdc", inputs / "z.rdc", "--out", inputs / "bad.rdc") == 2
    assert cli("merge", inputs / "x.rdc", inputs / "z.rdc", "--out", inputs / "ok.rdc", "--force") == 0


def test_convert_round_trip(inputs):
    assert cli("convert", inputs / "a.txt", "--out", inputs / "a.rdc", "--to", "binary") == 0
    assert cli("convert", inputs / "a.rdc", "--out", inputs / "a2.txt", "--to", "text") == 0
    assert cli("convert", inputs / "a2.txt", "--out", inputs / "a3.rdc", "--to", "binary") == 0
    assert (inputs / "a.rdc").read_bytes() == (inputs / "a3.rdc").read_bytes()
    assert [s.tolist() for s in load_corpus(inputs / "a2.txt").span_list()] == [[1, 2, 3, 4, 5], [6, 7, 8]]


def test_compact_and_stats(inputs, capsys):
    Corpus.from_spans([[1, 2, 3, 4], [7, 7], [7, 7], [1, 2, 3, 4, 9]], vocab_size=50).save(inputs / "s.rdc")
    assert cli("compact", inputs / "s.rdc") == 0
    assert load_corpus(inputs / "s.rdc").n_tokens == 13
    assert cli("stats", inputs / "s.rdc") == 0
    out = capsys.readouterr().out
    assert "13 in 4 spans" in out and "3-grams 3" in out and "2x" in out
    s = corpus_stats(inputs / "s.rdc")
    assert s["distinct_ngrams"] == {1: 6, 3: 3, 8: 0}
    assert s["top_repeated_spans"] == [{"count": 2, "length": 2, "head": [7, 7]}]
    assert s["vocab_size"] == 50 and s["file_bytes"] > 0


def test_distinct_ngrams_never_cross_spans():
    tokens = np.array([1, 2, 1, 2], dtype=np.int64)
    assert distinct_ngrams(tokens, np.array([0, 2, 4]), 2) == 1
    assert distinct_ngrams(tokens, np.array([0, 4]), 2) == 2
    assert distinct_ngrams(tokens, np.array([0, 1, 2, 3, 4]), 2) == 0


def test_missing_input_is_exit_code_2(tmp_path, capsys):
    assert cli("stats", tmp_path / "nope.rdc") == 2
    assert "nope.rdc" in capsys.readouterr().err
