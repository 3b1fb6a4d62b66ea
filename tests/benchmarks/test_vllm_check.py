"""The vLLM check's own logic (benchmarks/vllm/vllm_check.py), without vLLM: the report, merging processes, the
refusals before any engine runs, and a child engine process started from the script's own path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm" / "vllm_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # the vLLM rigs import each other by their file names, as when run

from vllm_check import QUESTIONS, main, merge_processes, report  # noqa: E402


def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def check_result(outputs, seconds, spec=None):
    return {"prompts": [[1, 2]] * len(outputs), "outputs": outputs, "seconds": seconds,
            "tokens": sum(map(len, outputs)), "spec": spec or {}}


def test_vllm_check_report_says_whether_ids_are_identical(tmp_path, capsys):
    args = SimpleNamespace(model="m", ngen=4, batch=False, dtype="float32", k=8, no_policy=False)
    plain = check_result([[5, 6, 7, 8], [9, 9]], 2.0)
    spec = {"vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_draft_tokens": 16,
            "vllm:spec_decode_num_accepted_tokens": 12}
    same = report("replay", plain, check_result([[5, 6, 7, 8], [9, 9]], 0.5, spec), args, tmp_path)
    assert same["identical"] == same["questions"] == 2 and same["speedup"] == 4.0 and same["accepted"] == 12
    out = capsys.readouterr().out
    assert "identical ids: 2/2" in out and "mean acceptance length 7.00" in out and "(4.00x)" in out
    differ = report("novel", plain, check_result([[5, 6, 0, 8], [9, 9]], 0.5, spec), args, tmp_path)
    assert differ["identical"] == 1
    assert "question 0: first difference at output token 2" in capsys.readouterr().out


def test_vllm_check_refuses_a_model_that_is_not_a_directory(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope")]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_vllm_check_merges_processes_by_their_median_and_refuses_differing_outputs():
    def engine(seconds, outputs=((1, 2), (3,))):
        one = {"outputs": [list(o) for o in outputs], "seconds": seconds, "round_seconds": [seconds, seconds + 1],
               "tokens": 3, "spec": {"drafts": 1}}
        return {"replay": one, "novel": dict(one), "curve": None}

    merged = merge_processes([engine(7.0), engine(5.0), engine(9.0)])
    assert merged["replay"]["seconds"] == 7.0 and merged["novel"]["process_seconds"] == [7.0, 5.0, 9.0]
    assert merged["replay"]["round_seconds"] == [7.0, 8.0, 5.0, 6.0, 9.0, 10.0]
    with pytest.raises(RuntimeError, match="novel"):
        bad = engine(6.0)
        bad["novel"] = dict(bad["novel"], outputs=[[1, 2], [4]])
        merge_processes([engine(7.0), bad])


def test_vllm_check_refuses_bad_counts_and_missing_files_before_any_engine_runs(capsys, tmp_path):
    for argv, says in ((["--processes", "0"], "--processes 0: expected an integer >= 1"),
                       (["--k", "0"], "--k 0: expected an integer >= 1"), (["--n", "0"], "--n 0: expected"),
                       (["--ngen", "-1"], "--ngen -1: expected"),
                       (["--questions", str(tmp_path / "no.jsonl")], "no.jsonl: no such file"),
                       (["--cost-curve", str(tmp_path / "no.json")], "no.json: no such file")):
        with pytest.raises(SystemExit) as e:
            main(["--model", str(tmp_path), *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


def test_vllm_check_defaults_to_the_bundled_questions():
    assert QUESTIONS.is_file() and QUESTIONS.parent.parent.name == "redraft"


@pytest.mark.skipif(has_vllm(), reason="checks the child's start where vLLM is absent")
def test_vllm_check_starts_its_engine_process_from_the_script(tmp_path):
    """The parent starts each engine as ``python benchmarks/vllm/vllm_check.py --child``: without vLLM that child
    runs and says vLLM cannot be imported (exit 2), not that the script or a module is missing."""
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--workdir", str(tmp_path / "w")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "vLLM cannot be imported" in r.stderr, r.stderr
