"""The rigs under benchmarks/ run as scripts from the repository root (``python benchmarks/...py``): each answers
``--help`` with its usage, importing redraft and its sibling scripts as it does when run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "benchmarks/vllm/vllm_check.py": "--batch",
    "benchmarks/vllm/vllm_fleet_check.py": "--server-python",
    "benchmarks/vllm/vllm_fleet_load.py": "--vllm-python",
    "benchmarks/batching/batching_probe.py": "{concurrent,step,noise}",
    "benchmarks/serve/templated.py": "--questions",
    "benchmarks/grammar/structured.py": "--max-new-tokens",
    "benchmarks/policy/novel_variants.py": "--questions",
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_answers_help(script):
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:") and SCRIPTS[script] in r.stdout, r.stdout
