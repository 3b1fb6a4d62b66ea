"""``redraft bench serve --phases fleet``: several ``redraft serve`` replicas writing one corpus directory.

- **replay across replicas**: a fresh fleet; replica 0 answers a question, then replica 1 is asked the same request
  every 0.1 s until it replays it (no answer cache on either): the delay from the first answer's end, replica 1's
  forwards, its generation time against replica 0's, identical text.
- **load with kills**: R completions requests (D distinct token-id prompts, each sent R/D times, round-robin over
  the replicas, C clients), during which one replica is killed with ``kill -9`` while requests run (twice) and one
  while it holds the compaction lock (``--compact-tokens`` small, so compactions are frequent), each restarted on
  the same directory. Failed requests are sent again at the end. Then the replicas stop and a checker reads the
  directory (every journal and the base): every completed answer is stored (its prompt's span, its text), and no
  prompt's span is stored twice.
- **latency**: the same workload without kills on three replicas sharing one directory and on three with a directory
  each (one writer each, the single-writer baseline): p50/p95 latency of each and the ratio.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from redraft.bench.server_process import ServerProcess


@dataclass
class FleetBenchConfig:
    """Sizes of the fleet phase (``redraft bench serve --fleet-*``).

    Attributes:
        servers: replicas. requests: requests of the load. distinct: distinct prompts among them.
        concurrency: client threads. max_tokens: max_tokens of each load request. replay_max_tokens: of the
        replay request. kills: kill -9 while requests run. kill_in_compaction: one more while a replica compacts.
        compact_tokens: the replicas' ``--compact-tokens``. timeout: most seconds of each load run.
        latency: also run the latency comparison (shared directory against a directory each).
        seed_tokens: ids of random spans (uniform below the prompts' largest id) in the shared directory's base before the
        replicas start, so that a compaction has a production-sized base to rebuild (and lasts long enough to be
        caught holding its lock).
    """

    servers: int = 3
    requests: int = 300
    distinct: int = 100
    concurrency: int = 6
    max_tokens: int = 24
    replay_max_tokens: int = 96
    kills: int = 2
    kill_in_compaction: bool = True
    compact_tokens: int = 2048
    timeout: float = 1800.0
    seed_tokens: int = 200_000
    latency: bool = True


class Fleet:
    """``n`` replicas on corpus directories ``dirs[i]`` (one shared path, or one each); logs under ``work``."""

    def __init__(self, model: str | None, work: Path, dirs: list[Path], extra: tuple[str, ...], threads: int | None,
                 name: str = "fleet"):
        self.model, self.work, self.dirs, self.extra, self.threads = model, work, dirs, extra, threads
        self.name = name
        self.procs: list[ServerProcess | None] = [None] * len(dirs)
        self.bases: list[str] = [""] * len(dirs)
        self.starts = 0
        self.lock = threading.Lock()  # one restart at a time
        for i in range(len(dirs)):
            self.procs[i] = self._spawn(i)
        for i in range(len(dirs)):
            self.bases[i] = self._proc(i).wait_ready()

    def _spawn(self, i: int) -> ServerProcess:
        self.starts += 1
        return ServerProcess(self.model, self.work / f"{self.name}-{self.starts}-replica{i}.log", "--corpus-dir",
                             str(self.dirs[i]), "--no-answer-cache", *self.extra, threads=self.threads)

    def _proc(self, i: int) -> ServerProcess:
        p = self.procs[i]
        assert p is not None
        return p

    def restart(self, i: int) -> None:
        """``kill -9`` replica ``i`` and start it again on the same directory (a new writer)."""
        with self.lock:
            self._proc(i).kill()
            self.bases[i] = ""
            self.procs[i] = self._spawn(i)
            self.bases[i] = self._proc(i).wait_ready()

    def pids(self) -> dict[int, int]:
        """pid -> replica index, of the replicas that are up (not starting)."""
        return {self._proc(i).proc.pid: i for i in range(len(self.procs)) if self.bases[i]}

    def ready_base(self, n: int) -> str:
        """The URL of replica ``n`` mod replicas, waiting while it restarts."""
        while not self.bases[n % len(self.bases)]:
            time.sleep(0.05)
        return self.bases[n % len(self.bases)]

    def stop(self) -> None:
        for p in self.procs:
            if p is not None:
                p.stop()


def complete(client, base: str, prompt: list[int], max_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy completions request with token-id ``prompt``: its JSON body plus ``seconds`` (client side)."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/completions", timeout=timeout,
                    json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return {**r.json(), "seconds": time.perf_counter() - t0}


def prompts_of(base: str, questions: list[str]) -> list[list[int]]:
    """Token ids of each question, from a replica's ``/tokenize`` (no special tokens)."""
    import httpx

    return [httpx.post(f"{base}/tokenize", json={"prompt": q, "add_special_tokens": False}, timeout=60).json()["tokens"]
            for q in questions]


def replay_across(fleet: Fleet, prompt: list[int], max_tokens: int, within: float = 2.0) -> dict:
    """Replica 0 answers ``prompt``; replica 1 is asked it one follow interval later, then every 0.1 s until it
    replays it (forwards <= 2). Asked sooner, replica 1 starts decoding before it has read the answer, picks it up
    at its next follow and finishes in two forwards (a draft-free one, then the verify of the rest)."""
    import httpx

    from redraft.corpus.online import FOLLOW_SECONDS

    with httpx.Client() as c:
        first = complete(c, fleet.bases[0], prompt, max_tokens)
        done = time.monotonic()
        time.sleep(FOLLOW_SECONDS + 0.05)
        while True:
            again = complete(c, fleet.bases[1], prompt, max_tokens)
            if again["redraft"]["forwards"] <= 2 or time.monotonic() - done > within:
                break
            time.sleep(0.1)
    a, b = first["redraft"], again["redraft"]
    return {"first_forwards": a["forwards"], "first_generation_seconds": a["generation_seconds"],
            "replay_forwards": b["forwards"], "replay_generation_seconds": b["generation_seconds"],
            "replay_delay_seconds": round(time.monotonic() - done, 3),
            "generation_speedup": a["generation_seconds"] / max(b["generation_seconds"], 1e-9),
            "replay_identical": first["choices"][0]["text"] == again["choices"][0]["text"],
            "replayed": b["forwards"] <= 2}


SETTLE_SECONDS = 0.5  # between the first answers and their repeats: over twice the replicas' follow interval


def load(fleet: Fleet, prompts: list[list[int]], cfg: FleetBenchConfig, kills: int = 0,
         kill_in_compaction: bool = False, seed: int = 0) -> dict:
    """The mixed load: every distinct prompt once (killing a replica ``kills`` times on the way), then, after
    SETTLE_SECONDS, their repeats shuffled; with ``kill_in_compaction`` a watcher kills the first replica seen
    holding the compaction lock. Failed requests are sent again at the end (to the next replica). Returns
    latencies, errors, the completed answers and what the kills did.

    Repeats wait for the settle time because learn-once across writers holds beyond the follow delay: a repeat
    answered by another replica within it may be stored a second time (docs/serving.md)."""
    import httpx

    rng = random.Random(seed)
    repeats = [i for i in range(len(prompts)) for _ in range(max(0, cfg.requests // len(prompts) - 1))]
    rng.shuffle(repeats)
    order = (list(range(len(prompts))) + repeats)[:cfg.requests]
    deadline = time.monotonic() + cfg.timeout
    done: list[tuple[int, dict]] = []
    stop = threading.Event()
    caught = threading.Event()
    watcher = threading.Thread(target=_kill_while_compacting, args=(fleet, stop, caught, deadline), daemon=True)
    if kill_in_compaction:
        watcher.start()
    first = min(len(prompts), len(order))
    retried = 0
    for part, k in ((list(enumerate(order[:first])), kills), (list(enumerate(order[first:], start=first)), 0)):
        failed: list[tuple[int, int]] = []
        _run(fleet, part, prompts, cfg, deadline, done, failed, k)
        with httpx.Client() as c:  # the failed ones again, one at a time, on the next replicas that are up
            for n, i in failed:
                for step in range(1, 2 * len(fleet.bases) + 1):
                    try:
                        done.append((i, complete(c, fleet.ready_base(n + step), prompts[i], cfg.max_tokens)))
                        break
                    except (httpx.HTTPError, ValueError):
                        time.sleep(0.2)  # that replica is being killed: the next one
        retried += len(failed)
        time.sleep(SETTLE_SECONDS)
    stop.set()
    if kill_in_compaction:
        watcher.join()
    lat = sorted(b["seconds"] for _, b in done)
    return {"sent": len(order), "completed": len(done), "first_try_failures": retried, "kills": kills,
            "killed_in_compaction": caught.is_set(),
            "latency_p50": percentile(lat, 50), "latency_p95": percentile(lat, 95), "answers": done}


def _run(fleet: Fleet, jobs: list[tuple[int, int]], prompts: list[list[int]], cfg: FleetBenchConfig,
         deadline: float, done: list, failed: list, kills: int) -> None:
    """Send ``jobs`` ((request number, prompt index); replica = number mod replicas) from ``cfg.concurrency``
    clients, killing and restarting a replica each time another 1/(kills+1) of them completed."""
    import httpx

    lock, todo, start = threading.Lock(), list(jobs), len(done)

    def client():
        with httpx.Client() as c:
            while time.monotonic() < deadline:
                with lock:
                    if not todo:
                        return
                    n, i = todo.pop(0)
                base = fleet.bases[n % len(fleet.bases)]
                try:
                    if not base:
                        raise httpx.ConnectError("replica restarting")
                    body = complete(c, base, prompts[i], cfg.max_tokens, timeout=max(1.0, deadline - time.monotonic()))
                    with lock:
                        done.append((i, body))
                except (httpx.HTTPError, ValueError):
                    with lock:
                        failed.append((n, i))

    threads = [threading.Thread(target=client) for _ in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for k in range(kills):  # kill -9 while requests run (their answers being learned)
        while time.monotonic() < deadline and len(done) - start < (k + 1) * len(jobs) // (kills + 1) and \
                any(t.is_alive() for t in threads):
            time.sleep(0.002)
        fleet.restart(k % len(fleet.bases))
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 30)


def _kill_while_compacting(fleet: Fleet, stop: threading.Event, caught: threading.Event, deadline: float) -> None:
    """Poll every replica's tenant directory for a compaction lock held by a replica; kill -9 it then (once)."""
    from redraft.corpus.lease import CompactionLock

    locks = [CompactionLock(Path(d) / "default", "watcher") for d in set(fleet.dirs)]
    while time.monotonic() < deadline and not stop.is_set():
        pids = fleet.pids()
        for lock in locks:
            holder = lock.holder() or {}
            if holder.get("pid") in pids and not fleet.lock.locked():
                fleet.restart(pids[holder["pid"]])
                caught.set()
                return
        time.sleep(0.001)


def answers_by_prompt(d: Path, prompts: list[list[int]], decode: Callable) -> tuple[dict[int, set[str]], Counter,
                                                                                   int, int]:
    """Over every journal and the base of tenant directory ``d``: (prompt index -> decoded stored answers, prompt
    index -> spans stored, problems read, spans in all). A span's prompt is the one of ``prompts`` it begins with."""
    from redraft.corpus.directory import read_directory

    corpus, problems = read_directory(d)
    by_prompt: Counter = Counter()
    texts: dict[int, set[str]] = {}
    index = {tuple(p): i for i, p in enumerate(prompts)}
    for span in corpus.span_list():
        ids = span.tolist()
        for n in range(1, len(ids)):  # the prompt is the longest known prefix
            i = index.get(tuple(ids[:n]))
            if i is not None and len(prompts[i]) == n:
                by_prompt[i] += 1
                texts.setdefault(i, set()).add(decode(ids[n:]))
    return texts, by_prompt, len(problems), corpus.n_spans


def check_directory(d: Path, answers: list[tuple[int, dict]], prompts: list[list[int]], decode: Callable) -> dict:
    """Read every journal and the base of ``d``: completed answers missing from it (by prompt and text), and prompts
    whose span is stored more than once."""
    texts, by_prompt, problems, n_spans = answers_by_prompt(d, prompts, decode)
    lost = sum(1 for i, body in answers if body["choices"][0]["text"] not in texts.get(i, set()))
    return {"stored_spans": n_spans, "lost_completed": lost,
            "stored_twice": sum(1 for c in by_prompt.values() if c > 1), "problems": problems}


def seed_base(d: Path, prompts: list[list[int]], tokens: int, span: int = 200) -> None:
    """Fold ``tokens`` ids of random spans (ids uniform below the prompts' largest) into tenant directory ``d``'s
    base: matches in it are as short as in unrelated text, so it costs lookups what a big corpus costs."""
    import numpy as np

    from redraft.corpus.compaction import fold
    from redraft.corpus.lease import writer_id
    from redraft.corpus.online import OnlineCorpus

    if tokens <= 0:
        return
    top = max(max(p) for p in prompts if p)
    rng = np.random.default_rng(7)
    oc = OnlineCorpus(d, follow_seconds=None, sync=False, compact_tokens=1 << 62)
    for _ in range(max(1, tokens // span)):
        oc.append(rng.integers(0, top + 1, span))
    oc.close()
    fold(str(d), writer_id(), lambda spans: (spans, 0))


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (0.0 when empty)."""
    import numpy as np

    return float(np.percentile(values, q)) if values else 0.0


def run_fleet_phase(model: str | None, work: Path, cfg: FleetBenchConfig, questions: list[str],
                    threads: int | None = None, decode: Callable | None = None) -> dict:
    """The whole phase (module docstring). ``questions``: at least ``cfg.distinct + 1`` prompts' text; ``decode``:
    ids -> text as the server decodes its answers (default: the model's tokenizer)."""
    if decode is None:
        from transformers import AutoTokenizer

        from redraft.io.loading import resolve_model_dir

        tok = AutoTokenizer.from_pretrained(resolve_model_dir(model, quiet=True)[1])
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    extra = ("--compact-tokens", str(cfg.compact_tokens))
    out: dict = {"servers": cfg.servers}
    shared = work / "fleet-shared"
    fleet = Fleet(model, work, [shared], extra, threads, name="fleet-tokenize")  # one replica: /tokenize
    try:
        prompts = prompts_of(fleet.bases[0], questions[:cfg.distinct + 1])
    except BaseException:
        fleet.stop()
        raise
    fleet.stop()
    seed_base(shared / "default", prompts, cfg.seed_tokens)
    fleet = Fleet(model, work, [shared] * cfg.servers, extra, threads, name="fleet-kills")
    try:
        out.update(replay_across(fleet, prompts[-1], cfg.replay_max_tokens))
        res = load(fleet, prompts[:cfg.distinct], cfg, kills=cfg.kills, kill_in_compaction=cfg.kill_in_compaction)
    finally:
        fleet.stop()
    out.update({k: v for k, v in res.items() if k != "answers"})
    out.update(check_directory(shared / "default", res["answers"], prompts, decode))
    out["ok"] = bool(out["replayed"] and out["replay_identical"] and out["lost_completed"] == 0
                     and out["stored_twice"] == 0)
    if not cfg.latency:
        return out
    for name, dirs in (("shared", [work / "fleet-latency-shared"] * cfg.servers),
                       ("separate", [work / f"fleet-latency-{i}" for i in range(cfg.servers)])):
        fleet = Fleet(model, work, dirs, extra, threads, name=f"fleet-latency-{name}")
        try:
            r = load(fleet, prompts[:cfg.distinct], cfg, seed=1)
        finally:
            fleet.stop()
        out[f"{name}_latency_p50"], out[f"{name}_latency_p95"] = r["latency_p50"], r["latency_p95"]
    out["p95_shared_over_separate"] = out["shared_latency_p95"] / max(out["separate_latency_p95"], 1e-9)
    return out


__all__ = ["Fleet", "FleetBenchConfig", "check_directory", "load", "replay_across", "run_fleet_phase"]
