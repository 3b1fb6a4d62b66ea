"""`redraft bench run --rounds R`: rounds merged per question (median seconds, fastest ceiling, round 1's decisions,
changes between rounds flagged), end to end on the tiny random-weight Llama, and the flag's validation."""

from __future__ import annotations

import pytest

from redraft.bench.harness import bench
from redraft.bench.methods import MethodConfig
from redraft.bench.report import ceiling_cell, differing, summarize
from redraft.bench.rounds import merge_rounds, merge_rows, rounds_differing
from redraft.bench.workloads import ByteEncoder
from redraft.io.questions import load_questions
from redraft.pricing import CostCurve

VOCAB = 96
CURVE = CostCurve((0, 1, 4, 16, 48), (1.0, 1.6, 1.75, 2.9, 5.5))


def row(q: str, method: str, seconds: float, *, ceiling: float | None = None, ids=None, identical: bool = True,
        forwards: int = 4, depths=(0, 2, 2, 0), accepted=(0, 2, 1, 0)) -> dict:
    """A synthetic run row as run_methods writes it (5 tokens; output ids stored for plain or when differing)."""
    r = {"question_id": q, "category": "x", "turn": 1, "method": method, "order": 0, "prompt_tokens": 3,
         "tokens": 5, "seconds": seconds, "tok_s": 5 / seconds, "forwards": forwards,
         "tokens_per_forward": 5 / forwards, "accepted_per_forward": list(accepted),
         "draft_depth_per_forward": list(depths), "sources": {}, "stop_reason": "length", "rss_peak_mb": 10 * seconds,
         "identical": identical, "first_diff": None if identical else 2}
    if ceiling is not None:
        r["ceiling_seconds"] = ceiling
        r["of_ceiling"] = ceiling / seconds
    if ids is not None:
        r["output_ids"] = list(ids)
    return r


def one_round(plain_s, pol_s, ceiling, *, plain_ids=(1, 2, 3, 4, 5), pol_depths=(0, 2, 2, 0)) -> dict:
    return {"w": {"description": "d", "questions": [{"question_id": "a"}],
                  "runs": [row("a", "plain", plain_s, ceiling=ceiling, ids=plain_ids, forwards=5,
                               depths=(0,) * 5, accepted=(0,) * 5),
                           row("a", "policy", pol_s, ceiling=ceiling, depths=pol_depths)]}}


def test_merge_takes_median_seconds_and_fastest_ceiling():
    rounds = [one_round(2.0, 1.0, 0.30), one_round(1.0, 3.0, 0.20), one_round(4.0, 2.0, 0.25)]
    merged = merge_rounds(rounds)["w"]["runs"]
    plain, pol = merged
    assert plain["round_seconds"] == [2.0, 1.0, 4.0] and plain["seconds"] == 2.0
    assert pol["round_seconds"] == [1.0, 3.0, 2.0] and pol["seconds"] == 2.0
    assert pol["tok_s"] == pytest.approx(5 / 2.0)
    assert pol["ceiling_seconds"] == 0.20 and pol["round_ceiling_seconds"] == [0.30, 0.20, 0.25]
    assert pol["of_ceiling"] == pytest.approx(0.20 / 2.0)
    assert pol["of_ceiling_fastest"] == pytest.approx(0.20 / 1.0)  # the fastest round against the fastest ceiling
    assert pol["rss_peak_mb"] == pytest.approx(30.0)  # the largest round's
    assert all(r["rounds_identical"] and r["rounds_differing"] == [] and r["identical"] for r in merged)
    assert "round_output_ids" not in pol and "output_ids" not in pol
    # the summaries come out of the merged rows: speedup = median tok/s over plain's
    s = summarize(merged, ["plain", "policy"])
    assert s["policy"]["speedup"] == pytest.approx(1.0) and s["policy"]["of_ceiling_median"] == pytest.approx(0.1)
    assert s["policy"]["of_ceiling_fastest_median"] == pytest.approx(0.2)
    assert ceiling_cell(s["policy"]) == "0.10 / 0.10 (0.20 / 0.20)"
    assert rounds_differing({"w": {"runs": merged}}) == []


def test_merge_flags_a_round_whose_decisions_differ():
    rounds = [one_round(2.0, 1.0, None), one_round(2.0, 1.0, None, pol_depths=(0, 3, 2, 0))]
    merged = merge_rounds(rounds)
    pol = merged["w"]["runs"][1]
    assert pol["rounds_identical"] is False and pol["rounds_differing"] == [2]
    assert pol["draft_depth_per_forward"] == [0, 2, 2, 0]  # round 1's
    assert pol["identical"]  # same output ids: a change of decisions alone is not an output failure
    assert "ceiling_seconds" not in pol
    assert rounds_differing(merged) == [{"workload": "w", "method": "policy", "questions": ["a"]}]


def test_plain_output_changing_between_rounds_is_a_failure():
    rounds = [one_round(2.0, 1.0, None), one_round(2.0, 1.0, None, plain_ids=(1, 2, 9, 4, 5))]
    merged = merge_rounds(rounds)
    plain, pol = merged["w"]["runs"]
    assert plain["identical"] is False and plain["first_diff"] == 2 and plain["rounds_differing"] == [2]
    assert plain["output_ids"] == [1, 2, 3, 4, 5]
    assert plain["round_output_ids"] == [[1, 2, 3, 4, 5], [1, 2, 9, 4, 5]]
    # policy stored no ids (identical to its round's plain): its output changed with plain's, and is flagged too
    assert pol["identical"] is False and pol["rounds_differing"] == [2]
    for w in merged.values():
        w["summary"] = summarize(w["runs"], ["plain", "policy"])
    flagged = differing({"workloads": merged})
    assert {d["method"] for d in flagged} == {"plain", "policy"} and not any(d["expected"] for d in flagged)


def test_a_method_differing_from_plain_in_a_later_round_is_a_failure():
    later = one_round(2.0, 1.0, None)
    later["w"]["runs"][1].update(identical=False, first_diff=3, output_ids=[1, 2, 3, 7, 5])
    pol = merge_rounds([one_round(2.0, 1.0, None), later])["w"]["runs"][1]
    assert pol["identical"] is False and pol["first_diff"] == 3 and pol["rounds_differing"] == [2]


def test_merge_refuses_rounds_that_do_not_match():
    a = one_round(1.0, 1.0, None)
    b = one_round(1.0, 1.0, None)
    b["w"]["runs"].pop()
    with pytest.raises(ValueError, match="round 2"):
        merge_rounds([a, b])
    with pytest.raises(ValueError, match="no rounds"):
        merge_rounds([])
    with pytest.raises(ValueError, match="one plain greedy row per round"):
        merge_rows([a["w"]["runs"][0]], [])


@pytest.fixture(scope="module")
def model():
    from conftest import build_tiny

    return build_tiny("llama", "sdpa", seed=0)


def test_bench_two_rounds_on_the_tiny_model(model, monkeypatch):
    """Two rounds: every row holds both rounds' seconds, the outputs and decisions repeat, and the policy's cost
    curve is measured once (round 2 reuses it)."""
    import redraft.pricing.cache as cost_cache

    measured = []

    def fake_curve(m, *a, **kw):
        measured.append(1)
        return CURVE

    monkeypatch.setattr(cost_cache, "cached_cost_curve", fake_curve)
    res = bench(model, [], ByteEncoder(VOCAB), load_questions(), counts={"replay": 1, "novel": 2}, ngen=12,
                methods=["plain", "ngram", "policy"], max_prompt_tokens=40, vocab_size=VOCAB, progress=False,
                rss_interval=0, cfg=MethodConfig(), rounds=2)
    assert measured == [1]
    assert res["config"]["rounds"] == 2 and res["cost_curves"] == {"policy": CURVE.to_dict()}
    rows = [r for w in res["workloads"].values() for r in w["runs"]]
    assert len(rows) == 3 * 3
    for r in rows:
        assert len(r["round_seconds"]) == 2 and r["seconds"] == pytest.approx(sum(r["round_seconds"]) / 2)
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["ceiling_seconds"] == min(r["round_ceiling_seconds"])
        assert r["identical"] and r["rounds_identical"], (r["question_id"], r["method"])
    assert res["differing"] == [] and res["rounds_differing"] == []
    with pytest.raises(ValueError, match="rounds"):
        bench(model, [], ByteEncoder(VOCAB), load_questions(), counts={"novel": 1}, ngen=4, rounds=0)


def test_cli_refuses_zero_rounds(capsys):
    from redraft.cli import build_parser

    p = build_parser()
    assert p.parse_args(["bench", "run"]).rounds == 1
    assert p.parse_args(["bench", "run", "--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit) as e:
        p.parse_args(["bench", "run", "--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_cli_names_the_option_of_an_unknown_method_or_workload(capsys):
    from redraft.cli import build_parser

    p = build_parser()
    for argv, flag in ((["--methods", "plain,nosuch"], "--methods"), (["--workloads", "nosuch"], "--workloads")):
        args = p.parse_args(["bench", "run", *argv])
        with pytest.raises(SystemExit) as e:
            args.func(args)
        assert e.value.code == 2 and f"error: {flag}: unknown" in capsys.readouterr().err


def test_cli_refuses_an_output_it_cannot_write_before_the_run(capsys, tmp_path, monkeypatch):
    from redraft.cli import build_parser

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("redraft.cli.bench.os.makedirs", refuse)
    args = build_parser().parse_args(["bench", "run", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        args.func(args)
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
