"""``redraft bench serve``: what ``redraft serve`` does for its users, measured over loopback HTTP.

Phases (each against ``redraft serve`` running as its own process, started and stopped here). ``repeat``, ``load``
and ``overhead`` resend identical greedy requests to measure the learned corpus, exactness under load and the HTTP
overhead of decoding: their servers run with ``--no-answer-cache`` (else every repeat would be answered from the
answer cache without a forward); the ``agent`` phase measures the answer cache.

- ``repeat``: a fresh server with an empty corpus gets N Spec-Bench questions (MT-Bench categories, round-robin),
  then the same N again: second-pass generated tokens/s over the first pass's, and whether every answer is
  identical. Nothing is frozen by hand: the server learned the first answers.
- ``load``: R requests from C concurrent clients (distinct questions, each repeated); first every distinct
  request alone, then the load: errors, responses not identical to the request sent alone, p50/p99 latency and
  queue wait (the server's own per-request figure).
- ``overhead``: one request through HTTP (a ``--no-learn`` server, so every repeat starts from the same state)
  against the same prompt through :class:`redraft.decoding.engine.Engine` in this process with the server's draft sources:
  tokens/s ratio (median of repeats) and identical text.
- ``crash``: ``kill -9`` of a server during a load run, restart on the same corpus directory: it starts and holds
  every span whose response completed (at most the in-flight ones are lost); then the same with the journal
  truncated mid-record and with a flipped byte (each skipped with a warning, the server starts).
- ``memory``: M short requests with distinct prompts; the server's resident memory before, every M/10 requests
  and after, and its learned corpus size (bounded by ``--cap-tokens``).
- ``agent``: agent-shaped conversations (each request = the previous request + its answer + an observation, after a
  long fixed system prompt), run twice on a fresh server without prefix reuse, twice on one with it, and twice on
  one with the defaults (prefix reuse and the answer cache): first-run time without / with reuse, second run /
  first run, identical answers (redraft/bench/agent_bench.py).
- ``concurrent``: N streaming clients at once (each N of ``--concurrency``) on novel questions, against the server
  under test and one started with ``--max-running 1``: aggregate tokens/s, p50/p95 time to first token, p50
  latency, ratios, answers identical to the one-at-a-time server's and to plain greedy
  (redraft/bench/concurrent_bench.py).
- ``longprompt``: a ~4,000-token prompt arriving beside 4 decoding streams: the largest extra gap between a
  stream's chunks, in seconds and in chunk forwards (redraft/bench/longprompt_bench.py).
- ``fleet``: three replicas on one corpus directory: one replays what another answered, a mixed load with
  ``kill -9`` during learning and during a compaction loses and repeats no stored span, latency against replicas
  with a directory each (redraft/bench/fleet_bench.py).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redraft.bench.agent_bench import AgentBenchConfig, run_agent_phase
from redraft.bench.concurrent_bench import (
    ConcurrentBenchConfig,
    concurrent_table,
    for_build,
    plain_answers,
    run_concurrent_phase,
)
from redraft.bench.fleet_bench import FleetBenchConfig, run_fleet_phase
from redraft.bench.longprompt_bench import longprompt_table, run_longprompt_phase
from redraft.bench.server_process import (  # noqa: F401 (metric_value: re-exported)
    ServerProcess,
    metric_value,
    process_starter,
    serve_help,
)
from redraft.io.questions import load_questions

PHASES = ("repeat", "load", "overhead", "crash", "memory", "agent", "concurrent", "longprompt", "fleet")


@dataclass
class ServeBenchConfig:
    """Sizes of the phases (``redraft bench serve`` flags of the same names; a full-size run's sizes in brackets).

    Attributes:
        model: ``--model`` of every server and of the direct run (None = the bundled default).
        questions: repeat: questions per pass [20]. max_tokens: repeat/overhead: max_tokens per request.
        requests: load/crash: requests [200]. concurrency: load/crash: concurrent clients [16].
        load_distinct: load: distinct questions. load_max_tokens: load/crash: max_tokens per request.
        repeats: overhead: timings per side (median). memory_requests: memory: requests [10,000].
        cap_tokens: memory: the server's ``--cap-tokens``. timeout: most seconds per load/crash run.
        threads: torch threads of the servers and of the direct run (None = torch's choice).
        agent_conversations, agent_turns, agent_max_tokens: agent: tasks, requests per task, max_tokens each.
        agent_k: agent: the servers' fixed corpus draft depth (``--k K --k-max K``; None = their defaults).
        concurrent: concurrent/longprompt sizes. plain_check: concurrent: also compare with plain greedy here.
        fleet: the fleet phase's sizes.
    """

    model: str | None = None
    questions: int = 5
    max_tokens: int = 64
    requests: int = 32
    concurrency: int = 4
    load_distinct: int = 8
    load_max_tokens: int = 24
    repeats: int = 3
    memory_requests: int = 100
    cap_tokens: int = 1_000_000
    timeout: float = 1800.0
    threads: int | None = None
    agent_conversations: int = 2
    agent_turns: int = 5
    agent_max_tokens: int = 48
    agent_k: int | None = None
    concurrent: ConcurrentBenchConfig = field(default_factory=ConcurrentBenchConfig)
    plain_check: bool = True
    fleet: FleetBenchConfig = field(default_factory=FleetBenchConfig)


def ask(client, base: str, question: str, max_tokens: int, timeout: float = 600.0) -> tuple[int, dict, float]:
    """One greedy chat request: (HTTP status, JSON body, client-side seconds)."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0})
    return r.status_code, r.json(), time.perf_counter() - t0


def _text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def _questions(n: int, offset: int = 0) -> list[str]:
    from redraft.bench.workloads import round_robin

    qs = load_questions()
    cats = list(dict.fromkeys(q["category"] for q in qs))
    return [q["turns"][0] for q in round_robin(qs, cats, n + offset)][offset:]


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else 0.0


# ---- phases ---------------------------------------------------------------------------------------------------------
def phase_repeat(cfg: ServeBenchConfig, work: Path) -> dict:
    import httpx

    from redraft.bench.workloads import replay_questions

    questions = [q["turns"][0] for q in replay_questions(load_questions(), cfg.questions)]
    srv = ServerProcess(cfg.model, work / "repeat.log", "--corpus-dir", str(work / "repeat"), "--no-answer-cache",
                        threads=cfg.threads)
    passes = []
    try:
        base = srv.wait_ready()
        with httpx.Client() as c:
            for _ in range(2):
                texts, tokens, seconds, forwards = [], 0, 0.0, 0
                for q in questions:
                    status, body, dt = ask(c, base, q, cfg.max_tokens)
                    if status != 200:
                        raise RuntimeError(f"repeat: HTTP {status}: {body}")
                    texts.append(_text(body))
                    tokens += body["usage"]["completion_tokens"]
                    forwards += body["redraft"]["forwards"]
                    seconds += dt
                passes.append({"texts": texts, "tokens": tokens, "seconds": seconds, "forwards": forwards,
                               "tokens_per_second": tokens / seconds if seconds else 0.0})
        m = srv.metrics()
    finally:
        srv.stop()
    first, second = passes
    return {"questions": len(questions), "max_tokens": cfg.max_tokens,
            "first_tokens_per_second": first["tokens_per_second"],
            "second_tokens_per_second": second["tokens_per_second"],
            "speedup": second["tokens_per_second"] / first["tokens_per_second"] if first["tokens_per_second"] else 0,
            "first_tokens_per_forward": first["tokens"] / max(1, first["forwards"]),
            "second_tokens_per_forward": second["tokens"] / max(1, second["forwards"]),
            "identical": sum(a == b for a, b in zip(first["texts"], second["texts"], strict=True)),
            "corpus_acceptance": metric_value(m, "vllm:spec_decode_num_accepted_tokens_total", source="corpus")
            / max(1.0, metric_value(m, "vllm:spec_decode_num_draft_tokens_total", source="corpus"))}


def _fire(base: str, jobs: list[tuple[int, str]], concurrency: int, max_tokens: int, deadline: float,
          stop: threading.Event | None = None) -> list[dict]:
    """Send (index, question) jobs from ``concurrency`` client threads; one record per job sent."""
    import httpx

    lock, out, todo = threading.Lock(), [], list(jobs)

    def client():
        with httpx.Client() as c:
            while time.monotonic() < deadline and not (stop and stop.is_set()):
                with lock:
                    if not todo:
                        return
                    i, q = todo.pop(0)
                try:
                    status, body, dt = ask(c, base, q, max_tokens, timeout=max(1.0, deadline - time.monotonic()))
                except (httpx.HTTPError, ValueError) as e:
                    status, body, dt = 0, {"error": str(e)}, 0.0
                with lock:
                    out.append({"i": i, "status": status, "body": body, "seconds": dt})

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 30)
    return out


def phase_load(cfg: ServeBenchConfig, work: Path) -> dict:
    import httpx

    questions = _questions(cfg.load_distinct)
    srv = ServerProcess(cfg.model, work / "load.log", "--no-answer-cache", threads=cfg.threads)
    try:
        base = srv.wait_ready()
        with httpx.Client() as c:
            alone = {}
            for i, q in enumerate(questions):
                status, body, _ = ask(c, base, q, cfg.load_max_tokens)
                alone[i] = _text(body) if status == 200 else None
        jobs = [(i % len(questions), questions[i % len(questions)]) for i in range(cfg.requests)]
        t0 = time.monotonic()
        res = _fire(base, jobs, cfg.concurrency, cfg.load_max_tokens, t0 + cfg.timeout)
        wall = time.monotonic() - t0
    finally:
        srv.stop()
    ok = [r for r in res if r["status"] == 200]
    lat = [r["seconds"] for r in ok]
    wait = [r["body"]["redraft"]["queue_seconds"] for r in ok]
    return {"requests": cfg.requests, "concurrency": cfg.concurrency, "sent": len(res),
            "errors": len(res) - len(ok) + (cfg.requests - len(res)),
            "not_identical": sum(_text(r["body"]) != alone[r["i"]] for r in ok),
            "latency_p50": _pct(lat, 50), "latency_p99": _pct(lat, 99), "queue_wait_p50": _pct(wait, 50),
            "queue_wait_p99": _pct(wait, 99), "wall_seconds": wall,
            "requests_per_second": len(ok) / wall if wall else 0.0}


def phase_overhead(cfg: ServeBenchConfig, work: Path) -> dict:
    import httpx

    # torch-bound: the direct run
    from redraft.compose import SpeculationConfig, build_engine, build_policy
    from redraft.io.loading import load_model
    from redraft.io.prompts import encode_prompt

    question = _questions(1)[0]
    http, direct = [], []
    srv = ServerProcess(cfg.model, work / "overhead.log", "--no-learn", "--no-answer-cache", threads=cfg.threads)
    try:
        base = srv.wait_ready()
        with httpx.Client() as c:
            for _ in range(cfg.repeats):
                status, body, dt = ask(c, base, question, cfg.max_tokens)
                http.append((body["usage"]["completion_tokens"] / dt, _text(body)))
    finally:
        srv.stop()
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    loaded = load_model(cfg.model, quiet=True)
    ids = encode_prompt(loaded.tokenizer, [{"role": "user", "content": question}], chat=True)  # as the server
    spec = SpeculationConfig()  # the server's speculation at its defaults, no corpus (a --no-learn server)
    policy = build_policy(loaded.model, max_nodes=spec.policy_nodes)  # one, learning across repeats as the server's
    for _ in range(cfg.repeats):
        engine = build_engine(loaded.model, spec, eos_token_ids=loaded.eos_token_ids, policy=policy)
        res = engine.generate(ids, cfg.max_tokens)
        direct.append((res.tokens_per_second, loaded.tokenizer.decode(res.output_ids, skip_special_tokens=True)))
    h, d = sorted(x for x, _ in http), sorted(x for x, _ in direct)
    return {"repeats": cfg.repeats, "http_tokens_per_second": h[len(h) // 2],
            "direct_tokens_per_second": d[len(d) // 2], "ratio": h[len(h) // 2] / d[len(d) // 2],
            "identical": all(t == direct[0][1] for _, t in http + direct)}


def _restart_check(cfg: ServeBenchConfig, work: Path, cdir: Path, name: str) -> tuple[float, str]:
    srv = ServerProcess(cfg.model, work / f"crash-{name}.log", "--corpus-dir", str(cdir), threads=cfg.threads)
    try:
        srv.wait_ready()
        spans = metric_value(srv.metrics(), "redraft:corpus_spans", tenant="default")
    finally:
        srv.stop()
    return spans, (work / f"crash-{name}.log").read_text(errors="replace")


def phase_crash(cfg: ServeBenchConfig, work: Path) -> dict:
    cdir = work / "crash"
    questions = _questions(cfg.requests, offset=cfg.load_distinct)
    srv = ServerProcess(cfg.model, work / "crash-run.log", "--corpus-dir", str(cdir), threads=cfg.threads)
    stop = threading.Event()
    try:
        base = srv.wait_ready()
        done: list[dict] = []
        t = threading.Thread(target=lambda: done.extend(_fire(base, list(enumerate(questions)), cfg.concurrency,
                                                              cfg.load_max_tokens, time.monotonic() + cfg.timeout,
                                                              stop)))
        t.start()
        deadline = time.monotonic() + cfg.timeout
        while time.monotonic() < deadline and metric_value(srv.metrics(), "vllm:request_success_total") < \
                max(1, cfg.requests // 2):
            time.sleep(0.2)
        srv.kill()  # kill -9 mid-load
        stop.set()
        t.join(120)
    finally:
        srv.kill()
    learned = sum(1 for r in done if r["status"] == 200 and r["body"]["redraft"]["learned"])
    out = {"completed": sum(r["status"] == 200 for r in done), "completed_learned": learned}
    out["spans_after_kill"], _ = _restart_check(cfg, work, cdir, "restart")
    out["kill_ok"] = learned <= out["spans_after_kill"] <= learned + cfg.concurrency
    journal = next(iter(sorted((cdir / "default").glob("journal-*.rdj"))), None)
    for damage in ("truncate", "flip"):
        data = bytearray(journal.read_bytes()) if journal else bytearray()
        if len(data) < 64:
            out[f"{damage}_ok"] = None  # too small a journal to damage meaningfully
            continue
        if damage == "truncate":
            data = data[:-5]
        else:
            data[len(data) // 2] ^= 0x20
        journal.write_bytes(bytes(data))
        spans, log = _restart_check(cfg, work, cdir, damage)
        out[f"spans_after_{damage}"] = spans
        out[f"{damage}_ok"] = "warning" in log and spans >= out["spans_after_kill"] - 2
    return out


def phase_memory(cfg: ServeBenchConfig, work: Path) -> dict:
    import httpx

    base_qs = _questions(50)
    srv = ServerProcess(cfg.model, work / "memory.log", "--corpus-dir", str(work / "memory"), "--no-sync",
                        "--cap-tokens", str(cfg.cap_tokens), threads=cfg.threads)
    try:
        base = srv.wait_ready()
        with httpx.Client() as c:
            ask(c, base, base_qs[0], 4)
            before = srv.rss()
            errors, every, samples = 0, max(1, cfg.memory_requests // 10), []
            for i in range(cfg.memory_requests):
                status, _, _ = ask(c, base, f"Request {i}. {base_qs[i % len(base_qs)][:200]}", 8)
                errors += status != 200
                if (i + 1) % every == 0:  # the trend, so that a short run can be extrapolated honestly
                    samples.append([i + 1, round(srv.rss() / 2**20, 1)])
        after = srv.rss()
        m = srv.metrics()
    finally:
        srv.stop()
    return {"requests": cfg.memory_requests, "errors": errors, "rss_before_mb": before / 2**20,
            "rss_after_mb": after / 2**20, "rss_mb_by_requests": samples, "corpus_tokens": metric_value(m, "redraft:corpus_tokens"),
            "evicted_spans": metric_value(m, "redraft:corpus_evicted_spans"),
            "cap_tokens": cfg.cap_tokens}


def phase_agent(cfg: ServeBenchConfig, work: Path) -> dict:
    def start(name: str, reuse: bool, answers: bool):
        extra = ([] if reuse else ["--prefix-cache-tokens", "0"]) + ([] if answers else ["--no-answer-cache"])
        if cfg.agent_k:
            extra += ["--k", str(cfg.agent_k), "--k-max", str(cfg.agent_k)]
        srv = ServerProcess(cfg.model, work / f"{name}.log", *extra, threads=cfg.threads)
        try:
            return srv.wait_ready(), srv.stop, srv.cpu_seconds
        except BaseException:
            srv.kill()
            raise

    agent = AgentBenchConfig(conversations=cfg.agent_conversations, turns=cfg.agent_turns,
                             max_tokens=cfg.agent_max_tokens)
    return run_agent_phase(start, agent, timeout=cfg.timeout)


def phase_concurrent(cfg: ServeBenchConfig, work: Path) -> dict:
    c = for_build(cfg.concurrent, serve_help())
    plain = None
    if cfg.plain_check:
        def plain(prompts, n):
            return plain_answers(cfg.model, prompts, n, threads=cfg.threads, runtime=c.runtime)
    return run_concurrent_phase(process_starter(cfg.model, work, cfg.threads), c, plain=plain)


def phase_longprompt(cfg: ServeBenchConfig, work: Path) -> dict:
    return run_longprompt_phase(process_starter(cfg.model, work, cfg.threads), for_build(cfg.concurrent, serve_help()))


def phase_fleet(cfg: ServeBenchConfig, work: Path) -> dict:
    return run_fleet_phase(cfg.model, work, cfg.fleet, _questions(cfg.fleet.distinct + 1), threads=cfg.threads)


# ---- all phases -----------------------------------------------------------------------------------------------------
def check_phases(phases: list[str]) -> None:
    """Raises ValueError naming the first phase not in PHASES, or when ``phases`` is empty."""
    bad = [x for x in phases if x not in PHASES]
    if bad or not phases:
        raise ValueError(f"unknown phase {bad[0] if bad else '(none)'!r}; choose from {', '.join(PHASES)}")


def run_serve_bench(cfg: ServeBenchConfig, phases: list[str], work: Path,
                    log: Callable[[str], None] = print) -> dict:
    """Run ``phases`` (names from PHASES, in order) with logs and corpora under ``work``; returns {phase: figures}.

    Each phase's figures are logged as one ``name: key=value, ...`` line as soon as it ends.
    Raises:
        ValueError: an unknown phase name. RuntimeError: a server that does not start or a failed request.
    """
    check_phases(phases)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in phases:
        print(f"bench serve: {name} ...", file=sys.stderr, flush=True)
        results[name] = PHASE_FUNCTIONS[name](cfg, work)
        if name in PHASE_TABLES:
            log(PHASE_TABLES[name](results[name]))
        else:
            log(f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in results[name].items()))
    return results


PHASE_FUNCTIONS = {"repeat": phase_repeat, "load": phase_load, "overhead": phase_overhead, "crash": phase_crash,
                   "memory": phase_memory, "agent": phase_agent, "concurrent": phase_concurrent,
                   "longprompt": phase_longprompt, "fleet": phase_fleet}
PHASE_TABLES = {"concurrent": concurrent_table, "longprompt": longprompt_table}


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
