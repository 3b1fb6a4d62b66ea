"""``redraft bench serve``'s concurrent and longprompt phases: their statistics on fake timings, and short runs
against in-process servers of the tiny model."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest
from serverkit import live_server, serve_args, words

from redraft.bench import concurrency_stats as st
from redraft.bench.concurrency_stats import StreamRecord
from redraft.bench.concurrent_bench import (
    ConcurrentBenchConfig,
    concurrent_table,
    for_build,
    plain_answers,
    requests_for,
    run_concurrent_phase,
)


def rec(sent, chunks, tokens=0, status=200, done=None, error=None, **stats) -> StreamRecord:
    return StreamRecord(sent=sent, done=(chunks[-1] if chunks else sent) if done is None else done,
                        chunk_times=list(chunks), completion_tokens=tokens, status=status, error=error, stats=stats)


# ---- statistics -------------------------------------------------------------------------------------------------------

def test_percentile_interpolates_as_numpy_and_refuses_bad_q():
    assert st.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert st.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert st.percentile([], 50) is None
    with pytest.raises(ValueError, match="q: expected a percentile in 0..100"):
        st.percentile([1.0], 101)


def test_record_ttft_latency_and_ok():
    r = rec(10.0, [10.4, 10.5, 10.9], tokens=3)
    assert r.ok and r.ttft == pytest.approx(0.4) and r.latency == pytest.approx(0.9)
    assert rec(1.0, []).ttft is None
    assert not rec(1.0, [1.5], status=429).ok and not rec(1.0, [1.5], error="reset").ok
    assert not StreamRecord(sent=0.0, status=200).ok  # the stream never ended


def test_aggregate_rate_counts_answered_requests_over_the_wall_time():
    recs = [rec(0, [0.1, 0.2], tokens=10), rec(0, [0.3], tokens=6), rec(0, [0.3], tokens=50, status=500)]
    assert st.aggregate_rate(recs, 2.0) == 8.0  # (10 + 6) / 2 s: the failed request's tokens do not count
    assert st.aggregate_rate(recs, 0.0) == 0.0


def test_summarize_reports_percentiles_errors_and_queue_wait():
    recs = [rec(0.0, [0.1 * (i + 1), 1.0 + i], tokens=4, queue_seconds=0.01 * i) for i in range(5)]
    recs.append(rec(0.0, [], status=0, error="ConnectError"))
    recs[0].retries = 2
    s = st.summarize(recs, 4.0)
    assert (s["requests"], s["ok"], s["errors"], s["retries"], s["output_tokens"]) == (6, 5, 1, 2, 20)
    assert s["tokens_per_second"] == 5.0 and s["wall_seconds"] == 4.0
    assert s["ttft_p50"] == pytest.approx(0.3) and s["ttft_p95"] == pytest.approx(0.48)
    assert s["latency_p50"] == pytest.approx(3.0) and s["latency_p95"] == pytest.approx(4.8)
    assert s["queue_p50"] == pytest.approx(0.02)
    empty = st.summarize([], 1.0)
    assert empty["ttft_p50"] is None and empty["tokens_per_second"] == 0.0


def test_per_request_gives_each_request_its_own_figures_from_the_first_send():
    recs = [rec(5.0, [5.5, 6.0], tokens=2, queue_seconds=0.25), rec(7.0, [], status=0, error="reset")]
    got = st.per_request(recs)
    assert got[0] == {"sent": 0.0, "ttft": 0.5, "latency": 1.0, "tokens": 2, "queue": 0.25, "ok": True}
    assert got[1]["sent"] == 2.0 and got[1]["ttft"] is None and got[1]["queue"] is None and not got[1]["ok"]
    assert st.per_request([]) == []


def test_identical_compares_pairs_with_answers_only():
    out = st.identical(["a", "b", None, "d"], ["a", "x", "c", "d"])
    assert out == {"identical": 2, "compared": 3, "differing": [1]}
    with pytest.raises(ValueError, match="texts: expected 2 answers"):
        st.identical(["a"], ["a", "b"])


def test_ratio_guards_missing_and_zero():
    assert st.ratio(3.0, 1.5) == 2.0 and st.ratio(None, 1.0) is None and st.ratio(1.0, 0.0) is None


def test_arrival_delay_takes_the_largest_gap_across_the_window_over_the_median_gap_alone():
    alone = [0.1 * i for i in range(10)]  # gaps of 0.1 s
    with_arrival = [0.0, 0.1, 0.2, 0.3, 0.8, 0.9, 1.0, 2.0]  # 0.5 s gap across the arrival; 1.0 s gap after it
    d = st.arrival_delay(with_arrival, alone, start=0.35, end=0.7)
    assert d["baseline_gap"] == pytest.approx(0.1) and d["largest_gap"] == pytest.approx(0.5)
    assert d["extra_delay"] == pytest.approx(0.4) and d["gaps_in_window"] == 1
    assert d["window_gaps"] == [[pytest.approx(-0.05), pytest.approx(0.5)]]  # began 0.05 s before the arrival
    wider = st.arrival_delay(with_arrival, alone, start=0.35, end=1.5)
    assert wider["largest_gap"] == pytest.approx(1.0) and wider["gaps_in_window"] == 4
    ended = st.arrival_delay([0.0, 0.1], alone, start=0.5, end=0.6)  # the stream ended before the arrival
    assert ended["largest_gap"] is None and ended["extra_delay"] is None
    with pytest.raises(ValueError, match="end: expected a time at or after start"):
        st.arrival_delay(alone, alone, start=1.0, end=0.5)


# ---- configuration ----------------------------------------------------------------------------------------------------

def test_requests_per_level():
    assert [requests_for(n, 8) for n in (1, 4, 16)] == [8, 8, 32]


def test_for_build_uses_max_running_only_where_the_server_has_it():
    old = "  --max-queue MAX_QUEUE\n                        most waiting requests (default 256)\n"
    new = old + ("  --max-running N       requests decoded together (default 8)\n"
                 "  --max-batch-tokens N  most tokens in one forward, a prefill chunk\n"
                 "                        included (default 1,024)\n")
    cfg = ConcurrentBenchConfig()
    assert for_build(cfg, old).baseline_args == () and for_build(cfg, old).chunk_tokens == 512
    assert for_build(cfg, new).baseline_args == ("--max-running", "1")
    assert for_build(cfg, new).chunk_tokens == 1024
    given = ConcurrentBenchConfig(server_args=("--max-batch-tokens", "256"))
    assert for_build(given, new).chunk_tokens == 256
    assert for_build(ConcurrentBenchConfig(server_args=("--max-batch-tokens=128",)), new).chunk_tokens == 128
    cached = new + "  --no-answer-cache     decode every request\n"  # rounds must decode, not replay stored answers
    assert for_build(given, cached).baseline_args == ("--max-running", "1", "--no-answer-cache")
    assert for_build(given, cached).server_args == ("--max-batch-tokens", "256", "--no-answer-cache")


def test_cli_types_refuse_bad_lists(capsys):
    from redraft.cli import build_parser

    for bad in ("0,4", "a,b", ","):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", "--concurrency", bad])
        assert "--concurrency" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1,4,16",
                                      "--server-args=--max-running 16 --max-batch-tokens 512"])
    assert args.concurrency == [1, 4, 16]
    assert args.server_args == ["--max-running", "16", "--max-batch-tokens", "512"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--server-args='unclosed"])
    assert "--server-args" in capsys.readouterr().err


# ---- against in-process servers ---------------------------------------------------------------------------------------

def _starter(stack: ExitStack, model_dir, loaded, started: list):
    def start(name: str, args):
        started.append((name, list(args)))
        srv = stack.enter_context(live_server(serve_args(model_dir, *args), loaded))
        return srv.base, lambda: None
    return start


def test_concurrent_phase_against_tiny_servers(model_dir, loaded):
    """N = 1, 2 against two in-process servers: every figure present, every answer identical to the other
    server's and to plain greedy decoding."""
    from redraft.bench.server_process import serve_help

    prompts = tuple(words([3 + i, 9 + 2 * i, 20 + i, 5]) for i in range(6))
    cfg = for_build(ConcurrentBenchConfig(levels=(1, 2), max_tokens=6, min_requests=2, prompts=prompts,
                                          timeout=120), serve_help())
    started: list = []
    with ExitStack() as stack:
        res = run_concurrent_phase(_starter(stack, model_dir, loaded, started), cfg,
                                   plain=lambda ps, n: plain_answers(str(model_dir), ps, n), log=lambda _m: None)
    assert [n for n, _ in started] == ["concurrent-baseline", "concurrent-batched"]
    assert all(a[0] == "--no-learn" for _, a in started)
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    assert [lv["requests"] for lv in res["levels"]] == [2, 4]
    for lv in res["levels"]:
        for side in ("batched", "baseline"):
            s = lv[side]
            assert s["ok"] == lv["requests"] and s["errors"] == 0
            assert s["output_tokens"] > 0 and s["tokens_per_second"] > 0
            assert 0 < s["ttft_p50"] <= s["ttft_p95"] and s["latency_p50"] >= s["ttft_p50"]
        assert lv["tokens_per_second_ratio"] > 0 and lv["ttft_p50_ratio"] > 0
        assert lv["identical_to_baseline"]["identical"] == lv["identical_to_baseline"]["compared"] == lv["requests"]
        assert lv["identical_to_plain"]["identical"] == lv["identical_to_plain"]["compared"] == lv["requests"]
    assert res["all_identical"] is True
    json.dumps(res)  # raw JSON out
    table = concurrent_table(res)
    assert "N" in table and "4/4 base, 4/4 plain" in table


def test_concurrent_phase_reports_a_differing_answer(model_dir, loaded):
    """A plain reference that disagrees on one prompt makes ``all_identical`` false and names the request; each
    round asks the next questions (a question sent again would come from the prefix cache), here the two given ones
    again once they run out."""
    prompts = tuple(words([7 + i, 11, 13]) for i in range(2))
    cfg = ConcurrentBenchConfig(levels=(1,), max_tokens=4, min_requests=2, prompts=prompts, baseline_args=(),
                                timeout=120, rounds=2)
    asked = []

    def plain(ps, n):
        asked.append(list(ps))
        out = plain_answers(str(model_dir), ps, n)
        return [a + " changed" if p == prompts[0] else a for p, a in zip(ps, out, strict=True)]

    with ExitStack() as stack:
        res = run_concurrent_phase(_starter(stack, model_dir, loaded, []), cfg, plain=plain, log=lambda _m: None)
    lv = res["levels"][0]
    assert lv["requests"] == 4 and lv["batched"]["ok"] == lv["baseline"]["ok"] == 4  # two rounds pooled
    assert lv["identical_to_baseline"]["identical"] == 4
    assert lv["identical_to_plain"] == {"identical": 2, "compared": 4, "differing": [0, 2]}
    assert res["all_identical"] is False and asked == [list(prompts) * 2]
    assert [len(r) for r in lv["per_request"]["batched"]] == [2, 2]


def test_each_round_asks_the_next_questions(model_dir, loaded):
    prompts = tuple(words([20 + i, 11]) for i in range(4))
    cfg = ConcurrentBenchConfig(levels=(1,), max_tokens=2, min_requests=2, prompts=prompts, baseline_args=(),
                                timeout=120, rounds=2)
    asked = []

    def plain(ps, n):
        asked.append(list(ps))
        return plain_answers(str(model_dir), ps, n)

    with ExitStack() as stack:
        res = run_concurrent_phase(_starter(stack, model_dir, loaded, []), cfg, plain=plain, log=lambda _m: None)
    assert asked == [list(prompts)] and res["all_identical"] is True


def test_longprompt_phase_against_a_tiny_server(model_dir, loaded):
    """The probe's figures against one in-process server (a 300-token prompt, 32-token chunks: the tiny model's
    context is 640)."""
    from redraft.bench.longprompt_bench import longprompt_table, run_longprompt_phase

    cfg = ConcurrentBenchConfig(streams=2, stream_max_tokens=40, lead_chunks=2, prompt_tokens=300, chunk_tokens=32,
                                chunk_probes=2, timeout=120, wait=20)
    started: list = []
    with ExitStack() as stack:
        res = run_longprompt_phase(_starter(stack, model_dir, loaded, started), cfg, log=lambda _m: None)
    assert started == [("longprompt", ["--no-learn"])]
    assert res["prompt_tokens"] == 300 and res["prefill_seconds"] > 0
    assert res["chunk_tokens"] == 32 and res["chunk_forward_seconds"] > 0 and res["short_prompt_seconds"] > 0
    assert res["late_chunk_forward_seconds"] > 0
    assert len(res["per_stream"]) == 2 and 0 <= res["streams_decoding_at_arrival"] <= 2
    for d in res["per_stream"]:
        assert d["baseline_gap"] > 0 and d["ttft_alone"] > 0
    if res["largest_extra_delay_seconds"] is not None:
        assert res["largest_extra_delay_chunk_forwards"] == pytest.approx(
            res["largest_extra_delay_seconds"] / res["chunk_forward_seconds"])
    json.dumps(res)
    assert "chunk forwards" in longprompt_table(res)
    assert res["all_streams_decoding"] == (res["streams_decoding_at_arrival"] == 2)


@pytest.mark.slow  # starts two server processes and a --help subprocess
def test_bench_serve_concurrent_cli_writes_raw_json(tmp_path, capsys, monkeypatch):
    """``redraft bench serve --phases concurrent --concurrency 1,2 --out DIR`` on the tiny model: the table on stdout,
    every level's figures in DIR/results.json, answers identical to the one-at-a-time server's and to plain greedy."""
    from serverkit import save_tiny_model

    from redraft.cli import main

    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))  # the servers' cost curve: never the user's cache
    model = save_tiny_model(tmp_path / "m")
    out = tmp_path / "new" / "dir"
    assert main(["bench", "serve", "--model", str(model), "--phases", "concurrent", "--concurrency", "1,2",
                 "--concurrent-max-tokens", "4", "--concurrent-min-requests", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    assert "identical" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())["concurrent"]
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2] and res["all_identical"] is True
    assert all(lv["identical_to_plain"]["compared"] == lv["requests"] for lv in res["levels"])


def test_bench_serve_concurrent_without_the_plain_check(tmp_path, capsys, monkeypatch):
    """``--no-plain-check`` compares with the one-at-a-time server only: no plain reference is decoded, and the
    level says so (``identical_to_plain`` None) instead of failing after both servers ran."""
    from serverkit import save_tiny_model

    from redraft.cli import main

    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model(tmp_path / "m")
    assert main(["bench", "serve", "--model", str(model), "--phases", "concurrent", "--concurrency", "2",
                 "--concurrent-max-tokens", "3", "--concurrent-min-requests", "2", "--threads", "1",
                 "--no-plain-check", "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())["concurrent"]
    assert res["levels"][0]["identical_to_plain"] is None
    assert res["levels"][0]["identical_to_baseline"]["compared"] == 4 and res["all_identical"] is True
    per = res["levels"][0]["per_request"]
    assert [len(r) for r in per["batched"]] == [4] and [len(r) for r in per["baseline"]] == [4]
    assert all(r["ok"] and r["ttft"] is not None for r in per["batched"][0])
