"""The ``concurrent`` and ``longprompt`` phases of ``redraft bench serve``: several requests at once.

``concurrent`` (aggregate throughput, as vLLM's ``benchmark_serving.py`` reports it): for each concurrency N in
``levels``, N streaming clients in a closed loop send max(``min_requests``, 2N) distinct novel questions (Spec-Bench,
every category in turn; the servers run ``--no-learn`` with no corpus, so nothing was ever seen before), greedy,
``max_tokens`` each, first to a server started with ``--max-running 1`` (one request at a time) and then to the
server under test (its defaults, plus ``server_args``); the order alternates level by level so drift on a shared
machine hits both alike. Each round sends the next questions, the same to both servers (a question sent again would
be answered from the prefix cache). Per N and server: aggregate output tokens/s (all tokens / the wall time from the first send
to the last stream's end), p50/p95 time to first token and p50 latency (client side), and the ratios (server
under test / one at a time). Exactness: each answer is compared with the one-at-a-time server's answer to the same
question and, unless skipped, with plain greedy decoding of the model in this process (text decoded from the ids
of :func:`redraft.compose.plain_engine`).

``longprompt`` (chunked prefill): ``streams`` streams decode a question each (a run alone first: each stream's gap
between chunks without interruption), then the same streams again, and once every stream has ``lead_chunks``
chunks a ``prompt_tokens``-token prompt arrives (token ids of Spec-Bench articles, sent to /v1/completions). Per
stream: the largest gap between its chunks while that prompt's prefill ran (from its send to its first token)
minus the stream's median gap without it. The largest of these is reported in seconds and in chunk forwards: one
chunk forward's time is the median time to first token of ``chunk_tokens``-token prompts sent alone (a forward over
a chunk plus the HTTP round trip: the goal is a delay of at most one).

Both phases take a ``start_server(name, args)`` function returning (base URL, stop), so they need no server code.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from redraft.bench import concurrency_stats as st
from redraft.bench.stream_client import chat_body, closed_loop

StartServer = Callable[[str, Sequence[str]], tuple[str, Callable[[], None]]]
PlainReference = Callable[[Sequence[str], int], list[str]]


@dataclass
class ConcurrentBenchConfig:
    """Sizes of the two phases (``redraft bench serve`` flags).

    Attributes:
        levels: concurrencies N (``--concurrency``). max_tokens: max_tokens per request (``--concurrent-max-tokens``).
        min_requests: requests per N are max(min_requests, 2N). rounds: runs per N and server, in the order
            A B, B A, A B, ... (``--concurrent-rounds``), each round with the next questions; a level's figures
            pool its rounds (wall times summed). server_args: extra ``redraft serve`` arguments of
            the server under test (``--server-args``). baseline_args: the one-at-a-time server's arguments
            (``--max-running 1`` where the server has that option; empty otherwise, and then both servers are alike).
        prompts: the questions (default: Spec-Bench, every category in turn). timeout: most seconds per run.
        runtime: concurrent: the runtime both servers run (``redraft serve --runtime``), and the plain reference.
        streams, stream_max_tokens, lead_chunks, prompt_tokens, chunk_tokens, chunk_probes, wait: longprompt:
            decoding streams, their max_tokens, chunks each has before the prompt arrives, its length in tokens,
            the chunk size whose forward is timed, how many such prompts are timed (median), and the most seconds
            to wait for the lead chunks.
    """

    levels: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 64
    rounds: int = 1
    min_requests: int = 8
    server_args: tuple[str, ...] = ()
    baseline_args: tuple[str, ...] = ("--max-running", "1")
    prompts: tuple[str, ...] | None = None
    runtime: str = "transformers"
    timeout: float = 1800.0
    streams: int = 4
    stream_max_tokens: int = 96
    lead_chunks: int = 4
    prompt_tokens: int = 4000
    chunk_tokens: int = 512
    chunk_probes: int = 3
    wait: float = 60.0


def requests_for(n: int, min_requests: int) -> int:
    """Requests sent at concurrency ``n``: max(min_requests, 2n)."""
    return max(min_requests, 2 * n)


def novel_questions(n: int) -> list[str]:
    """``n`` first turns of Spec-Bench questions, one category after another (all 13; repeated past 480)."""
    from redraft.bench.workloads import round_robin
    from redraft.io.questions import load_questions

    qs = load_questions()
    cats = list(dict.fromkeys(q["category"] for q in qs))
    pool = [q["turns"][0] for q in round_robin(qs, cats, min(n, len(qs)))]
    return [pool[i % len(pool)] for i in range(n)]


def for_build(cfg: ConcurrentBenchConfig, help_text: str) -> ConcurrentBenchConfig:
    """``cfg`` fitted to the ``redraft serve`` whose ``--help`` is ``help_text``: the one-at-a-time server gets
    ``baseline_args`` only where the server has ``--max-running`` (otherwise no arguments: both servers then run
    alike, one request at a time), and ``chunk_tokens`` is ``--max-batch-tokens`` of ``server_args`` when given,
    else the server's default for it, else ``cfg.chunk_tokens``. Where the server has ``--no-answer-cache``, both
    servers get it: given prompts repeat when a run asks for more, and the answer cache would answer a repeat
    without a forward."""
    from redraft.bench.server_process import option_default

    base = cfg.baseline_args if "--max-running" in help_text else ()
    args = [x for a in cfg.server_args for x in (a.split("=", 1) if a.startswith("--max-batch-tokens=") else [a])]
    given = args[args.index("--max-batch-tokens") + 1] if "--max-batch-tokens" in args[:-1] else None
    chunk = int(given) if given else option_default(help_text, "--max-batch-tokens") or cfg.chunk_tokens
    decode = ("--no-answer-cache",) if "--no-answer-cache" in help_text else ()
    return replace(cfg, baseline_args=tuple(base) + decode, server_args=tuple(cfg.server_args) + decode,
                   chunk_tokens=chunk)


def log_stderr(msg: str) -> None:
    """Progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def run_concurrent_phase(start_server: StartServer, cfg: ConcurrentBenchConfig,
                         plain: PlainReference | None = None, log: Callable[[str], None] = log_stderr) -> dict:
    """The ``concurrent`` phase (module doc). ``plain(prompts, max_tokens)`` returns plain greedy answers (None:
    compare with the one-at-a-time server only).

    Returns:
        ``{"max_tokens", "server_args", "baseline_args", "levels": [per N: "concurrency", "requests", "batched"
        and "baseline" (see :func:`redraft.bench.concurrency_stats.summarize`), "tokens_per_second_ratio",
        "ttft_p50_ratio" (baseline / batched: above 1 = sooner), "latency_p50_ratio" (idem), "identical_to_baseline",
        "identical_to_plain" (or None), "per_request": {"batched", "baseline": per round, each request's figures
        (:func:`redraft.bench.concurrency_stats.per_request`)}], "all_identical"}``.
    Raises:
        RuntimeError: a server that does not start (from ``start_server``).
    """
    counts = [requests_for(n, cfg.min_requests) for n in cfg.levels]
    total = sum(counts)
    prompts = list(cfg.prompts) if cfg.prompts else novel_questions(total * cfg.rounds)

    def questions(li: int, r: int) -> list[str]:  # round r asks the next questions: a resent prompt would be served
        at = r * total + sum(counts[:li])          # from the prefix cache, which favours the server prefill weighs on
        return [prompts[(at + i) % len(prompts)] for i in range(counts[li])]

    asked: list[list[str]] = [[] for _ in cfg.levels]  # per level, its questions in the order the rounds pool them
    servers = {}
    runtime = ("--runtime", cfg.runtime) if cfg.runtime != "transformers" else ()
    try:
        for name, args in (("baseline", cfg.baseline_args), ("batched", cfg.server_args)):
            servers[name] = start_server(f"concurrent-{name}", ["--no-learn", *runtime, *args])
        levels = []
        for li, n in enumerate(cfg.levels):
            runs: dict[str, tuple[list, float]] = {"baseline": ([], 0.0), "batched": ([], 0.0)}
            detail: dict[str, list[list[dict]]] = {"baseline": [], "batched": []}  # per round, each request's figures
            for r in range(cfg.rounds):
                qs = questions(li, r)
                asked[li] += qs
                bodies = [chat_body(q, cfg.max_tokens) for q in qs]
                for name in (("baseline", "batched") if (li + r) % 2 == 0 else ("batched", "baseline")):
                    log(f"concurrent: N={n}, {len(bodies)} requests -> {name} server (round {r + 1}) ...")
                    recs, wall = asyncio.run(closed_loop(servers[name][0], bodies, n, cfg.timeout))
                    runs[name] = (runs[name][0] + recs, runs[name][1] + wall)
                    detail[name].append(st.per_request(recs))
            levels.append({**_level(n, runs), "per_request": detail})
    finally:
        for _, stop in servers.values():
            stop()
    if plain is not None:
        log(f"concurrent: plain greedy reference of {total * cfg.rounds} prompts in this process ...")
        for lv, qs in zip(levels, asked, strict=True):
            lv["identical_to_plain"] = st.identical(lv.pop("_texts"), plain(qs, cfg.max_tokens))
    for lv in levels:
        lv.pop("_texts", None)
    checks = [lv[k] for lv in levels for k in ("identical_to_baseline", "identical_to_plain") if lv.get(k)]
    return {"max_tokens": cfg.max_tokens, "runtime": cfg.runtime, "server_args": list(cfg.server_args),
            "baseline_args": list(cfg.baseline_args), "levels": levels,
            "all_identical": all(c["identical"] == c["compared"] and c["compared"] > 0 for c in checks)
            and all(lv["batched"]["errors"] == lv["baseline"]["errors"] == 0 for lv in levels)}


def _level(n: int, runs: dict) -> dict:
    (brecs, bwall), (rrecs, rwall) = runs["batched"], runs["baseline"]
    b, r = st.summarize(brecs, bwall), st.summarize(rrecs, rwall)
    btexts = [x.text if x.ok else None for x in brecs]
    return {"concurrency": n, "requests": len(brecs), "batched": b, "baseline": r,
            "tokens_per_second_ratio": st.ratio(b["tokens_per_second"], r["tokens_per_second"]),
            "ttft_p50_ratio": st.ratio(r["ttft_p50"], b["ttft_p50"]),
            "latency_p50_ratio": st.ratio(r["latency_p50"], b["latency_p50"]),
            "identical_to_baseline": st.identical(btexts, [x.text if x.ok else None for x in rrecs]),
            "identical_to_plain": None, "_texts": btexts}


def concurrent_table(res: dict) -> str:
    """A short text table of the ``concurrent`` phase's figures."""
    def f(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    rows = [f"concurrent (max_tokens {res['max_tokens']}; server under test: "
            f"{' '.join(res['server_args']) or 'defaults'}; baseline: {' '.join(res['baseline_args']) or 'defaults'})",
            f"{'N':>3} {'reqs':>4} | {'tok/s':>7} {'base':>7} {'ratio':>5} | {'TTFT p50':>8} {'p95':>6} "
            f"{'base p50':>8} {'p95':>6} | {'lat p50':>7} {'base':>6} | identical"]
    for lv in res["levels"]:
        b, r = lv["batched"], lv["baseline"]
        ident = f"{lv['identical_to_baseline']['identical']}/{lv['identical_to_baseline']['compared']} base"
        if lv["identical_to_plain"]:
            ident += f", {lv['identical_to_plain']['identical']}/{lv['identical_to_plain']['compared']} plain"
        rows.append(f"{lv['concurrency']:>3} {lv['requests']:>4} | {f(b['tokens_per_second'], '.1f'):>7} "
                    f"{f(r['tokens_per_second'], '.1f'):>7} {f(lv['tokens_per_second_ratio']):>5} | "
                    f"{f(b['ttft_p50']):>8} {f(b['ttft_p95']):>6} {f(r['ttft_p50']):>8} {f(r['ttft_p95']):>6} | "
                    f"{f(b['latency_p50']):>7} {f(r['latency_p50']):>6} | {ident}")
    return "\n".join(rows)


def plain_answers(model: str | None, prompts: Sequence[str], max_tokens: int, threads: int | None = None,
                  runtime: str = "transformers") -> list[str]:
    """Plain greedy answers of ``model`` (None = the bundled default) on ``runtime`` to each prompt as one user
    message, encoded as the server encodes a chat request and decoded as it decodes one (special tokens skipped):
    the reference the ``concurrent`` phase compares answers with. Distinct prompts are decoded once each (one token
    per forward)."""
    from redraft.compose import load_target, plain_engine
    from redraft.io.prompts import encode_prompt

    if threads:
        import torch

        torch.set_num_threads(threads)
    loaded = load_target(model, runtime=runtime, quiet=True, threads=threads)
    engine = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)
    done: dict[str, str] = {}
    for p in prompts:
        if p not in done:
            ids = encode_prompt(loaded.tokenizer, [{"role": "user", "content": p}], chat=True)
            res = engine.generate(ids, max_tokens)
            done[p] = loaded.tokenizer.decode(res.output_ids, skip_special_tokens=True)
    return [done[p] for p in prompts]
