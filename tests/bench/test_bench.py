"""`redraft bench run` / `bench cost` on a tiny random-weight Llama with the tokenizer-free ByteEncoder.

End to end with small counts: the results JSON has every required key, speedups are the ratio of medians of the
same run's per-question tok/s (recomputed here from the raw runs), a method whose output differs from plain greedy
is flagged in the JSON, the Markdown and the exit status, and the plots and cost curve are written.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from redraft.bench.harness import SCHEMA, bench, run_methods, write_outputs
from redraft.bench.methods import ALL_METHODS, DEFAULT_METHODS, Method, MethodConfig, RunRecord, parse_methods
from redraft.bench.report import acceptance_by_position, markdown, summarize
from redraft.bench.rounds import first_diff
from redraft.bench.workloads import ByteEncoder, Item, Workload, build_workloads, parse_workloads, replay_questions
from redraft.io.questions import load_questions
from redraft.pricing import CostCurve

try:
    from conftest import build_tiny
except ImportError:  # conftest without the helper: build the same kind of tiny model here
    build_tiny = None

VOCAB = 96
NGEN = 16
CURVE = CostCurve((0, 1, 4, 16, 48), (1.0, 1.6, 1.75, 2.9, 5.5))  # the policy method's: injected, never timed
MAX_PROMPT = 40  # the tiny model's context is 128 positions


@pytest.fixture(scope="module")
def model():
    if build_tiny is not None:
        return build_tiny("llama", "sdpa", seed=0)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.get_output_embeddings().weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1000))
    return m.eval()


class WrongMethod(Method):
    """Deliberately not greedy: plain greedy's output with every id shifted by one."""

    name = "wrong"
    description = "greedy ids + 1 (a broken method)"

    def __init__(self, model) -> None:
        from redraft.decoding.engine import Engine

        self.engine = Engine(model, [])

    def generate(self, prompt_ids, ngen):
        t0 = time.perf_counter()
        res = self.engine.generate(list(prompt_ids), ngen)
        return RunRecord([(t + 1) % VOCAB for t in res.output_ids], time.perf_counter() - t0, res.forwards,
                         list(res.accepted_per_forward), {}, res.stop_reason)


@pytest.fixture(scope="module")
def results(model):
    methods = [m for m in ALL_METHODS if not m.startswith("llama.cpp")]
    return bench(model, [], ByteEncoder(VOCAB), load_questions(),
                 counts={"replay": 2, "novel": 2, "near": 2, "copy": 2}, ngen=NGEN, methods=methods,
                 max_prompt_tokens=MAX_PROMPT, extra_methods=[WrongMethod(model)], vocab_size=VOCAB,
                 progress=False, rss_interval=0.01, cfg=MethodConfig(curve=CURVE))


RUN_KEYS = {"question_id", "category", "turn", "method", "order", "prompt_tokens", "tokens", "seconds", "tok_s",
            "forwards", "tokens_per_forward", "accepted_per_forward", "draft_depth_per_forward", "sources",
            "stop_reason", "rss_peak_mb", "identical", "first_diff"}
SUMMARY_KEYS = {"questions", "tokens", "seconds", "tok_s_median", "tok_s_aggregate", "speedup", "speedup_paired",
                "speedup_aggregate", "forwards", "tokens_per_forward", "proposed", "accepted", "acceptance",
                "sources", "rss_peak_mb", "identical", "mismatches", "all_identical", "exact_expected"}


def test_results_schema(results):
    assert results["schema"] == SCHEMA
    for key in ("command", "created", "machine", "model", "config", "corpus", "methods", "skipped_methods",
                "workloads", "process", "differing"):
        assert key in results, key
    assert {"ngen", "workloads", "methods", "k", "tree_branches", "tree_budget"} <= set(results["config"])
    assert results["config"]["methods"][0] == "plain"
    assert results["cost_curves"] == {"policy": CURVE.to_dict()}  # what the policy method decided with
    assert results["corpus"]["spans"] == 2 and results["corpus"]["ids"] > 0
    assert set(results["workloads"]) == {"replay", "novel", "near", "copy"}
    expected_methods = ["plain", "hf", "hf-pld", "ngram", "corpus", "corpus+ngram", "policy", "tree", "wrong"]
    assert list(results["methods"]) == expected_methods
    for w, wr in results["workloads"].items():
        assert len(wr["questions"]) == 2, w
        assert len(wr["runs"]) == 2 * len(expected_methods)
        for r in wr["runs"]:
            assert RUN_KEYS <= set(r), (w, set(RUN_KEYS) - set(r))
            assert 0 < r["tokens"] <= NGEN and r["seconds"] > 0 and r["prompt_tokens"] <= MAX_PROMPT
            assert r["rss_peak_mb"] is None or r["rss_peak_mb"] > 0
            if r["method"] == "plain":
                assert r["forwards"] == r["tokens"] and "output_ids" in r
        for m in expected_methods:
            assert SUMMARY_KEYS <= set(wr["summary"][m]), (w, m)
    json.loads(json.dumps(results))  # serialisable as is


def test_interleaved_per_question(results):
    """Every question ran every method, each at a distinct position, and the start rotates between questions."""
    firsts = []
    for wr in results["workloads"].values():
        for q in wr["questions"]:
            rows = [r for r in wr["runs"] if r["question_id"] == q["question_id"]]
            assert sorted(r["order"] for r in rows) == list(range(len(rows)))
            firsts.append(next(r["method"] for r in rows if r["order"] == 0))
    assert len(set(firsts)) > 1


def test_speedup_is_ratio_of_medians_from_the_same_run(results):
    for wr in results["workloads"].values():
        plain = [r["tok_s"] for r in wr["runs"] if r["method"] == "plain"]
        for m, s in wr["summary"].items():
            mine = [r["tok_s"] for r in wr["runs"] if r["method"] == m]
            assert s["tok_s_median"] == pytest.approx(statistics.median(mine))
            assert s["speedup"] == pytest.approx(statistics.median(mine) / statistics.median(plain))
            tok = sum(r["tokens"] for r in wr["runs"] if r["method"] == m)
            sec = sum(r["seconds"] for r in wr["runs"] if r["method"] == m)
            ptok = sum(r["tokens"] for r in wr["runs"] if r["method"] == "plain")
            psec = sum(r["seconds"] for r in wr["runs"] if r["method"] == "plain")
            assert s["speedup_aggregate"] == pytest.approx((tok / sec) / (ptok / psec))
        assert wr["summary"]["plain"]["speedup"] == pytest.approx(1.0)


def test_exact_methods_match_greedy_and_wrong_method_is_flagged(results):
    for w, wr in results["workloads"].items():
        for m in ("plain", "hf", "hf-pld", "ngram", "corpus", "corpus+ngram", "policy", "tree"):
            assert wr["summary"][m]["all_identical"], (w, m, wr["summary"][m]["mismatches"])
        bad = wr["summary"]["wrong"]
        assert not bad["all_identical"] and bad["identical"] == 0 and len(bad["mismatches"]) == 2
        rows = [r for r in wr["runs"] if r["method"] == "wrong"]
        assert all(r["identical"] is False and r["first_diff"] == 0 and "output_ids" in r for r in rows)
    flagged = {(d["workload"], d["method"]) for d in results["differing"]}
    assert flagged == {(w, "wrong") for w in results["workloads"]}
    assert all(not d["expected"] for d in results["differing"])
    md = markdown(results)
    assert "**DIFFERS** (0/2)" in md and "`wrong`" in md


def test_replay_drafts_pay_on_forwards(results):
    """The frozen answers are in the corpus: replay needs far fewer forwards with corpus drafts than plain."""
    s = results["workloads"]["replay"]["summary"]
    assert s["corpus"]["forwards"] < s["plain"]["forwards"]
    assert s["corpus"]["sources"]["corpus"]["accepted"] > 0
    assert s["corpus"]["tokens_per_forward"] > 1.5
    assert s["policy"]["forwards"] < s["plain"]["forwards"] and s["policy"]["sources"]["corpus"]["accepted"] > 0
    # HF's forward count comes from a hook: greedy is one forward per token (+ nothing else)
    assert s["hf"]["forwards"] == s["hf"]["tokens"]


def test_write_outputs(results, tmp_path):
    results = dict(results, command="redraft bench run --test", model={"name": "tiny", "dtype": "float32"})
    paths = write_outputs(results, tmp_path / "out", str(tmp_path / "r.json"))
    names = {p.name for p in paths}
    assert {"results.json", "results.md", "speedup.png", "tokens_per_forward.png",
            "acceptance_by_position.png", "policy_policy.png", "r.json"} <= names
    for p in paths:
        assert p.stat().st_size > 0
    back = json.loads((tmp_path / "out" / "results.json").read_text())
    assert back["workloads"]["copy"]["summary"]["plain"]["speedup"] == pytest.approx(1.0)
    assert "redraft bench run --test" in (tmp_path / "out" / "results.md").read_text()


def test_write_outputs_failing_midway_leaves_no_partial_file(results, tmp_path, monkeypatch):
    """results.json, results.md and the plots are each written whole or not at all: a full disk midway leaves the
    earlier run's files as they were and no temporary file."""
    from atomickit import fail_midway, leftovers

    results = dict(results, command="redraft bench run --test", model={"name": "tiny", "dtype": "float32"})
    out = tmp_path / "out"
    write_outputs(results, out, str(tmp_path / "r.json"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fail_midway(monkeypatch)
    with pytest.raises(OSError):
        write_outputs(dict(results, command="redraft bench run --second"), out, None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and leftovers(out) == []


def test_pretokenized_workloads_and_summary(model):
    """Workloads built directly from id lists run without any tokenizer."""
    from redraft.bench.methods import build_methods

    ms, skipped = build_methods(["plain", "hf", "ngram", "corpus"], model, [], None, MethodConfig(k=4))
    assert [m.name for m in ms] == ["plain", "hf", "ngram"] and skipped == {"corpus": "no corpus"}
    w = Workload("ids", [Item("a", "x", [5, 6, 7, 5, 6, 7, 5, 6]), Item("b", "x", [1, 2, 3])])
    runs = run_methods([w], ms, 8, progress=False, rss_interval=0)
    assert len(runs["ids"]["runs"]) == 6
    s = summarize(runs["ids"]["runs"], [m.name for m in ms])
    assert all(v["all_identical"] for v in s.values())
    with pytest.raises(ValueError):
        run_methods([w], ms[1:], 8, progress=False)


def test_workload_selection():
    qs = load_questions()
    enc = ByteEncoder(VOCAB)
    frozen_q = replay_questions(qs, 3)
    assert [q["category"] for q in frozen_q] == ["writing", "roleplay", "reasoning"]
    frozen = [(q, [1, 2, 3]) for q in frozen_q]
    ws = {w.name: w for w in build_workloads(qs, {"replay": 3, "novel": 3, "near": 4, "copy": 2, "specbench": 13},
                                             enc, frozen, max_prompt_tokens=50)}
    assert [it.qid for it in ws["replay"].items] == [str(q["question_id"]) for q in frozen_q]
    assert [it.category for it in ws["novel"].items] == ["translation", "qa", "math_reasoning"]
    assert [it.category for it in ws["copy"].items] == ["summarization", "rag"]
    near = ws["near"].items
    assert near[0].turn == 2 and near[0].qid.endswith("/t2") and near[1].turn == 1
    frozen_ids = {str(q["question_id"]) for q in frozen_q}
    assert all(it.qid not in frozen_ids for it in near if it.turn == 1)
    assert all(it.category in {"writing", "roleplay", "reasoning"} for it in near)
    assert len({it.category for it in ws["specbench"].items}) == 13
    assert not frozen_ids & {it.qid for it in ws["specbench"].items}
    assert all(len(it.prompt_ids) <= 50 for w in ws.values() for it in w.items)


def test_parsers():
    assert parse_workloads("replay,novel:3", 5) == {"replay": 5, "novel": 3}
    assert list(parse_workloads("all", 2)) == ["replay", "novel", "near", "copy", "specbench"]
    with pytest.raises(ValueError):
        parse_workloads("bogus", 2)
    assert parse_methods("corpus,plain") == ["plain", "corpus"]
    assert parse_methods(None) == list(DEFAULT_METHODS)
    with pytest.raises(ValueError):
        parse_methods("plain,warp")
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1 and first_diff([1, 2], [1, 2, 3]) == 2


def test_acceptance_by_position():
    # without draft depths: prefill forward (index 0) excluded; forwards accepted 0, 2, 3 draft tokens
    assert acceptance_by_position([[0, 0, 2, 3]], 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.0])
    # with them: conditional on the draft reaching position d (the forward that drafted nothing does not count)
    got = acceptance_by_position([[0, 0, 2, 3]], 4, [[0, 4, 4, 3]])
    assert got[:3] == pytest.approx([2 / 3, 2 / 3, 1 / 3]) and got[3] == 0.0


def test_draft_depths_recorded_per_forward(results):
    for wr in results["workloads"].values():
        for r in wr["runs"]:
            if r["method"] in ("ngram", "corpus", "corpus+ngram", "tree"):
                dd = r["draft_depth_per_forward"]
                assert dd is not None and len(dd) == r["forwards"]
                assert all(a <= d for a, d in zip(r["accepted_per_forward"], dd, strict=True))
            elif r["method"] in ("plain", "hf", "hf-pld"):
                assert r["draft_depth_per_forward"] is None


def test_llama_cpp_is_skipped_cleanly_when_missing(model):
    from redraft.bench.methods import build_methods, llama_cpp_available

    ms, skipped = build_methods(["plain", "llama.cpp", "llama.cpp-pld"], model, [], None,
                                MethodConfig(gguf="/nonexistent.gguf"))
    if not llama_cpp_available()[0]:
        assert [m.name for m in ms] == ["plain"] and set(skipped) == {"llama.cpp", "llama.cpp-pld"}
    else:  # installed: a missing file is reported, not raised
        assert "llama.cpp" in skipped


def test_cost_curve(model, tmp_path):
    from redraft.bench.cost import cost_curve, cost_markdown
    from redraft.bench.report import plot_cost

    cost = cost_curve(model, max_s=6, prefix=20, repeats=2, tree_mask=True, progress=False)
    assert set(cost["curves"]) == {"chain", "tree mask"}
    chain = cost["curves"]["chain"]
    assert chain["s"] == list(range(1, 7)) and chain["c"][0] == pytest.approx(1.0)
    assert all(len(x) == 2 for x in chain["samples_s"])
    assert all(len(x) == 2 for x in chain["samples_c"])  # each sample over the 1-token forwards around it
    assert chain["c"][2] == pytest.approx(statistics.median(chain["samples_c"][2])
                                          / statistics.median(chain["samples_c"][0]))
    cost["model"] = "tiny"
    assert "| 6 |" in cost_markdown(cost)
    plot_cost(cost, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 0


def test_cli_registers_bench_run_and_cost():
    from redraft.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "run", "--workloads", "replay,copy", "--questions", "2", "--ngen", "32",
                      "--methods", "plain,hf-pld", "--out", "x"])
    assert a.func.__name__ == "cmd_bench_run" and a.questions == 2 and a.ngen == 32
    a = p.parse_args(["bench", "cost", "--max-s", "8"])
    assert a.func.__name__ == "cmd_bench_cost" and a.max_s == 8


def test_replay_ceiling_is_timed_once_per_question_on_plain_greedys_answer(model):
    """run_methods times the ceiling once per question, on plain greedy's answer, and every run of that question is
    reported against the same figure."""
    from redraft.bench.methods import build_methods

    ms, _ = build_methods(["plain", "ngram"], model, [], None, MethodConfig(k=4))
    w = Workload("ids", [Item("a", "x", [5, 6, 7, 5, 6, 7, 5, 6]), Item("b", "x", [1, 2, 3])])
    calls = []

    def fake_ceiling(prompt, answer):
        calls.append((list(prompt), list(answer)))
        return 0.25 * len(calls)

    runs = run_methods([w], ms, 8, progress=False, rss_interval=0, ceiling=fake_ceiling)["ids"]["runs"]
    assert len(calls) == 3  # the warm-up, then one per question
    plain = {r["question_id"]: r for r in runs if r["method"] == "plain"}
    assert calls[1] == ([5, 6, 7, 5, 6, 7, 5, 6], plain["a"]["output_ids"])
    assert calls[2] == ([1, 2, 3], plain["b"]["output_ids"])
    for r in runs:
        want = 0.5 if r["question_id"] == "a" else 0.75
        assert r["ceiling_seconds"] == want and r["of_ceiling"] == pytest.approx(want / r["seconds"])
    s = summarize(runs, [m.name for m in ms])
    ratios = sorted(r["of_ceiling"] for r in runs if r["method"] == "ngram")
    assert s["ngram"]["of_ceiling_min"] == ratios[0]
    assert s["ngram"]["of_ceiling_median"] == pytest.approx(statistics.median(ratios))
    assert "of ceiling" in markdown({**_page(runs, ms, s)})


def _page(runs, ms, s):
    """A minimal results dict around one workload's runs, for the Markdown page."""
    return {"config": {"ngen": 8, "k": 4, "tree_branches": 0, "tree_budget": 32}, "methods": {m.name: {} for m in ms},
            "command": "", "model": {"name": "tiny"}, "machine": {}, "corpus": {"spans": 0, "ids": 0,
                                                                              "question_ids": []},
            "workloads": {"ids": {"description": "", "questions": [], "runs": runs, "summary": s}}}


def test_ceiling_timer_runs_prompt_and_answer_in_one_forward(model):
    """The ceiling is the best a replay can do: prompt + the answer but its last id (the bonus token) in one forward,
    with logits for the rows that choose the answer."""
    from redraft.bench.ceiling import CeilingTimer

    timer = CeilingTimer(model, repeats=3)
    seen = []
    inner = timer.target.forward

    def recording(ids, positions=None, mask=None, n_logits=1):
        seen.append((list(ids), n_logits, timer.target.length))
        return inner(ids, positions, mask, n_logits=n_logits)

    timer.target.forward = recording
    secs = timer([1, 2, 3], [4, 5, 6, 7])
    assert secs is not None and secs > 0
    assert seen == [([1, 2, 3, 4, 5, 6], 4, 0)] * 3  # an empty cache each time
    assert timer([1, 2, 3], []) is None
    with pytest.raises(ValueError, match="repeats"):
        CeilingTimer(model, repeats=0)


def test_bench_reports_the_ceiling_for_every_question(results):
    for w in results["workloads"].values():
        for r in w["runs"]:
            assert r["ceiling_seconds"] > 0 and r["of_ceiling"] == pytest.approx(r["ceiling_seconds"] / r["seconds"])
        assert all(s["of_ceiling_median"] is not None for s in w["summary"].values())


def test_bench_cost_refuses_sizes_past_the_context(tiny_model_dir):
    """--prefix + --max-s beyond the model's context is one error line, not forwards past the context."""
    from redraft.cli import build_parser

    a = build_parser().parse_args(["bench", "cost", "--model", str(tiny_model_dir[0]), "--max-s", "100000"])
    with pytest.raises(SystemExit, match="exceed the model's context length"):
        a.func(a)


def test_a_llama_cpp_build_that_crashes_costs_the_method_not_the_bench(model, tmp_path, monkeypatch):
    """A llama.cpp whose batched decode segfaults (the stand-in of tests/runtimes/fakellama) is probed in child processes: both
    llama.cpp methods are skipped with the signal named, and this process goes on."""
    from redraft.bench.methods import build_methods

    fake = Path(__file__).resolve().parent.parent / "runtimes" / "fakellama"
    monkeypatch.setenv("FAKE_LLAMA", "crash-all")
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(fake))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real = sys.modules.get("llama_cpp")
    try:
        ms, skipped = build_methods(["plain", "llama.cpp", "llama.cpp-pld"], model, [], None,
                                    MethodConfig(gguf=str(gguf)))
    finally:  # the fake module must not stay imported for later tests in this process
        if real is None:
            sys.modules.pop("llama_cpp", None)
        else:
            sys.modules["llama_cpp"] = real
    assert [m.name for m in ms] == ["plain"]
    assert all("signal 11 (SIGSEGV)" in skipped[n] for n in ("llama.cpp", "llama.cpp-pld")), skipped
