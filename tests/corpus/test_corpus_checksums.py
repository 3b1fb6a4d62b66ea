"""Binary corpora carry CRC-32s: damage anywhere is refused with the file and section named (issue 11, item 6)."""

import json
import os
import struct

import numpy as np
import pytest

from redraft.cli import main as cli_main
from redraft.corpus import Corpus, CorpusError, load_corpus
from redraft.corpus import format as fmt
from redraft.corpus.tools import verify_corpus

SPANS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 20, 21], list(range(30, 330))]  # > BLOCK rows: a 2-level table


def saved(tmp_path, spans=SPANS, name="c.rdc"):
    p = tmp_path / name
    Corpus.from_spans(spans, vocab_size=400).save(p)
    return p


def sections(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges [a, b) of every part of a version-2 file that a reader depends on."""
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[20:20 + hlen])
    out = {"magic": (0, 8), "version": (8, 12), "header length": (12, 16), "header checksum": (16, 20),
           "header": (20, 20 + hlen)}
    for name, spec in header["arrays"].items():
        out[fmt.SECTIONS[name]] = (spec["offset"], spec["offset"] + np.dtype(spec["dtype"]).itemsize * spec["count"])
    return out


def test_every_section_is_present_and_the_file_is_version_2(tmp_path):
    data = saved(tmp_path).read_bytes()
    parts = sections(data)
    assert struct.unpack_from("<I", data, 8)[0] == fmt.VERSION == 2
    assert all(b > a for a, b in parts.values()), parts


def test_a_flipped_byte_anywhere_a_reader_uses_is_refused(tmp_path):
    """A flipped byte in any section (every byte of the prefix, 48 spread over each other section, both ends
    included) is refused at open; the message names the file (and, for the arrays and the header, the damaged
    section). Alignment padding is never read: flipping it changes nothing."""
    p = saved(tmp_path)
    data = p.read_bytes()
    parts = sections(data)
    q = tmp_path / "damaged.rdc"
    used = np.zeros(len(data), dtype=bool)
    for part, (a, b) in parts.items():
        used[a:b] = True
        for pos in sorted(set(np.linspace(a, b - 1, min(b - a, 48)).astype(int).tolist())):
            q.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:])
            with pytest.raises(CorpusError) as e:
                load_corpus(q)
            msg = str(e.value)
            assert str(q) in msg, (part, pos, msg)
            if part in fmt.SECTIONS.values():
                assert f"the {part} section" in msg, (part, pos, msg)
            elif part.startswith("header "):
                assert "header" in msg, (part, pos, msg)
    for pos in np.flatnonzero(~used)[::7].tolist():
        q.write_bytes(data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1:])
        assert load_corpus(q).propose(np.array([3, 4, 5]), 2)[1].tolist() == [20, 21]


def test_array_damage_names_the_section(tmp_path):
    p = saved(tmp_path)
    data = p.read_bytes()
    for name, (a, b) in sections(data).items():
        if name in fmt.SECTIONS.values():
            mid = (a + b) // 2
            p.write_bytes(data[:mid] + bytes([data[mid] ^ 0x80]) + data[mid + 1:])
            with pytest.raises(CorpusError, match=rf"damaged binary corpus: the {name} section .* fails its checksum"):
                load_corpus(p)


def test_verify_passes_a_good_file_and_refuses_a_damaged_one(tmp_path, capsys):
    p = saved(tmp_path)
    assert verify_corpus(p) == {"path": str(p), "format": "binary", "version": 2, "n_tokens": 314, "n_spans": 3}
    assert cli_main(["corpus", "verify", str(p)]) == 0
    assert "ok" in capsys.readouterr().out
    data = p.read_bytes()
    a, b = sections(data)["token stream"]
    p.write_bytes(data[:a] + bytes([data[a] ^ 0x04]) + data[a + 1:])
    assert cli_main(["corpus", "verify", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(p) in err and "token stream" in err


def test_verify_catches_an_index_written_wrong_with_a_valid_checksum(tmp_path):
    c = Corpus.from_spans(SPANS)
    seg = c.segments[0]
    seg.sa = seg.sa.copy()
    seg.sa[[0, 1]] = seg.sa[[1, 0]]  # a faulty writer: the checksum covers what was written
    p = tmp_path / "wrong.rdc"
    c.save(p)
    load_corpus(p)  # the checksums match
    with pytest.raises(CorpusError, match="suffix array does not match the token stream"):
        verify_corpus(p)


def test_verify_text_corpus(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("1 2 3 -1 4 5\n")
    assert verify_corpus(p)["n_spans"] == 2
    p.write_text("1 2 x\n")
    with pytest.raises(CorpusError, match="not an integer"):
        verify_corpus(p)


def as_version_1(data: bytes) -> bytes:
    """The same file in the version 1 layout: no header checksum (16-byte prefix), arrays where they were."""
    hlen = struct.unpack_from("<I", data, 12)[0]
    return struct.pack("<8sII", fmt.MAGIC, 1, hlen) + data[20:20 + hlen] + b"\0" * 4 + data[20 + hlen:]


def test_version_1_is_read_with_a_warning_and_compact_upgrades_it(tmp_path, capsys):
    p = tmp_path / "old.rdc"
    p.write_bytes(as_version_1(saved(tmp_path).read_bytes()))
    c = load_corpus(p)
    assert c.propose(np.array([3, 4, 5]), 2)[1].tolist() == [20, 21]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(p) in err and f"redraft corpus compact {p}" in err
    assert cli_main(["corpus", "compact", str(p)]) == 0
    capsys.readouterr()
    assert fmt.binary_version(p) == 2
    load_corpus(p)
    assert capsys.readouterr().err == ""


def test_writes_are_atomic(tmp_path, monkeypatch):
    p = saved(tmp_path)
    before = p.read_bytes()

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt.os, "replace", fail)
    for kind in ("binary", "text"):
        with pytest.raises(CorpusError, match="cannot write corpus"):
            Corpus.from_spans([[7, 8, 9]]).save(p, fmt=kind)
        assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.rdc"]  # no temporary file left behind
