"""The llama.cpp load probe (redraft/runtimes/llamacpp/probe.py) against a stand-in llama_cpp (tests/runtimes/fakellama): a
build whose batched decode crashes never takes the loading process down, the configuration that runs and is
batch-invariant is chosen, and the verdict is cached per build, CPU and file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redraft.runtimes.llamacpp.probe import INVARIANT_SLACK, Config, ProbeFailed, ProbeResult, choose, settle

FAKE = Path(__file__).resolve().parent / "fakellama"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The stand-in llama_cpp first on the children's path (never imported in this process); a GGUF-named file."""
    monkeypatch.setenv("PYTHONPATH", f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    return gguf


def test_a_build_that_crashes_with_its_extra_buffers_loads_without_them(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA", "crash-extra")
    v = settle(fake, threads=1, cache=tmp_path / "c")
    assert v.config.extra_bufts is False and v.invariant is True
    assert "SIGILL" in v.note and "make llama" in v.note
    assert [p["runs"] for p in v.probes] == [False, False, True, True]


def test_the_verdict_is_cached_per_file_and_probed_again_when_the_file_changes(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA", "crash-extra")
    first = settle(fake, threads=1, cache=tmp_path / "c")
    monkeypatch.setenv("FAKE_LLAMA", "crash-all")  # a new probe would fail now: the cached verdict must answer
    assert settle(fake, threads=1, cache=tmp_path / "c") == first
    fake.write_bytes(b"GGUF another fake file")  # another size: another key, probed again
    with pytest.raises(ProbeFailed, match="SIGSEGV"):
        settle(fake, threads=1, cache=tmp_path / "c")


def test_a_build_that_crashes_everywhere_is_an_error_naming_each_failure(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA", "crash-all")
    with pytest.raises(ProbeFailed) as e:
        settle(fake, threads=1, cache=tmp_path / "c")
    assert "SIGSEGV" in str(e.value) and "4 kernel configurations" in str(e.value)
    assert not list((tmp_path / "c").glob("*.json"))  # a failure is not cached: a rebuild is probed afresh


def test_non_invariant_kernels_give_way_to_invariant_ones_of_the_same_speed(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA", "noisy-both")
    v = settle(fake, threads=1, cache=tmp_path / "c")
    default = v.probes[0]
    assert default["runs"] and not default["invariant"] and 0 < max(default["max_diff"].values()) < 1e-2
    assert v.config == Config(extra_bufts=False, tiled_matmul=False) and v.invariant
    assert "GGML_CPU_TILED_MM=0" in v.note and "--no-repack" in v.note
    # a process whose tiled matmul is fixed already is offered only the configurations with that setting
    fixed = settle(fake, threads=1, tiled_matmul=True, cache=tmp_path / "c")
    assert fixed.config.tiled_matmul and not fixed.invariant and len(fixed.probes) == 2


def test_a_well_behaved_build_keeps_llama_cpps_defaults_after_one_probe(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA", "")
    v = settle(fake, threads=1, cache=tmp_path / "c")
    assert (v.config, v.invariant, v.note, len(v.probes)) == (Config(), True, "", 1)


def test_choose_prefers_an_invariant_kernel_unless_it_is_clearly_slower():
    fast = ProbeResult(Config(), True, invariant=False, max_diff={"8": 1e-4}, step_ms=10.0)
    slow = ProbeResult(Config(False, False), True, invariant=True, max_diff={"8": 0.0},
                       step_ms=10.0 * INVARIANT_SLACK * 1.5)
    assert choose([fast, slow]).config == Config() and not choose([fast, slow]).invariant
    near = ProbeResult(Config(False, False), True, invariant=True, max_diff={"8": 0.0}, step_ms=10.5)
    assert choose([fast, near]).config == Config(False, False)
    assert choose([fast, ProbeResult(Config(False), False, why="x")]).config == Config()


def test_a_process_that_loads_a_crashing_build_survives_and_decodes_batches(fake, tmp_path):
    """The whole path in a process of its own (as `redraft run` would): the target probes, then decodes 9 rows."""
    code = ("from redraft.runtimes.llamacpp.target import LlamaCppTarget\n"
            "t = LlamaCppTarget(__import__('sys').argv[1], n_ctx=64, n_threads=1)\n"
            "rows = t.forward(list(range(3, 12)), n_logits=9)\n"
            "print(__import__('json').dumps([t.extra_bufts, t.tiled_matmul, t.numerics, list(rows.shape)]))\n")
    env = {**os.environ, "FAKE_LLAMA": "crash-extra", "REDRAFT_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code, str(fake)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [False, True, "llama.cpp batch-invariant", [9, 64]]
    assert "SIGILL" in r.stderr  # the one warning line says what was avoided


def test_a_file_llama_cpp_refuses_is_named_once_without_probing_every_kernel(fake, tmp_path, monkeypatch):
    """A truncated or foreign file is not a build problem: one child, then the file's own fault in the message."""
    monkeypatch.setenv("FAKE_LLAMA", "")
    fake.write_bytes(b"GGUF bad, cut short")
    with pytest.raises(ProbeFailed) as e:
        settle(fake, threads=1, cache=tmp_path / "c")
    assert e.value.file_refused and "not a complete GGUF file" in str(e.value)
    assert "make llama" not in str(e.value) and "configurations" not in str(e.value)
