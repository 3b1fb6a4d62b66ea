"""The mixed-fleet load check's bookkeeping (benchmarks/vllm/vllm_fleet_load.py), without vLLM: which completed
answers a corpus directory holds, which count as lost and which are excused (vLLM's answers cut by length are
learned late), and questions stored twice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from redraft.bench.fleet_bench import answers_by_prompt
from redraft.corpus.online import OnlineCorpus

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm"
sys.path.insert(0, str(SCRIPTS))  # the vLLM rigs import each other by their file names, as when run

from vllm_fleet_load import VllmWorker, split_lost  # noqa: E402

VOCAB = 100
PROMPTS = [[1, 2, 3], [1, 2, 4], [5]]


def decode(ids):
    return " ".join(map(str, ids))


def test_stored_answers_by_question_and_twice(tmp_path):
    a = OnlineCorpus(tmp_path, vocab_size=VOCAB, follow_seconds=None)
    b = OnlineCorpus(tmp_path, vocab_size=VOCAB, follow_seconds=None)
    assert a.learn([1, 2, 3, 9, 9]) and a.learn([5, 7])
    assert b.learn([5, 8])  # another answer to question 2 from another writer: question 2 stored twice
    a.close(), b.close()
    texts, counts, problems, n_spans = answers_by_prompt(tmp_path, PROMPTS, decode)
    assert texts == {0: {"9 9"}, 2: {"7", "8"}} and counts == {0: 1, 2: 2} and problems == 0 and n_spans == 3


def test_lost_answers_count_unless_vllm_cut_them_by_length():
    stored = {0: {"9 9"}}
    answers = [(0, {"text": "9 9", "member": "vllm", "finish": "stop"}),
               (1, {"text": "6", "member": "server", "finish": "stop"}),
               (1, {"text": "6", "member": "vllm", "finish": "length"}),
               (2, {"text": "7", "member": "vllm", "finish": "stop"}),
               (2, {"text": "7", "member": "server", "finish": "length"})]
    assert split_lost(answers, stored) == {"lost_completed": 3, "vllm_length_cut_lost": 1}
    assert split_lost(answers[:1], stored) == {"lost_completed": 0, "vllm_length_cut_lost": 0}


def test_the_vllm_worker_starts_from_the_script(tmp_path):
    """The worker is ``python benchmarks/vllm/vllm_fleet_load.py --worker``: in an environment without vLLM it runs
    and fails on vLLM's import (named in its log), not on a missing script or module."""
    try:
        import vllm  # noqa: F401
        pytest.skip("checks the worker's start where vLLM is absent")
    except ImportError:
        pass
    worker = VllmWorker(sys.executable, str(tmp_path), tmp_path / "corpus", tmp_path / "vllm", k=4)
    with pytest.raises(RuntimeError, match="did not start"):
        worker.start()
    assert worker.proc is not None and worker.proc.wait(timeout=60) != 0
    log = (tmp_path / "vllm.1.log").read_text()
    assert "No module named 'vllm'" in log, log
