"""Where a replayed agent request's time goes: the ``agent`` phase's conversations through ``redraft serve``'s app in
this process, run twice, with the second run's generation thread profiled.

    OMP_NUM_THREADS=1 python docs/examples/profile_agent_replay.py --conversations 1 --turns 3

Builds the server as ``redraft serve`` does (default model, prefix reuse and learning on, one torch thread; the
answer cache off, so that the replay is drafted and verified: with it every replayed request is answered without a
forward) and
drives it through FastAPI's ``TestClient`` (the routes, JSON, chat template and tokenization included, no socket).
Per run it prints the client's seconds, the seconds spent in the generation thread (``Generator.__call__``:
engine, prefix lookup and store, corpus learning) and in the target's forwards, each per request, plus the CPU
seconds of the generation thread (``time.thread_time``: on a loaded machine wall-clock time mostly measures
waiting for a core). Then the cProfile of the second run's generation thread, largest cumulative times first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=30, help="profile lines to print")
    args = ap.parse_args()

    import torch
    from fastapi.testclient import TestClient

    from redraft.bench.agent_bench import AgentBenchConfig, agent_tasks, run_conversations
    from redraft.cli import build_parser
    from redraft.cli.serve import build_server
    from redraft.runtimes.transformers.target import HFTarget
    from redraft.server.generation import Generator

    torch.set_num_threads(1)
    clock = {"forward": 0.0, "generator": 0.0, "cpu": 0.0}
    profile = {"on": None}
    forward, call = HFTarget.forward, Generator.__call__

    def timed_forward(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return forward(self, *a, **kw)
        finally:
            clock["forward"] += time.perf_counter() - t0

    def timed_call(self, job, emit):
        t0, c0 = time.perf_counter(), time.thread_time()
        if profile["on"] is not None:
            profile["on"].enable()
        try:
            return call(self, job, emit)
        finally:
            if profile["on"] is not None:
                profile["on"].disable()
            clock["generator"] += time.perf_counter() - t0
            clock["cpu"] += time.thread_time() - c0

    HFTarget.forward, Generator.__call__ = timed_forward, timed_call
    server = build_server(build_parser().parse_args(["serve", "--quiet", "--no-answer-cache"]))
    cfg = AgentBenchConfig(conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens)
    tasks = agent_tasks(cfg.conversations)
    runs = []
    with TestClient(server.app()) as client:
        for name in ("first", "second"):
            profile["on"] = cProfile.Profile() if name == "second" else None
            clock.update(forward=0.0, generator=0.0, cpu=0.0)
            out = run_conversations(client, "", tasks, cfg)
            runs.append(out["answers"])
            n = out["requests"]
            print(f"{name} run: {n} requests, per request: client {out['seconds'] / n * 1000:.0f} ms, generation "
                  f"thread {clock['generator'] / n * 1000:.0f} ms ({clock['cpu'] / n * 1000:.0f} ms CPU), forwards "
                  f"{clock['forward'] / n * 1000:.0f} ms; {out['tokens_per_forward']:.1f} tokens per forward")
    print("answers identical:", runs[0] == runs[1])
    text = io.StringIO()
    pstats.Stats(profile["on"], stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
