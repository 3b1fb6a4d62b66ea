"""Prefix KV on disk across a restart and between replicas: time to first token (TTFT) of a ~1,000-token system
prompt's request on a restarted server and on a second server of the same ``--corpus-dir``, against a server that
prefills it cold; and lm-eval's few-shot generate_until rerun after a restart (the figures in docs/serving.md,
"Prefix KV on disk").

``ttft`` part, per runtime (``--runtimes``; the default model on transformers, the bundled GGUF on llama.cpp), per
round (a fresh directory D each, ``--rounds``), every server ``python -m redraft --threads N serve --corpus-dir ...``
on a free loopback port and every measured request the first one its server answers (greedy, streamed,
``max_tokens`` 32, one system prompt of ``--system-tokens`` tokens, counted by the server's /tokenize, + a short
user question):

1. cold: a server on the empty D answers question 1; it is stopped (SIGINT, then waited for: its prefix store's
   writer flushes on a clean exit);
2. restart: server A on D answers question 2 (its prompt's system part is on disk: ``prefix_disk_tokens``);
   reference: a server on an empty directory, started beside A, answers question 2 cold;
3. replica: while A runs, server B on D answers question 3 (from an entry the cold server or A wrote); reference:
   another server on an empty directory, started beside B, answers question 3 cold.

Each pair's two requests are sent seconds apart, the reference first in even rounds and second in odd ones, so
both see the same load on a shared machine; before each request (and each lm-eval run) the script waits, up to
``--max-wait`` seconds, until the machine keeps under ``--max-busy`` cores busy (the other server's writing of its
answer's prefix entry, another user's job), and records how busy the rest of the machine was during each request. TTFT is the client's time from sending the request to the first chunk
with content; the server's CPU seconds until then (psutil) are recorded beside it (less sensitive to other load).
Ratios: reference / restart (question 2) and reference / replica (question 3), per round, and their medians. Every
restart and replica answer must equal its reference answer byte for byte (recorded; the script exits 1 if not).

``lm-eval`` part (transformers runtime): tests/data/lm_eval's ``redraft_capitals`` (generate_until) with
``--num-fewshot`` examples (lm-eval draws them from the task's 8 questions) through ``local-completions``
(``batch_size`` 1, ``num_concurrent`` 1), against a server with ``--corpus-dir D --no-answer-cache`` (so a rerun
is not the answer cache), then against a restarted server on D; with ``--no-learn`` (the prefix entries alone) and
with learning (the learned corpus also drafts the rerun's answers). Wall seconds of each ``simple_evaluate`` (lm-eval
imported and warmed once before any timing), summed server latency and prefix counters from /metrics, ratio, and
whether the two runs' logged samples (prompts, responses, filtered responses) are identical.

Usage (from the repository root; lm-eval is in the test extra, llama.cpp in the llama extra):
    python benchmarks/serve/prefix_restart.py OUT.json [--parts ttft,lm-eval] [--runtimes transformers,llama.cpp]
        [--rounds 3] [--threads 2] [--system-tokens 1000] [--max-tokens 32] [--num-fewshot 5] [--limit 8]
        [--lm-eval-variants no-learn,learn] [--lm-eval-rounds 3] [--max-busy 0.3] [--clean-busy 0.5]
        [--max-wait 300] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from redraft.bench.server_process import ServerProcess, metric_value  # noqa: E402

QUESTIONS = (
    "A customer bought a laptop 19 days ago and wants to return it opened. What do I tell them?",
    "How long does express shipping to Canada take, and what does it cost?",
    "My invoice shows a charge twice. Who fixes that and how fast?",
)
DISK_METRICS = ("hit_tokens", "reads", "bytes_read", "writes", "bytes_written", "rejected", "errors")
LM_TASK, LM_WARM_TASK = "redraft_capitals", "redraft_capitals_mc"
LM_METRICS = {"server_seconds": "vllm:e2e_request_latency_seconds_sum", "requests": "vllm:e2e_request_latency_seconds_count",
              "forwards": "redraft:target_forwards_total", "generated_tokens": "vllm:generation_tokens_total",
              "prompt_tokens": "vllm:prefix_cache_queries_total", "prefix_hit_tokens": "vllm:prefix_cache_hits_total",
              "prefix_disk_hit_tokens": "redraft:prefix_disk_hit_tokens_total",
              "prefix_disk_reads": "redraft:prefix_disk_reads_total",
              "prefix_disk_writes": "redraft:prefix_disk_writes_total"}


# ---- the system prompt ------------------------------------------------------------------------------------------

_TEAMS = ("the returns desk", "the billing team", "the shipping office", "customer care", "the warranty group",
          "the store manager", "the security team", "the accounts team", "the logistics partner", "the help line")
_ITEMS = ("laptops", "phones", "headphones", "monitors", "printers", "keyboards", "tablets", "cameras",
          "smart watches", "routers", "gift cards", "software licences", "refurbished items", "bundles")
_UNITS = (("days", 14), ("days", 30), ("hours", 48), ("business days", 5), ("weeks", 2), ("days", 60),
          ("hours", 24), ("business days", 10), ("days", 90), ("months", 12))
_PLACES = ("Canada", "Mexico", "the United Kingdom", "Germany", "Japan", "Australia", "Brazil", "Norway")
_SENTENCES = (
    "Requests about {item} are handled by {team}, who must answer within {n} {unit}.",
    "Opened {item} may be returned within {n} {unit} of delivery if every accessory is included.",
    "A restocking fee of {pct} percent applies to opened {item}, except when the item arrived damaged.",
    "Express shipping to {place} takes {k} business days and costs {price} dollars per parcel.",
    "Standard shipping to {place} is free above {price} dollars and takes up to {n} {unit}.",
    "When an invoice lists a charge twice, {team} reverses the duplicate within {k} business days.",
    "Agents never promise a refund before {team} has confirmed the item's condition in writing.",
    "Warranty claims for {item} need the order number, a photo of the fault and the serial number.",
    "Customers in {place} pay import duties themselves unless the order page said duties were included.",
    "If a parcel is late by more than {k} days, the agent opens a trace with {team} and tells the customer.",
    "Price matching covers {item} sold by a major retailer in {place}, within {n} {unit} of purchase.",
    "Store credit for {item} never expires, and it can be split across at most {k} later orders.",
    "An agent may waive the restocking fee once per customer per year, after noting the reason in the ticket.",
    "Escalations about {item} go to {team} first and to the store manager only after {n} {unit}.",
    "Personal data is never read aloud on a call; the agent confirms the last {k} digits of the card instead.",
    "Gift receipts allow an exchange of {item} but never a cash refund, whatever the purchase date.",
    "Orders shipped to {place} can be cancelled free of charge until {team} prints the label.",
    "Batteries and damaged {item} cannot be sent by air to {place}; the agent offers ground shipping instead.",
)


def policy_sentences(count: int) -> list[str]:
    """``count`` deterministic policy sentences (varied templates, items, teams, figures), grouped in sections."""
    out = []
    for i in range(count):
        tmpl = _SENTENCES[(i * 7) % len(_SENTENCES)]
        unit, n = _UNITS[(i * 3 + 1) % len(_UNITS)]
        out.append(tmpl.format(item=_ITEMS[(i * 5 + 2) % len(_ITEMS)], team=_TEAMS[(i * 3) % len(_TEAMS)], n=n,
                               unit=unit, place=_PLACES[(i * 5) % len(_PLACES)], pct=5 + (i * 7) % 20,
                               k=2 + (i * 3) % 9, price=19 + (i * 37) % 180))
    return out


def system_prompt(count: int) -> str:
    head = ("You are the customer service assistant of Northwind Electronics. Answer in one or two short sentences, "
            "following this policy exactly.\n")
    lines, section = [head], 0
    for i, s in enumerate(policy_sentences(count)):
        if i % 6 == 0:
            section += 1
            lines.append(f"\nSection {section}.")
        lines.append(f" {s}")
    return "".join(lines)


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def token_count(base: str, msgs: list[dict], generation_prompt: bool = False) -> int:
    r = httpx.post(f"{base}/tokenize", json={"messages": msgs, "add_generation_prompt": generation_prompt}, timeout=60)
    r.raise_for_status()
    return int(r.json()["count"])


def fit_system(base: str, target: int) -> tuple[str, int]:
    """The shortest policy text whose system message (with the chat template's markers) holds >= ``target`` tokens,
    counted by the server's /tokenize (which touches no cache)."""
    lo, hi = 1, 8
    while token_count(base, [{"role": "system", "content": system_prompt(hi)}]) < target:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if token_count(base, [{"role": "system", "content": system_prompt(mid)}]) < target:
            lo = mid + 1
        else:
            hi = mid
    text = system_prompt(hi)
    return text, token_count(base, [{"role": "system", "content": text}])


# ---- servers and requests ---------------------------------------------------------------------------------------

class Server:
    """One ``redraft serve`` process (:class:`ServerProcess`): launched at once, :meth:`ready` waits for it (so
    several start side by side); its start time, stop status and log."""

    def __init__(self, log: Path, runtime: str, threads: int, corpus_dir: Path | None, *extra: str) -> None:
        args = ["--runtime", runtime, *(["--corpus-dir", str(corpus_dir)] if corpus_dir else []), *extra]
        self.t0, self.log = time.perf_counter(), log
        self.proc = ServerProcess(None, log, *args, threads=threads)

    def ready(self) -> Server:
        try:
            self.base = self.proc.wait_ready()
        except BaseException:
            self.proc.kill()
            raise
        self.start_seconds = round(time.perf_counter() - self.t0, 2)
        self.model_id = httpx.get(f"{self.base}/v1/models", timeout=30).json()["data"][0]["id"]
        return self

    def metrics(self) -> str:
        return self.proc.metrics()

    def stop(self) -> dict:
        """SIGINT and wait (its prefix store writes what is queued on the way out); how it exited."""
        p = self.proc.proc
        t0 = time.perf_counter()
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=60)
        text = self.log.read_text(errors="replace")
        return {"rc": p.returncode, "seconds": round(time.perf_counter() - t0, 2),
                "clean": "shutting down" in text and "Traceback" not in text}


def machine_busy() -> float:
    """CPU seconds all cores of this machine have been busy since boot (/proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def wait_quiet(max_busy: float, max_wait: float) -> dict:
    """Wait until the machine's other work keeps under ``max_busy`` cores busy (over one second), at most
    ``max_wait`` seconds; what was seen (a shared machine: another user's job makes every timing noise)."""
    t0, busy = time.perf_counter(), None
    while True:
        b0, w0 = machine_busy(), time.perf_counter()
        time.sleep(1.0)
        busy = (machine_busy() - b0) / (time.perf_counter() - w0)
        if busy < max_busy or time.perf_counter() - t0 > max_wait:
            return {"waited_s": round(time.perf_counter() - t0, 1), "busy_cores": round(busy, 2)}


def ask(base: str, model: str, msgs: list[dict], max_tokens: int, cpu=None, faults=None) -> dict:
    """One greedy streamed chat completion: TTFT (sent -> first chunk with content; the connection is opened inside
    it, the client's set-up is not), total seconds, the text, the ``redraft`` statistics (from the finishing chunk)
    and usage; with ``cpu`` (the server's CPU seconds so far) also
    the server's CPU seconds until the first chunk arrived (less sensitive to other load on the machine than TTFT);
    with ``faults`` (the server's minor page faults so far) the pages it touched for the first time until then."""
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, ttft, stats, usage, cpu_first = [], None, {}, {}, None
    cpu0 = cpu() if cpu else None
    faults0, faults_first = faults() if faults else None, None
    busy0 = machine_busy()
    client = httpx.Client(timeout=600)  # made before the clock starts: httpx builds an SSL context (~35 ms here)
    t0 = time.perf_counter()
    with client, client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"streamed error: {ev['error']}")
            for ch in ev.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                        cpu_first = cpu() - cpu0 if cpu else None
                        faults_first = faults() - faults0 if faults0 is not None else None
                    text.append(piece)
            if ev.get("redraft"):
                stats = ev["redraft"]
            if ev.get("usage"):
                usage = ev["usage"]
    total = time.perf_counter() - t0
    others = None if cpu is None else (machine_busy() - busy0 - (cpu() - cpu0)) / total
    keep = ("prefix_hit_tokens", "prefix_disk_tokens", "forwards", "generation_seconds", "queue_seconds",
            "tokens_per_forward", "answer_cache_hit")
    return {"ttft_s": round(ttft if ttft is not None else total, 4), "total_s": round(total, 4),
            "server_cpu_to_first_s": None if cpu_first is None else round(cpu_first, 4),
            "server_page_faults_to_first": faults_first,
            "other_busy_cores": None if others is None else round(others, 2),  # the rest of the machine meanwhile
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            **{k: stats.get(k) for k in keep}, "text": "".join(text)}


def disk_counters(srv: Server) -> dict:
    text = srv.metrics()
    return {k: metric_value(text, f"redraft:prefix_disk_{k}_total") for k in DISK_METRICS}


def disk_files(d: Path) -> dict:
    files = list(d.glob("*/prefix-kv/*/*.safetensors"))
    return {"entries": len(files), "bytes": sum(f.stat().st_size for f in files)}


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


# ---- the ttft part ----------------------------------------------------------------------------------------------

def ttft_round(runtime: str, rnd: int, a, work: Path, system: str | None) -> tuple[dict, str]:
    """One round on one runtime (see the module docstring); returns its record and the system prompt used. Each
    measured request's reference is asked seconds before or after it (the order alternates by round), on a server
    started beside it, so both see the same load on a shared machine."""
    d = work / f"{runtime}-r{rnd}"
    shared, ref_dirs = d / "corpus", (d / "reference-q2", d / "reference-q3")
    for p in (shared, *ref_dirs):
        p.mkdir(parents=True)
    out: dict = {"round": rnd, "reference_first": rnd % 2 == 0}

    def answer(srv: Server, question: str) -> dict:
        res = ask(srv.base, srv.model_id, messages(system, question), a.max_tokens, srv.proc.cpu_seconds,
                  srv.proc.page_faults)
        return {**res, "disk_counters": disk_counters(srv), "start_seconds": srv.start_seconds}

    def pair(q: int, srv: Server, name: str, ref: Server) -> None:
        for key, which in ((f"reference_q{q}", ref), (name, srv))[::1 if out["reference_first"] else -1]:
            # before each: the other server's work after its answer (learning it, writing its prefix entry to
            # disk in the background) is over, and so is other users' work, as far as --max-wait allows
            quiet = wait_quiet(a.max_busy, a.max_wait)
            out[key] = {**answer(which, QUESTIONS[q - 1]), "quiet_before": quiet}

    cold = Server(d / "cold.log", runtime, a.threads, shared)
    try:
        cold.ready()
        if system is None:
            system, n = fit_system(cold.base, a.system_tokens)
            print(f"{runtime}: system prompt of {n} tokens", file=sys.stderr, flush=True)
        out["system_tokens"] = token_count(cold.base, [{"role": "system", "content": system}])
        out["quiet_q1"] = wait_quiet(a.max_busy, a.max_wait)
        res = answer(cold, QUESTIONS[0])
    finally:
        stop = cold.stop()
    out["cold_q1"] = {**res, "stop": stop}
    out["disk_after_cold"] = disk_files(shared)
    servers: dict[str, Server] = {}
    try:
        servers["restart_q2"] = Server(d / "restart-A.log", runtime, a.threads, shared)
        servers["reference_q2"] = Server(d / "reference-q2.log", runtime, a.threads, ref_dirs[0])
        for srv in list(servers.values()):
            srv.ready()
        pair(2, servers["restart_q2"], "restart_q2", servers["reference_q2"])
        servers["replica_q3"] = Server(d / "replica-B.log", runtime, a.threads, shared)  # A keeps running
        servers["reference_q3"] = Server(d / "reference-q3.log", runtime, a.threads, ref_dirs[1])
        servers["replica_q3"].ready(), servers["reference_q3"].ready()
        pair(3, servers["replica_q3"], "replica_q3", servers["reference_q3"])
    finally:
        stops = {key: srv.stop() for key, srv in reversed(servers.items())}
    for key, st in stops.items():
        out[key]["stop"] = st
    out["disk_after_replica"] = disk_files(shared)
    out["identical_q2"] = out["restart_q2"]["text"] == out["reference_q2"]["text"]
    out["identical_q3"] = out["replica_q3"]["text"] == out["reference_q3"]["text"]
    for name, ref, key in (("restart", "reference_q2", "restart_q2"), ("replica", "reference_q3", "replica_q3")):
        out[f"ratio_{name}"] = round(out[ref]["ttft_s"] / out[key]["ttft_s"], 2)
        out[f"cpu_ratio_{name}"] = round(out[ref]["server_cpu_to_first_s"] / out[key]["server_cpu_to_first_s"], 2)
    print(f"{runtime} round {rnd}: cold q1 {out['cold_q1']['ttft_s']:.3f} s; q2 reference "
          f"{out['reference_q2']['ttft_s']:.3f} s / restart {out['restart_q2']['ttft_s']:.3f} s "
          f"(disk {out['restart_q2']['prefix_disk_tokens']}) = {out['ratio_restart']}x (CPU "
          f"{out['cpu_ratio_restart']}x); q3 reference {out['reference_q3']['ttft_s']:.3f} s / replica "
          f"{out['replica_q3']['ttft_s']:.3f} s (disk {out['replica_q3']['prefix_disk_tokens']}) = "
          f"{out['ratio_replica']}x (CPU {out['cpu_ratio_replica']}x); identical "
          f"{out['identical_q2']}/{out['identical_q3']}; fresh pages to the first token: restart "
          f"{out['restart_q2']['server_page_faults_to_first']}, replica {out['replica_q3']['server_page_faults_to_first']}",
          file=sys.stderr, flush=True)
    return out, system


def clean_medians(rounds: list[dict], limit: float) -> dict:
    """The ratios' medians over the pairs during whose two requests other work kept under ``limit`` cores busy
    (None when no pair was), and how many pairs that is."""
    out = {}
    for name, ref, key in (("restart", "reference_q2", "restart_q2"), ("replica", "reference_q3", "replica_q3")):
        clean = [r for r in rounds if max(r[ref]["other_busy_cores"], r[key]["other_busy_cores"]) < limit]
        out[f"clean_pairs_{name}"] = len(clean)
        out[f"clean_median_ratio_{name}"] = med([r[f"ratio_{name}"] for r in clean]) if clean else None
        out[f"clean_median_ttft_s_{name}"] = ([med([r[k]["ttft_s"] for r in clean]) for k in (ref, key)]
                                              if clean else None)
    return out


def ttft_part(a, work: Path) -> dict:
    report, system = {}, None
    for runtime in a.runtimes:
        rounds = []
        for rnd in range(a.rounds):
            r, system = ttft_round(runtime, rnd, a, work, system)
            rounds.append(r)
        s = {key: med([r[key]["ttft_s"] for r in rounds])
             for key in ("cold_q1", "reference_q2", "restart_q2", "reference_q3", "replica_q3")}
        report[runtime] = {
            "system_tokens": rounds[0]["system_tokens"],
            "prompt_tokens": {q: rounds[0][k]["prompt_tokens"] for q, k in
                              (("q1", "cold_q1"), ("q2", "restart_q2"), ("q3", "replica_q3"))},
            "median_ttft_s": s,
            "median_server_cpu_to_first_s": {key: med([r[key]["server_cpu_to_first_s"] for r in rounds])
                                              for key in s},
            "median_ratio_restart": med([r["ratio_restart"] for r in rounds]),
            "median_ratio_replica": med([r["ratio_replica"] for r in rounds]),
            "median_cpu_ratio_restart": med([r["cpu_ratio_restart"] for r in rounds]),
            "median_cpu_ratio_replica": med([r["cpu_ratio_replica"] for r in rounds]),
            **clean_medians(rounds, a.clean_busy),
            "restart_prefix_disk_tokens": [r["restart_q2"]["prefix_disk_tokens"] for r in rounds],
            "replica_prefix_disk_tokens": [r["replica_q3"]["prefix_disk_tokens"] for r in rounds],
            "replica_found_entry": all((r["replica_q3"]["prefix_disk_tokens"] or 0) > 0.9 * r["system_tokens"]
                                       for r in rounds),
            "answers_identical": all(r["identical_q2"] and r["identical_q3"] for r in rounds),
            "answers": {"q1": rounds[0]["cold_q1"]["text"], "q2": rounds[0]["reference_q2"]["text"],
                        "q3": rounds[0]["reference_q3"]["text"]},
            "rounds": rounds,
        }
    return {"system_prompt": system, "questions": list(QUESTIONS), "max_tokens": a.max_tokens, "runtimes": report}


# ---- the lm-eval part -------------------------------------------------------------------------------------------

def lm_scrape(srv: Server) -> dict:
    text = srv.metrics()
    return {k: metric_value(text, name) for k, name in LM_METRICS.items()}


def lm_run(srv: Server, a, tasks) -> dict:
    from lm_eval import simple_evaluate

    args = (f"model={srv.model_id},base_url={srv.base}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
            "max_retries=1")
    quiet = wait_quiet(a.max_busy, a.max_wait)
    before = lm_scrape(srv)
    cpu0 = srv.proc.cpu_seconds()
    own0, busy0 = time.process_time(), machine_busy()  # this process: lm-eval, the client
    t0 = time.perf_counter()
    res = simple_evaluate(model="local-completions", model_args=args, tasks=[LM_TASK], batch_size=1, limit=a.limit,
                          num_fewshot=a.num_fewshot, log_samples=True, task_manager=tasks)
    wall = time.perf_counter() - t0
    cpu = srv.proc.cpu_seconds() - cpu0
    others = (machine_busy() - busy0 - cpu - (time.process_time() - own0)) / wall
    after = lm_scrape(srv)
    samples = sorted(res["samples"][LM_TASK], key=lambda s: s["doc_id"])
    return {"wall_seconds": round(wall, 2), **{k: round(after[k] - before[k], 3) for k in LM_METRICS},
            "server_cpu_seconds": round(cpu, 3), "quiet": quiet, "other_busy_cores": round(others, 2),
            "exact_match": res["results"][LM_TASK]["exact_match,city"],
            # the task's filter expects a sentence ("The capital of X is CITY, ..."); few-shot examples end in the bare
            # city, so the answers are bare cities the filter rejects: this counts answers naming the right city
            "answers_naming_the_city": sum(str(s["target"]).strip().lower() in str(s["resps"][0][0]).lower()
                                           for s in samples),
            "samples": [{"doc_id": s["doc_id"], "prompt": s["arguments"]["gen_args_0"]["arg_0"]
                         if isinstance(s["arguments"], dict) else s["arguments"][0][0],
                         "resps": s["resps"], "filtered_resps": s["filtered_resps"]} for s in samples]}


def lm_clean(rounds: list[dict], limit: float) -> dict:
    """:func:`clean_medians` of lm-eval's rounds: those whose two runs had other work under ``limit`` cores."""
    clean = [r for r in rounds if max(run["other_busy_cores"] for run in r["runs"]) < limit]
    return {"clean_rounds": len(clean),
            "clean_median_wall_ratio": med([r["wall_ratio"] for r in clean]) if clean else None,
            "clean_median_wall_seconds": ([med([r["runs"][i]["wall_seconds"] for r in clean]) for i in (0, 1)]
                                          if clean else None)}


def lm_eval_part(a, work: Path) -> dict:
    os.chdir(ROOT)  # the task YAML names its data file relative to the repository root
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager  # imported and indexed once, before any timing

    tasks = TaskManager(include_path=str(ROOT / "tests/data/lm_eval"))
    out: dict = {"task": LM_TASK, "num_fewshot": a.num_fewshot, "limit": a.limit, "batch_size": 1,
                 "num_concurrent": 1, "runtime": "transformers", "rounds": a.lm_eval_rounds, "variants": {}}
    rounds: dict[str, list] = {v: [] for v in a.lm_eval_variants}
    warmed = False
    for rnd in range(a.lm_eval_rounds):
        for variant in a.lm_eval_variants[::1 if rnd % 2 == 0 else -1]:  # the order alternates by round
            d = work / f"lm-eval-{variant}-r{rnd}"
            corpus = d / "corpus"
            corpus.mkdir(parents=True)
            extra = ["--no-answer-cache", "--enable-tokenizer-info-endpoint",
                     *(["--no-learn"] if variant == "no-learn" else [])]
            runs = []
            for i in (1, 2):
                srv = Server(d / f"run{i}.log", "transformers", a.threads, corpus, *extra)
                try:
                    srv.ready()
                    if not warmed:  # lm-eval's lazy imports and dataset machinery, paid once before any timing:
                        # one multiple-choice question of ~60 tokens (below the disk entries' 128-token minimum)
                        simple_evaluate(model="local-completions", model_args=f"model={srv.model_id},base_url="
                                        f"{srv.base}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                                        "max_retries=1", tasks=[LM_WARM_TASK], batch_size=1, limit=1,
                                        task_manager=tasks)
                        warmed = True
                    print(f"lm-eval {variant} round {rnd} run {i} ...", file=sys.stderr, flush=True)
                    runs.append(lm_run(srv, a, tasks))
                finally:
                    stop = srv.stop()
                runs[-1]["stop"] = stop
                runs[-1]["disk_after"] = disk_files(corpus)
            r = {"round": rnd, "runs": runs, "identical_samples": runs[0]["samples"] == runs[1]["samples"]}
            for key in ("wall_seconds", "server_seconds", "server_cpu_seconds"):
                r[key.replace("seconds", "ratio")] = round(runs[0][key] / max(1e-9, runs[1][key]), 2)
            rounds[variant].append(r)
            print(f"lm-eval {variant} round {rnd}: {runs[0]['wall_seconds']} s -> {runs[1]['wall_seconds']} s wall "
                  f"({r['wall_ratio']}x), server {runs[0]['server_seconds']} s -> {runs[1]['server_seconds']} s, "
                  f"server CPU {r['server_cpu_ratio']}x, disk hit tokens {runs[1]['prefix_disk_hit_tokens']} of "
                  f"{runs[1]['prompt_tokens']}, identical samples {r['identical_samples']}", file=sys.stderr,
                  flush=True)
    first = next(iter(rounds.values()))[0]["runs"][0]["samples"]
    for variant, rs in rounds.items():
        out["variants"][variant] = {
            "server_args": ["--corpus-dir", "D", "--no-answer-cache", "--enable-tokenizer-info-endpoint",
                            *(["--no-learn"] if variant == "no-learn" else [])],
            "median_wall_ratio": med([r["wall_ratio"] for r in rs]),
            "median_server_ratio": med([r["server_ratio"] for r in rs]),
            "median_server_cpu_ratio": med([r["server_cpu_ratio"] for r in rs]),
            "median_wall_seconds": [med([r["runs"][i]["wall_seconds"] for r in rs]) for i in (0, 1)],
            **lm_clean(rs, a.clean_busy),
            "identical_samples": all(r["identical_samples"] for r in rs),
            "rounds": rs}
    out["identical_samples_everywhere"] = all(run["samples"] == first for rs in rounds.values() for r in rs
                                              for run in r["runs"])
    return out


# ---- main ---------------------------------------------------------------------------------------------------------

def git(*args: str) -> bytes:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True).stdout
    except OSError:
        return b""


def code_state() -> str:
    """What the servers import: the git tree of redraft/ at HEAD and a digest of its uncommitted changes."""
    import hashlib

    diff = git("diff", "HEAD", "--", "redraft")
    return git("rev-parse", "--short", "HEAD:redraft").decode().strip() + (
        "+" + hashlib.sha256(diff).hexdigest()[:12] if diff else "")


def machine(threads: int) -> dict:
    import torch
    import transformers

    from redraft.pricing.cache import cpu_model

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "commit": git("rev-parse", "--short", "HEAD").decode().strip(), "code": code_state(),
            "load_average_at_start": load, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("out", help="JSON report")
    ap.add_argument("--parts", type=csv(str), default=["ttft", "lm-eval"], help="ttft, lm-eval or both (default)")
    ap.add_argument("--runtimes", type=csv(str), default=["transformers", "llama.cpp"],
                    help="runtimes of the ttft part (default transformers,llama.cpp)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the ttft part, a fresh directory each (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="--threads of every server (default 2)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="system message length in tokens (default 1000)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each question (default 32)")
    ap.add_argument("--num-fewshot", type=int, default=5, help="lm-eval few-shot examples (default 5; at most 7)")
    ap.add_argument("--limit", type=int, default=8, help="lm-eval questions (default 8: all)")
    ap.add_argument("--lm-eval-variants", type=csv(str), default=["no-learn", "learn"],
                    help="servers of the lm-eval part: no-learn (prefix entries only), learn (default both)")
    ap.add_argument("--lm-eval-rounds", type=int, default=3,
                    help="first run + rerun pairs per lm-eval variant, a fresh directory each (default 3)")
    ap.add_argument("--max-busy", type=float, default=0.3,
                    help="before each measured pair, wait until other work keeps fewer cores busy (default 0.3)")
    ap.add_argument("--clean-busy", type=float, default=0.5,
                    help="a pair (run) counts as clean when other work kept fewer cores busy meanwhile (default 0.5); "
                         "the report gives medians over all pairs and over the clean ones")
    ap.add_argument("--max-wait", type=float, default=300, help="... but at most this many seconds (default 300)")
    ap.add_argument("--work", default=None, help="directories and server logs here (default: a temporary directory)")
    a = ap.parse_args()
    bad = (set(a.parts) - {"ttft", "lm-eval"}) | (set(a.runtimes) - {"transformers", "llama.cpp"}) \
        | (set(a.lm_eval_variants) - {"no-learn", "learn"})
    if bad or min(a.rounds, a.lm_eval_rounds) < 1:
        raise SystemExit(f"unknown --parts/--runtimes/--lm-eval-variants value(s): {sorted(bad)}" if bad
                         else "--rounds and --lm-eval-rounds must be >= 1")
    work = Path(a.work or tempfile.mkdtemp(prefix="redraft-prefix-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))  # servers: this checkout
    report: dict = {"benchmark": "prefix_restart", "command": " ".join(["python", *sys.argv]),
                    "machine": machine(a.threads), "work": str(work)}
    if "ttft" in a.parts:
        report["ttft"] = ttft_part(a, work)
    if "lm-eval" in a.parts:
        report["lm_eval"] = lm_eval_part(a, work)
    report["code_at_end"] = code_state()  # another edit under redraft/ meanwhile: the servers ran mixed code
    report["code_changed_during_run"] = report["code_at_end"] != report["machine"]["code"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    ok = not report["code_changed_during_run"]
    if not ok:
        print(f"the code under redraft/ changed during the run ({report['machine']['code']} -> "
              f"{report['code_at_end']}): run it again", file=sys.stderr)
    for runtime, r in report.get("ttft", {}).get("runtimes", {}).items():
        print(f"{runtime}: TTFT reference/restart {r['median_ratio_restart']}x, reference/replica "
              f"{r['median_ratio_replica']}x (clean pairs only: {r['clean_median_ratio_restart']}x of "
              f"{r['clean_pairs_restart']}, {r['clean_median_ratio_replica']}x of {r['clean_pairs_replica']}); server CPU to the first token {r['median_cpu_ratio_restart']}x, "
              f"{r['median_cpu_ratio_replica']}x (medians of {a.rounds}); answers identical "
              f"{r['answers_identical']}, replica found an entry {r['replica_found_entry']}")
        ok &= r["answers_identical"]
    for variant, v in report.get("lm_eval", {}).get("variants", {}).items():
        print(f"lm-eval {variant}: rerun after restart {v['median_wall_ratio']}x wall, {v['median_server_ratio']}x "
              f"summed server latency, {v['median_server_cpu_ratio']}x server CPU seconds (medians of "
              f"{a.lm_eval_rounds}; clean rounds only: {v['clean_median_wall_ratio']}x wall of {v['clean_rounds']}), "
              f"identical samples {v['identical_samples']}")
        ok &= v["identical_samples"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
