"""A mixed fleet under load, with kills: a ``redraft serve`` replica and a vLLM engine with redraft's proposer
learning into one corpus directory while mixed requests run, the vLLM engine killed with ``kill -9`` twice while it
generates (its answers being learned) and a member killed once while it holds the compaction lock
(``make vllm-fleet-load``).

Run in redraft's environment (``python benchmarks/vllm/vllm_fleet_load.py --model DIR --vllm-python
../vllm-venv/bin/python``); the vLLM engine runs in a child process of vLLM's environment (``--vllm-python``) that
reads batches of prompts on stdin and writes each finished request on stdout, so that it can be killed and started
again (a new writer on the same directory). Requests: every distinct question once (phase 1, during which the kills
happen), then repeats after a settle time (phase 2), alternating between the members, ``--requests`` in all. A
request cut by a kill is sent again to the restarted member.

Then a checker reads every journal and the base (:func:`redraft.bench.fleet_bench.answers_by_prompt`): every
completed answer must be stored and no question's answer stored twice. vLLM does not pass a request's max_tokens to
a proposer: an answer it cut at max_tokens (not at EOS) is learned once it has left the batch for 64 steps or at
shutdown, so a kill before that loses it; such answers are counted apart (``vllm_length_cut_lost``) and do not fail
the check. The questions ask for short answers so that most end at EOS.

Exit status: 0 nothing completed was lost (apart from the above) and nothing stored twice; 1 otherwise; 2 a member
could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SHORT_QUESTIONS = [f"What is {a} plus {b}? Reply with the number only." for a in range(2, 9) for b in range(3, 9)]
BATCH = 4  # prompts per vLLM generate call
KILL_DELAY_S = 0.2  # into a batch's generation, when a kill during learning lands
SETTLE_SECONDS = 2.0  # between phase 1 and its repeats: well over both members' follow interval


MARK = "@@redraft "  # the protocol's lines on the child's stdout (anything else there is vLLM's and skipped)


class WorkerDied(RuntimeError):
    """The vLLM child process ended (killed) before answering its batch."""


class VllmWorker:
    """The vLLM child process: ``run(batch)`` sends prompts, returns one dict per request (``ids``, ``finish``)."""

    def __init__(self, python: str, model: str, corpus_dir: Path, log: Path, k: int) -> None:
        self.python, self.model, self.corpus_dir, self.log, self.k = python, model, corpus_dir, log, k
        self.starts = 0
        self.proc: subprocess.Popen | None = None
        self.ready = False  # started and answering (a watcher kills it only then)

    def start(self) -> None:
        """Start the child and wait for its ready line. Raises RuntimeError: it ended or did not get ready."""
        from vllm_check import CPU_DEFAULTS  # benchmarks/vllm/vllm_check.py, beside this

        env = dict(os.environ, REDRAFT_LEARN_CORPUS=str(self.corpus_dir),
                   PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        for key, v in CPU_DEFAULTS.items():
            env.setdefault(key, v)
        self.starts += 1
        self.ready = False
        logf = open(self.log.with_suffix(f".{self.starts}.log"), "w")  # noqa: SIM115 - the child's stderr
        self.proc = subprocess.Popen([self.python, str(Path(__file__).resolve()), "--worker",
                                      "--model", self.model, "--k", str(self.k)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=logf, text=True, env=env)
        try:
            ready = self._read()
        except WorkerDied:
            ready = {}
        if "ready" not in ready:
            raise RuntimeError(f"the vLLM worker did not start (see {logf.name})")
        self.ready = True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def run(self, batch: list[dict]) -> list[dict]:
        """Generate ``batch`` ([{"n", "prompt", "max_tokens"}]); raises WorkerDied when the child ends first."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(batch) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(str(e)) from None
        return [self._read() for _ in batch]

    def _read(self) -> dict:
        """The child's next protocol line; raises WorkerDied at the end of its output."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise WorkerDied("the vLLM worker ended")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def kill(self) -> None:
        """``kill -9`` the child and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Close its stdin (it shuts vLLM down, learning what it still holds) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()


def _fire(fired: threading.Event, worker: VllmWorker) -> None:
    fired.set()
    worker.kill()


def worker_main(args) -> int:
    """The child: a vLLM engine with redraft's proposer; one JSON batch per stdin line, one JSON line per request."""
    from vllm import LLM, SamplingParams
    from vllm_check import PROPOSER  # benchmarks/vllm/vllm_check.py, beside this

    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=BATCH, enforce_eager=True,
              speculative_config=spec, seed=0)
    print(MARK + json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        batch = json.loads(line)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": r["prompt"]} for r in batch],
                           SamplingParams(temperature=0.0, max_tokens=batch[0]["max_tokens"]), use_tqdm=False)
        seconds = time.perf_counter() - t0
        for r, got in zip(batch, res, strict=True):
            o = got.outputs[0]
            print(MARK + json.dumps({"n": r["n"], "ids": list(o.token_ids), "finish": o.finish_reason,
                                     "seconds": seconds}), flush=True)
    del llm  # shutdown: the proposer learns what it still holds
    return 0


def split_lost(answers: list[tuple[int, dict]], stored: dict[int, set[str]]) -> dict:
    """Completed answers whose text is not among the stored answers of their question (``stored``: question index ->
    decoded answers), split into those that count (``lost``) and vLLM's answers cut by length (learned late, see the
    module doc: ``vllm_length_cut_lost``). Each answer: (question index, {"text", "member", "finish"})."""
    lost = late = 0
    for i, a in answers:
        if a["text"] in stored.get(i, set()):
            continue
        if a["member"] == "vllm" and a["finish"] == "length":
            late += 1
        else:
            lost += 1
    return {"lost_completed": lost, "vllm_length_cut_lost": late}


def run(args) -> int:
    import httpx
    from transformers import AutoTokenizer

    from redraft.bench.fleet_bench import Fleet, answers_by_prompt, complete, percentile
    from redraft.corpus.lease import CompactionLock
    from redraft.io.prompts import encode_prompt

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    d = work / "corpus"
    tok = AutoTokenizer.from_pretrained(args.model)
    questions = SHORT_QUESTIONS[:args.distinct]
    prompts = [encode_prompt(tok, q) for q in questions]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    fleet = Fleet(args.model, work, [d], ("--compact-tokens", str(args.compact_tokens), "--quiet"), threads=1,
                  name="server")
    worker = VllmWorker(args.vllm_python, args.model, d, work / "vllm", args.k)
    try:
        worker.start()
    except RuntimeError as e:
        fleet.stop()
        print(f"vllm-fleet-load: {e}", file=sys.stderr)
        return 2
    repeats = [i % len(prompts) for i in range(args.requests - len(prompts))]
    import random

    random.Random(0).shuffle(repeats)
    order = (list(range(len(prompts))) + repeats)[:args.requests]
    answers: list[tuple[int, dict]] = []
    latencies: dict[str, list[float]] = {"server": [], "vllm": []}
    lock = threading.Lock()
    kills = {"learning": 0, "compaction": ""}
    stop = threading.Event()

    def server_client(jobs: queue.Queue) -> None:
        with httpx.Client() as c:
            while True:
                try:
                    n, i = jobs.get_nowait()
                except queue.Empty:
                    return
                for _ in range(20):
                    try:
                        body = complete(c, fleet.ready_base(0), prompts[i], args.max_tokens)
                        break
                    except (httpx.HTTPError, ValueError):
                        time.sleep(0.5)  # being killed or restarting
                else:
                    raise RuntimeError(f"the server never answered request {n}")
                ch = body["choices"][0]
                with lock:
                    answers.append((i, {"text": ch["text"], "member": "server", "finish": ch["finish_reason"]}))
                    latencies["server"].append(body["seconds"])

    def vllm_client(jobs: list[tuple[int, int]], kill_after: list[int]) -> None:
        done = 0
        while jobs:
            batch = [{"n": n, "i": i, "prompt": prompts[i], "max_tokens": args.max_tokens} for n, i in jobs[:BATCH]]
            t0 = time.perf_counter()
            fired = threading.Event()
            killer = None
            if kill_after and done >= kill_after[0]:  # kill -9 while this batch generates
                kill_after.pop(0)
                killer = threading.Timer(KILL_DELAY_S, _fire, args=(fired, worker))
                killer.start()
            try:
                got = worker.run(batch)
            except WorkerDied:
                if killer is not None:
                    killer.join()
                kills["learning"] += fired.is_set()
                worker.kill()
                worker.start()
                continue
            if killer is not None:
                killer.cancel()
                killer.join()
                if not fired.is_set():  # the batch ended first: kill during the next one
                    kill_after.insert(0, done)
            seconds = time.perf_counter() - t0
            for r, g in zip(batch, got, strict=True):
                with lock:
                    answers.append((r["i"], {"text": decode(g["ids"]), "member": "vllm", "finish": g["finish"]}))
                    latencies["vllm"].append(seconds)
            del jobs[:len(batch)]
            done += len(batch)

    def watch_compaction() -> None:
        holder_lock = CompactionLock(d / "default", "watcher")
        while not stop.is_set():
            holder = holder_lock.holder() or {}
            pid = holder.get("pid")
            if pid is not None and worker.ready and pid == worker.pid:
                worker.kill()  # the vLLM client restarts it
                kills["compaction"] = "vllm"
                return
            srv = fleet.pids()
            if pid is not None and pid in srv and not fleet.lock.locked():
                fleet.restart(0)
                kills["compaction"] = "server"
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=watch_compaction, daemon=True)
    watcher.start()
    t_start = time.perf_counter()
    first = len(prompts)
    for phase, part in enumerate((list(enumerate(order[:first])), list(enumerate(order[first:], start=first)))):
        sq: queue.Queue = queue.Queue()
        vjobs: list[tuple[int, int]] = []
        for n, i in part:
            (vjobs.append((n, i)) if n % 2 else sq.put((n, i)))
        kill_after = [len(vjobs) // 3, 2 * len(vjobs) // 3] if phase == 0 else []
        threads = [threading.Thread(target=server_client, args=(sq,)) for _ in range(2)]
        threads.append(threading.Thread(target=vllm_client, args=(vjobs, kill_after)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(SETTLE_SECONDS)
    stop.set()
    worker.stop()
    fleet.stop()
    texts, counts, problems, _ = answers_by_prompt(d / "default", prompts, decode)
    out = {"requests": len(order), "completed": len(answers), "distinct": len(prompts),
           "kills_during_learning": kills["learning"], "killed_in_compaction": kills["compaction"] or None,
           "vllm_starts": worker.starts, "server_starts": fleet.starts, **split_lost(answers, texts),
           "stored_twice": sum(1 for c in counts.values() if c > 1), "problems": problems,
           "vllm_length_cut": sum(1 for _, a in answers if a["member"] == "vllm" and a["finish"] == "length"),
           "seconds": round(time.perf_counter() - t_start, 1)}
    for m, lat in latencies.items():
        out[f"{m}_latency_p50"], out[f"{m}_latency_p95"] = round(percentile(lat, 50), 3), round(percentile(lat, 95), 3)
    print(json.dumps(out, indent=1))
    (work / "result.json").write_text(json.dumps(out, indent=1))
    ok = out["completed"] == out["requests"] and out["lost_completed"] == 0 and out["stored_twice"] == 0 \
        and out["problems"] == 0
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vllm_fleet_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (redraft's converted default)")
    p.add_argument("--vllm-python", help="python of vLLM's environment (runs the vLLM engine)")
    p.add_argument("--requests", type=int, default=300, help="requests in all (default 300)")
    p.add_argument("--distinct", type=int, default=30, help=f"distinct questions, at most {len(SHORT_QUESTIONS)} "
                                                           "(default 30)")
    p.add_argument("--max-tokens", type=int, default=24, help="max new tokens per request (default 24)")
    p.add_argument("--k", type=int, default=16, help="num_speculative_tokens of the vLLM proposer (default 16)")
    p.add_argument("--compact-tokens", type=int, default=512, help="the server's --compact-tokens (default 512)")
    p.add_argument("--workdir", default=None, help="keep the corpus, logs and result.json here (default: a new "
                                                   "temporary directory)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not args.vllm_python:
        p.error("--vllm-python is required")
    if not 1 <= args.distinct <= len(SHORT_QUESTIONS) or args.requests < args.distinct:
        p.error(f"--distinct must be 1..{len(SHORT_QUESTIONS)} and --requests at least --distinct")
    if args.workdir is None:
        import tempfile

        args.workdir = tempfile.mkdtemp(prefix="redraft-vllm-fleet-load-")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
