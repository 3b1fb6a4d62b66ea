"""Model time of a run (redraft.bench.modeltime): verify cost in plain steps from draft depths and a cost curve."""

from __future__ import annotations

import json

import pytest

from redraft.bench.modeltime import main, model_time, results_model_time
from redraft.pricing import CostCurve

CURVE = CostCurve((0, 4, 64), (1.0, 1.4, 4.2))  # c(n) linear between the points


def test_plain_decoding_is_one_x_and_a_replay_counts_the_prompts_forward_with_its_draft():
    plain = model_time(CURVE, 21, 10, [0] * 10, [0] * 10)
    assert plain.plain == pytest.approx(CURVE.cost(20) + 9) and plain.speedup == pytest.approx(1.0)
    assert plain.losses == ()
    replay = model_time(CURVE, 21, 10, [9], [9])  # the whole answer drafted on the prompt's forward
    assert replay.drafted == pytest.approx(CURVE.cost(29))
    assert replay.speedup == pytest.approx((CURVE.cost(20) + 9) / CURVE.cost(29))


def test_drafts_that_lost_are_listed_with_their_gain():
    # prompt forward: 4 drafted, none accepted (marginal cost c(24) - c(20)); then a 4-token draft that failed,
    # then one accepted whole
    mt = model_time(CURVE, 21, 7, [4, 4, 4, 0], [0, 0, 4, 0])
    first = CURVE.cost(24) - CURVE.cost(20)
    assert mt.losses == ((0, 4, 0, round(-first, 3)), (1, 4, 0, round(1 - CURVE.cost(4), 3)))
    assert mt.drafted == pytest.approx(CURVE.cost(24) + 2 * CURVE.cost(4) + 1)
    with pytest.raises(ValueError, match="prompt_tokens"):
        model_time(CURVE, 0, 5, [], [])
    with pytest.raises(ValueError, match="accepted count"):
        model_time(CURVE, 3, 5, [1], [])


def test_results_model_time_reads_bench_results(tmp_path, capsys):
    run = {"method": "policy", "question_id": "7", "prompt_tokens": 21, "tokens": 10, "forwards": 1,
           "draft_depth_per_forward": [9], "accepted_per_forward": [9]}
    results = {"cost_curves": {"policy": CURVE.to_dict()},
               "workloads": {"replay": {"runs": [run, dict(run, method="plain", draft_depth_per_forward=None)]}}}
    rows = results_model_time(results)
    assert len(rows) == 1 and rows[0]["speedup"] == pytest.approx((CURVE.cost(20) + 9) / CURVE.cost(29))
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main([str(path)]) == 0
    assert "replay: median" in capsys.readouterr().out
