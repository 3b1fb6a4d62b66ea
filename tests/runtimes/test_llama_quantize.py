"""``redraft quantize`` (redraft/runtimes/llamacpp/quantize.py, redraft/cli/quantize.py): bad input is refused
before llama.cpp is touched; with the llama extra, a tiny GGUF written by the gguf package is requantized by
llama.cpp's own quantizer into the cache, every weight in the type asked, and reused the next time."""

from __future__ import annotations

import numpy as np
import pytest

from redraft.cli import main
from redraft.runtimes.llamacpp.quantize import QuantizeError, check_source, quantize, quantized_path
from tests.llamakit import needs_llama


def tiny_llama_gguf(path, vocab: int = 64, dim: int = 64, ff: int = 128) -> None:
    """A one-layer Llama GGUF of random F32 weights (the gguf package's writer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(dim // 2)
    w.add_file_type(0)
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(vocab, dim))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("output.weight", weight(vocab, dim))
    for name, shape in (("attn_q", (dim, dim)), ("attn_k", (dim, dim)), ("attn_v", (dim, dim)),
                        ("attn_output", (dim, dim)), ("ffn_gate", (ff, dim)), ("ffn_up", (ff, dim)),
                        ("ffn_down", (dim, ff))):
        w.add_tensor(f"blk.0.{name}.weight", weight(*shape))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(dim, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unknown_type_a_missing_file_and_a_file_that_is_not_gguf_are_refused(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    with pytest.raises(QuantizeError, match="type 'q9_9': expected one of q4_0"):
        check_source(gguf, "q9_9")
    with pytest.raises(QuantizeError, match="no such file"):
        check_source(tmp_path / "absent.gguf", "q4_0")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(QuantizeError, match="not a GGUF file"):
        quantize(text, "q4_0")


def test_a_truncated_gguf_and_a_directory_are_named_as_such(tmp_path):
    whole = tmp_path / "whole.gguf"
    tiny_llama_gguf(whole)
    assert check_source(whole, "q8_0") == (whole, "q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    with pytest.raises(QuantizeError, match="not a complete GGUF file: truncated or damaged"):
        check_source(cut, "q8_0")
    with pytest.raises(QuantizeError, match="a directory"):
        check_source(tmp_path, "q8_0")


def test_the_command_says_what_is_wrong_in_one_line(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "absent.gguf"), "--type", "q4_0"]) == 1
    assert "model " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--type", "q3_z"])
    assert e.value.code == 2 and "invalid choice: 'q3_z'" in capsys.readouterr().err


def test_the_cached_copy_is_named_by_the_source_and_type(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF one")
    a = quantized_path(src, "q4_0", tmp_path)
    assert a.parent == tmp_path / "quantized" and a.name.endswith(".q4_0.gguf")
    assert quantized_path(src, "q8_0", tmp_path) != a
    src.write_bytes(b"GGUF another size")
    assert quantized_path(src, "q4_0", tmp_path) != a  # an edited source gets a new copy


@needs_llama
def test_llama_cpps_quantizer_writes_every_weight_in_the_type_and_the_copy_is_reused(tmp_path, monkeypatch, capsys):
    import gguf

    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny.gguf"
    tiny_llama_gguf(src)
    path, made = quantize(src, "q8_0")
    assert made and path.is_file() and path.parent == tmp_path / "cache" / "quantized"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {"Q8_0"}  # output layer included
    assert quantize(src, "q8_0") == (path, False)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    assert main(["quantize", str(src), "--type", "q4_0", "--no-probe"]) == 0
    out = capsys.readouterr()
    q4 = out.out.strip()
    assert q4.endswith(".q4_0.gguf") and "written in" in out.err
    assert {t.tensor_type.name for t in gguf.GGUFReader(q4).tensors if t.name.endswith("attn_q.weight")} == {"Q4_0"}
