"""Two builds of ``redraft serve`` side by side on one burst of concurrent requests: per-request time to first token.

    python benchmarks/serve/burst_ab.py --other CHECKOUT [--workload bench|shared-system] [--rounds 2] OUT.json

``--other``: a checkout of another commit (``git worktree add --detach DIR COMMIT``); its server runs with that
directory as its working directory and on ``PYTHONPATH`` (``python -m redraft`` imports from the working directory
first). The two servers take turns, this checkout's first, ``--rounds`` times each (a fresh server per run).

Workloads (greedy, streamed, 16 clients in a closed loop, ``--no-learn --no-answer-cache``):
- ``bench``: the 32 questions of ``redraft bench serve --phases concurrent --concurrency 16``, 128 tokens each;
- ``shared-system``: 16 questions after one ~660-token system prompt (the longest Spec-Bench question's first
  3,000 characters), 32 tokens each: a burst that opens alike, as agents sharing a system prompt send.

Per run: wall seconds, aggregate tokens/s, time to first token p50/p95/max, each request's (sent, ttft, latency,
tokens) and whether every answer equals the first run's. Writes OUT.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from redraft.bench import concurrency_stats as st
from redraft.bench.concurrent_bench import novel_questions
from redraft.bench.server_process import ServerProcess
from redraft.bench.stream_client import chat_body, closed_loop
from redraft.io.questions import load_questions


def bodies(workload: str) -> list[dict]:
    if workload == "bench":
        return [chat_body(q, 128) for q in novel_questions(32)]
    article = max((q["turns"][0] for q in load_questions()), key=len)[:3000]
    system = "You answer questions about this document.\n\n" + article
    out = []
    for q in novel_questions(16):
        body = chat_body(q, 32)
        body["messages"].insert(0, {"role": "system", "content": system})
        out.append(body)
    return out


def run(checkout: str | None, requests: list[dict], log: Path) -> dict:
    env_before, cwd_before = os.environ.get("PYTHONPATH"), os.getcwd()
    try:
        if checkout:
            os.environ["PYTHONPATH"] = checkout
            os.chdir(checkout)
        server = ServerProcess(None, log, "--no-learn", "--no-answer-cache", threads=1)
    finally:
        os.chdir(cwd_before)
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    try:
        base = server.wait_ready()
        recs, wall = asyncio.run(closed_loop(base, requests, 16, 1800))
    finally:
        server.stop()
    summary = st.summarize(recs, wall)
    ttft = sorted(r.ttft for r in recs if r.ttft is not None)
    return {"wall_seconds": wall, "tokens_per_second": summary["tokens_per_second"], "ttft_p50": summary["ttft_p50"],
            "ttft_p95": summary["ttft_p95"], "ttft_max": ttft[-1] if ttft else None, "errors": summary["errors"],
            "per_request": st.per_request(recs), "texts": [r.text for r in recs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--other", required=True, help="a checkout of the build to compare with")
    p.add_argument("--workload", choices=("bench", "shared-system"), default="bench")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    requests = bodies(a.workload)
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            for name, checkout in (("this", None), ("other", os.path.abspath(a.other))):
                res = run(checkout, requests, Path(work) / f"{name}-{r}.log")
                res.update(build=name, round=r + 1)
                runs.append(res)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
                                  if k not in ("per_request", "texts")}), flush=True)
    first = runs[0]["texts"]
    for res in runs:
        res["identical_to_first_run"] = res.pop("texts") == first
    a.out.write_text(json.dumps({"workload": a.workload, "other": a.other, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
