"""lm-evaluation-harness' first pass through ``redraft serve`` with ``num_concurrent=1`` and with more: wall times
side by side (the figures in docs/serving.md, "Concurrent requests: benchmark").

For each ``num_concurrent`` in ``--concurrency`` (default 1,4): a fresh ``python -m redraft serve`` (the default
model unless ``--model``, an empty in-memory corpus, so every run is a first pass; ``--server-args`` passed
through) on a free port; ``lm_eval.simple_evaluate`` of tests/data/lm_eval's ``redraft_capitals`` (generate_until)
through ``local-completions`` with the server's tokenizer routes, ``batch_size=1`` (one prompt per request, so
concurrency comes from ``num_concurrent`` alone), ``--limit`` questions; the evaluate call's wall seconds (lm-eval
imported and its task index built once, and one untimed multiple-choice question sent to each server first, so no
run pays lm-eval's start-up: measured, it added ~10 s to whichever run came first) and the
server's /metrics around it (summed request latency, forwards, generated tokens). The runs' samples are compared
with the first run's (all must be identical: batching and drafts change speed only).

Usage (from the repository root; lm-eval is in the test extra): python benchmarks/serve/lm_eval_concurrent.py OUT.json
    [--concurrency 1,4] [--limit 8] [--server-args '--max-running 4'] [--threads N] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from redraft.bench.server_process import ServerProcess, metric_value  # noqa: E402

TASK = "redraft_capitals"
WARM_TASK = "redraft_capitals_mc"
METRICS = {"server_seconds": "vllm:e2e_request_latency_seconds_sum", "forwards": "redraft:target_forwards_total",
           "generated_tokens": "vllm:generation_tokens_total", "requests": "vllm:e2e_request_latency_seconds_count"}


def scrape(srv: ServerProcess) -> dict:
    text = srv.metrics()
    return {k: metric_value(text, name) for k, name in METRICS.items()}


def warm_up(srv: ServerProcess, model_id: str, tasks) -> None:
    """One question of the multiple-choice task (loglikelihoods: the server learns nothing from them), untimed, so
    lm-eval's lazy imports and dataset machinery are paid before any timed run, by every server alike."""
    from lm_eval import simple_evaluate

    simple_evaluate(model="local-completions", model_args=f"model={model_id},base_url={srv.base}/v1/completions,"
                    "tokenizer_backend=remote,num_concurrent=1,max_retries=1", tasks=[WARM_TASK], batch_size=1,
                    limit=1, task_manager=tasks)


def first_pass(srv: ServerProcess, model_id: str, concurrent: int, limit: int | None, tasks) -> dict:
    from lm_eval import simple_evaluate

    args = (f"model={model_id},base_url={srv.base}/v1/completions,tokenizer_backend=remote,"
            f"num_concurrent={concurrent},max_retries=1")
    before = scrape(srv)
    t0 = time.perf_counter()
    res = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK], batch_size=1, limit=limit,
                          log_samples=True, task_manager=tasks)
    wall = time.perf_counter() - t0
    after = scrape(srv)
    delta = {k: round(after[k] - before[k], 3) for k in METRICS}
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    return {"num_concurrent": concurrent, "wall_seconds": round(wall, 2), **delta,
            "exact_match": res["results"][TASK]["exact_match,city"], "answers": [s["resps"][0][0] for s in samples]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--concurrency", default="1,4", help="num_concurrent values, comma-separated (default 1,4)")
    ap.add_argument("--limit", type=int, default=8, help="questions of the task (default 8: all)")
    ap.add_argument("--server-args", default="", help="extra 'redraft serve' arguments, one quoted string")
    ap.add_argument("--model", default=None, help="--model of the servers (default: the bundled default)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the servers")
    ap.add_argument("--work", default=None, help="server logs here (default: a temporary directory)")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency: expected comma-separated numbers of at least 1, got {a.concurrency!r}")
    work = Path(a.work or tempfile.mkdtemp(prefix="redraft-lm-eval-concurrent-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))  # servers: this checkout
    os.chdir(ROOT)  # the task YAML names its data file relative to the repository root
    from lm_eval.tasks import TaskManager  # imported and indexed once, before any timing: each run pays the same

    tasks = TaskManager(include_path=str(ROOT / "tests/data/lm_eval"))
    runs = []
    for n in levels:
        srv = ServerProcess(a.model, work / f"server-{n}.log", "--enable-tokenizer-info-endpoint",
                            *shlex.split(a.server_args), threads=a.threads)
        try:
            base = srv.wait_ready()
            model_id = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            warm_up(srv, model_id, tasks)
            print(f"lm-eval first pass, num_concurrent={n} ...", file=sys.stderr, flush=True)
            runs.append(first_pass(srv, model_id, n, a.limit, tasks))
        finally:
            srv.stop()
        print(f"num_concurrent={n}: {runs[-1]['wall_seconds']} s wall, {runs[-1]['server_seconds']} s summed "
              f"server latency", flush=True)
    ref = runs[0]["answers"]
    report = {"task": TASK, "limit": a.limit, "batch_size": 1, "server_args": a.server_args, "runs": runs,
              "identical_samples": all(r["answers"] == ref for r in runs),
              "wall_ratio": {str(r["num_concurrent"]): round(runs[0]["wall_seconds"] / r["wall_seconds"], 3)
                             for r in runs}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
