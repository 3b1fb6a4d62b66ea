"""Spec-Bench's 480 questions (Apache-2.0, see redraft/data/SPEC_BENCH_LICENSE), bundled with redraft.

Every command that needs questions (demo, oracle, bench workloads, GliDe training and evaluation) reads them here.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path


def load_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """Spec-Bench questions in file order: dicts with ``question_id``, ``category`` and ``turns`` (list of str).

    Args:
        path: a JSONL file of the same shape; None = the copy bundled with redraft.
    Raises:
        ValueError: a line of ``path`` is not valid JSON (the message names the file and line).
        OSError: ``path`` cannot be read.
    """
    if path is None:
        text = resources.files("redraft").joinpath("data/spec_bench_question.jsonl").read_text(encoding="utf-8")
        where = "redraft/data/spec_bench_question.jsonl"
    else:
        text, where = Path(path).read_text(encoding="utf-8"), os.fspath(path)
    out = []
    for no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{no}: invalid JSON ({e.msg})") from e
    return out
