"""Three ``redraft serve`` processes on one corpus directory (the tiny saved model; the fleet phase of
``redraft bench serve`` at a small size): a greedy answer of one replica is replayed by another within 2 s,
identical; a mixed load with two ``kill -9`` while requests run and one while a replica holds the compaction lock
loses no completed answer and stores no prompt's span twice (the checker reads every journal and the base).
Marked slow (six server processes start here)."""

from __future__ import annotations

import pytest
from serverkit import words

from redraft.bench.fleet_bench import FleetBenchConfig, run_fleet_phase

pytestmark = pytest.mark.slow


def test_three_replicas_share_what_each_learns(model_dir, loaded, tmp_path):
    questions = [words([(7 * i + j) % 60 + 2 for j in range(6)]) for i in range(21)]
    cfg = FleetBenchConfig(servers=3, requests=60, distinct=20, concurrency=4, max_tokens=16, replay_max_tokens=48,
                           kills=2, kill_in_compaction=True, compact_tokens=64, timeout=300,
                           seed_tokens=100_000, latency=False)  # the latency comparison is the bench's
    out = run_fleet_phase(str(model_dir), tmp_path, cfg, questions, threads=1,
                          decode=lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True))
    print(out)
    assert out["replayed"] and out["replay_identical"] and out["replay_delay_seconds"] <= 2.0
    assert out["replay_forwards"] == 1 < out["first_forwards"]  # asked one follow interval after the first answer
    assert out["kills"] == 2 and out["completed"] == out["sent"] == 60
    assert out["lost_completed"] == 0 and out["stored_twice"] == 0 and out["problems"] == 0
    assert out["killed_in_compaction"]
