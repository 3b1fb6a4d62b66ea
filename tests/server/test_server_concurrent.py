"""``redraft serve`` with several requests generating at once: exact outputs, KV admission, 429, cancellation,
tenant isolation, concurrent corpus learning.

A live server on 127.0.0.1 (tiny saved model, word-level tokenizer). Requests are sent together from threads; the
model's forward is slowed a little where a test needs requests to overlap, and records how many ran at once.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import plain_greedy
from serverkit import EOS, live_server, serve_args

from redraft.bench.serve_bench import metric_value
from redraft.server.admission import (
    MIN_RETRY_AFTER_S,
    KVBudget,
    default_kv_tokens,
    kv_bytes_per_token,
    retry_after,
)
from redraft.server.prefix_cache import PrefixCache
from redraft.server.scheduler import Job, Scheduler

PROMPTS = [[10, 11, 12, 13], [3, 4, 5], [50, 40, 30, 20, 10], [7, 8, 9], [20, 21, 22, 23, 20, 21], [33, 34],
           [44, 45, 46], [15, 25, 35]]
KEYS = {"ka": "alice", "kb": "bob", "kc": "carol"}
LONG = [15, 25, 35]  # its greedy answer runs past 600 tokens without EOS


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def greedy_text(loaded, prompt, n) -> str:
    """Plain greedy decoding's answer as the server writes it (special tokens, EOS and unk, left out)."""
    return loaded.tokenizer.decode(plain_greedy(loaded.model, prompt, n, eos=[EOS]), skip_special_tokens=True)


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(srv, name: str, **labels) -> float:
    return metric_value(httpx.get(f"{srv.base}/metrics", timeout=10).text, name, **labels)


class Overlap:
    """Slows the model's forward by ``delay`` seconds (and holds it while ``gate`` is clear, except for the ``free``
    next forwards) and records the most requests running at once."""

    def __init__(self, srv, monkeypatch, delay: float = 0.01) -> None:
        self.most, self.free = 0, 0
        self.gate = threading.Event()
        self.gate.set()
        lock = threading.Lock()
        sched, model = srv.server.scheduler, srv.server.generator.model
        inner = model.forward

        def forward(*a, **kw):
            self.most = max(self.most, sched.running)
            with lock:
                free = self.free > 0
                self.free -= free
            if not free:
                self.gate.wait(30)
            time.sleep(delay)
            return inner(*a, **kw)

        monkeypatch.setattr(model, "forward", forward)


def complete(srv, key: str, prompt, n: int, **extra) -> httpx.Response:
    return httpx.post(f"{srv.url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": srv.server.model_id, "prompt": prompt, "max_tokens": n, **extra})


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(KEYS))
    return path


@pytest.fixture(scope="module")
def live(model_dir, loaded, tenants_file):
    """Three tenants, four requests at once, the policy and n-gram drafts, a prefix cache."""
    with live_server(serve_args(model_dir, "--tenants", str(tenants_file), "--max-running", "4",
                                "--prefix-cache-tokens", "4000"), loaded) as srv:
        yield srv


def wait_idle(srv, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.server.scheduler.running == 0 and srv.server.scheduler.waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the server is still generating")


# ---- exactness and isolation under concurrency ----------------------------------------------------------------------

def test_concurrent_requests_of_several_tenants_equal_plain_greedy(live, loaded, monkeypatch):
    overlap = Overlap(live, monkeypatch)
    n = 40
    jobs = [(key, p) for p in PROMPTS for key in ("ka", "kb", "kc")][:16]
    for rnd in range(2):  # the second round drafts from what the first learned (corpus, prefix cache)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda kp: complete(live, kp[0], kp[1], n), jobs))
        for (key, prompt), r in zip(jobs, answers, strict=True):
            assert text(r) == greedy_text(loaded, prompt, n), (rnd, key, prompt)
    assert overlap.most > 1  # they did run side by side
    assert overlap.most <= 4  # never more than --max-running
    assert any(len(step) > 1 for step in live.server.generator.batcher.step_log)  # in shared forwards
    assert 0 < metric(live, "redraft:batch_steps_total") < metric(live, "redraft:batch_rows_total")


def test_tenants_prefix_caches_and_policies_never_serve_another_tenant(live, loaded):
    wait_idle(live)
    prompt = [60, 61, 62, 63, 60, 61, 62, 63, 60, 61]
    r = complete(live, "ka", prompt, 30)
    assert r.json()["redraft"]["prefix_hit_tokens"] == 0
    again = [prompt + ids_of(text(r)) + [5]]
    cache = live.server.generator.prefix_cache
    entry = next(e for (t, ids), e in cache.entries.items() if t == "alice" and list(ids[:len(prompt)]) == prompt)
    kept = [(k.clone(), v.clone()) for k, v in entry.kv]
    # alice's conversation continues while bob and carol send the same continuation at the same moment
    with ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda k: complete(live, k, again[0], 20), ["ka", "kb", "kc"]))
    # the entry seeded alice's batched sequence by reference: nothing wrote into it
    assert all(k.equal(k0) and v.equal(v0) for (k, v), (k0, v0) in zip(entry.kv, kept, strict=True))
    hits = {k: x.json()["redraft"]["prefix_hit_tokens"] for k, x in zip(["ka", "kb", "kc"], rs, strict=True)}
    assert hits["ka"] > 0 and hits["kb"] == 0 and hits["kc"] == 0  # the cache hit is alice's alone
    assert {text(x) for x in rs} == {greedy_text(loaded, again[0], 20)}
    gen = live.server.generator
    trackers = [gen.policies[t].tracker for t in ("alice", "bob", "carol")]
    assert len({id(t) for t in trackers}) == 3  # one learned acceptance per tenant
    mine = gen.request_policy("alice")  # a request's own load-aware policy, learning into its tenant's tracker
    assert mine is not gen.policies["alice"] and mine.tracker is trackers[0] and hasattr(mine, "at_load")
    spans = {t: [s.tolist() for s in gen.corpora.get(t).corpus.span_list()] for t in ("alice", "bob")}
    def first_turn(span):  # alice's first request (prompt + answer), not the continuation everyone sent
        return span[:len(prompt)] == prompt and span[:len(again[0])] != again[0]

    assert any(first_turn(s) for s in spans["alice"])  # learned by alice ...
    assert not any(first_turn(s) for s in spans["bob"])  # ... alone


def test_cancelled_stream_frees_its_kv_and_the_others_go_on(live, loaded, monkeypatch):
    Overlap(live, monkeypatch, delay=0.02)  # every step slowed: the streams overlap
    wait_idle(live)
    aborted = metric(live, "vllm:request_success_total", finished_reason="abort")
    before = metric(live, "redraft:kv_tokens_used")
    long_n, other_prompt, other_n = 600, [44, 45, 46], 60
    result = {}

    def other():
        result["r"] = complete(live, "kb", other_prompt, other_n)

    body = {"model": live.server.model_id, "prompt": LONG, "max_tokens": long_n, "stream": True}
    t = threading.Thread(target=other)
    with httpx.stream("POST", f"{live.url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer ka"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping a half-read iterator closes the connection
        line = next(x for x in lines if x.startswith("data: "))
        assert '"text"' in line, line  # the stream is running
        t.start()
        deadline = time.monotonic() + 20
        while live.server.scheduler.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = metric(live, "redraft:kv_tokens_used")
        state = (live.server.scheduler.running, live.server.generator.budget.reserved, before, busy)
        assert busy >= before + len(LONG) + long_n + len(other_prompt) + other_n, state  # both reservations count
        lines.close()
    # the server notices the hang-up at its next chunk (each step is slowed, and the long answer runs 600 steps);
    # the stream stops at its next step and its reservation goes at once; the other request goes on
    deadline = time.monotonic() + 20
    while metric(live, "redraft:kv_tokens_used") > busy - (len(LONG) + long_n) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(live, "redraft:kv_tokens_used") <= busy - (len(LONG) + long_n)
    t.join(60)
    assert text(result["r"]) == greedy_text(loaded, other_prompt, other_n)
    wait_idle(live)
    assert metric(live, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(live, "vllm:num_requests_running") == 0
    assert metric(live, "redraft:kv_tokens_capacity") == live.server.generator.budget.capacity


# ---- admission: KV budget, 429, one at a time -----------------------------------------------------------------------

def test_kv_budget_admits_what_fits_and_refuses_what_never_can(model_dir, loaded, monkeypatch):
    with live_server(serve_args(model_dir, "--max-running", "4", "--kv-tokens", "100",
                                "--prefix-cache-tokens", "0"), loaded) as srv:
        r = complete(srv, "x", [3, 4, 5], 98)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV capacity of 100" in r.json()["error"]["message"]
        r = complete(srv, "x", [3] * 100, 5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(f"{srv.url}/chat/completions", timeout=60, json={
            "model": srv.server.model_id, "messages": [{"role": "user", "content": "t03 t04"}]})
        assert r.status_code == 200  # no max_tokens: capped at what the KV budget leaves after the prompt
        # 60-token reservations: only one fits in 100 at a time, although four threads are free
        overlap = Overlap(srv, monkeypatch, delay=0.005)
        with ThreadPoolExecutor(3) as pool:
            rs = list(pool.map(lambda p: complete(srv, "x", p, 57), PROMPTS[:3]))
        for p, r in zip(PROMPTS[:3], rs, strict=True):
            assert text(r) == greedy_text(loaded, p, 57)
        assert overlap.most == 1


def test_max_running_1_is_one_at_a_time_and_a_full_queue_is_429(model_dir, loaded, monkeypatch):
    with live_server(serve_args(model_dir, "--max-running", "1", "--max-queue", "1"), loaded) as srv:
        assert srv.server.generator.batcher is None  # one at a time: no batching
        overlap = Overlap(srv, monkeypatch, delay=0.01)
        overlap.gate.clear()  # the first request holds the only thread until the queue is full
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, srv, "x", LONG, 100)
            deadline = time.monotonic() + 20
            while srv.server.scheduler.running < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            second = pool.submit(complete, srv, "x", [3, 4, 5], 20)
            while srv.server.scheduler.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = complete(srv, "x", [7, 8, 9], 5)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
            assert int(r.headers["retry-after"]) >= 1
            overlap.gate.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert overlap.most == 1
        assert text(second.result()) == greedy_text(loaded, [3, 4, 5], 20)


def test_serve_options_are_validated(model_dir):
    from redraft.cli import build_parser

    for flag in ("--max-running", "--max-batch-tokens", "--kv-tokens", "--max-queue"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--model", str(model_dir), flag, "0"])
    args = serve_args(model_dir)
    assert (args.max_running, args.max_batch_tokens, args.kv_tokens) == (None, None, None)
    from redraft.cli.serve import build_server, max_running_of

    assert max_running_of(args) == 16  # the transformers runtime's default (llama.cpp's is 1)

    # a flag that cannot act is refused before the model loads (build_server is never handed a model here)
    with pytest.raises(SystemExit, match="--max-batch-tokens 64: no effect with --max-running 1"):
        build_server(serve_args(model_dir, "--max-running", "1", "--max-batch-tokens", "64"))


# ---- units: the budget, the scheduler's admission, Retry-After, concurrent learning ---------------------------------

class _Entry:
    def __init__(self, ids):
        self.ids, self.kv = tuple(ids), ()

    @property
    def length(self):
        return len(self.ids)


def test_reservations_evict_prefix_entries_first():
    cache = PrefixCache(1000)
    budget = KVBudget(100, cache)
    cache.store("a", _Entry(range(40)), budget.prefix_room())
    cache.store("b", _Entry(range(50, 80)), budget.prefix_room())
    assert budget.used == 70
    assert budget.try_reserve(50)  # fits: the oldest entry (a's 40) is evicted to make room
    assert cache.tokens == 30 and budget.used == 80
    assert not budget.try_reserve(60) and budget.reserved == 50  # refused: nothing changes
    cache.store("a", _Entry(range(200, 260)), budget.prefix_room())  # 60 > the 50 left: not kept
    assert cache.tokens == 30
    cache.store("a", _Entry(range(300, 350)), budget.prefix_room(own=50))  # a finishing request's own KV counts free
    assert cache.tokens == 80  # within 100 once its reservation is released
    budget.release(50)
    assert budget.used <= budget.capacity and budget.reserved == 0
    assert not budget.fits_ever(101) and budget.fits_ever(100)
    with pytest.raises(ValueError):
        KVBudget(0)


def test_scheduler_admits_in_order_within_the_budget_and_threads():
    import asyncio

    loop = asyncio.new_event_loop()
    running, most, order = [0], [0], []
    lock = threading.Lock()
    gate = threading.Event()

    class Tick:  # a stand-in for a target forward: the scheduler runs it alone (no batcher)
        def run_alone(self):
            time.sleep(0.001)

    def runner(job, emit):  # a step function: each job runs until the gate opens, then 20 ms more
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.append(job.payload)
        end = None
        while end is None or time.monotonic() < end:
            if end is None and gate.is_set():
                end = time.monotonic() + 0.02
            yield Tick()
        with lock:
            running[0] -= 1
        return job.payload

    budget = KVBudget(10)
    s = Scheduler(runner, max_running=3, budget=budget)
    jobs = [Job(tenant="t", payload=p, loop=loop, kv_tokens=k) for p, k in [("a", 6), ("b", 6), ("c", 3), ("d", 1)]]
    for j in jobs:
        s.submit(j)
    s.start()
    time.sleep(0.3)
    assert order == ["a"] and budget.reserved == 6  # b (6) waits at the head; c and d may not jump it
    gate.set()
    deadline = time.monotonic() + 10
    while len(order) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    s.stop()
    loop.close()
    assert order == ["a", "b", "c", "d"] and most[0] <= 3 and budget.reserved == 0
    with pytest.raises(ValueError):
        Scheduler(runner, max_running=0)


def test_retry_after_is_the_first_expected_end():
    assert retry_after(None, [1.0]) == MIN_RETRY_AFTER_S and retry_after(5.0, []) == MIN_RETRY_AFTER_S
    assert retry_after(10.0, [2.0, 7.5]) == 3  # the request 7.5 s in ends first: ~2.5 s
    assert retry_after(40.0, [39.0, 45.0]) == 10  # overdue: a quarter of the mean more, not "now"
    assert retry_after(4.0, [9.0]) == MIN_RETRY_AFTER_S  # never under the minimum


def test_kv_sizes():
    from types import SimpleNamespace

    smol = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smol) == 46_080  # float32 SmolLM2-135M
    assert default_kv_tokens(8192) == 32_768 and default_kv_tokens(131_072) == 131_072
    gib = 2**30
    # room for every running request at the full context when memory allows ...
    assert default_kv_tokens(8192, max_running=16, bytes_per_token=46_080, memory_bytes=32 * gib) == 16 * 8192
    # ... within a quarter of the memory, room to grow included (8 GiB: 2 GiB / 1.25 / 46 KB = 37,282 tokens) ...
    assert default_kv_tokens(8192, max_running=16, bytes_per_token=46_080, memory_bytes=8 * gib) == 37_282
    # ... but never under the floor nor one context, and without a memory figure no bound
    assert default_kv_tokens(8192, max_running=16, bytes_per_token=46_080, memory_bytes=gib) == 32_768
    assert default_kv_tokens(65_536, max_running=4, bytes_per_token=10**6, memory_bytes=gib) == 65_536
    assert default_kv_tokens(8192, max_running=16) == 16 * 8192
    from redraft.cli.serve import full_context_note

    assert "holds 13 requests at the full 8,192-token context" in full_context_note(109_704, 8192, 16)
    assert full_context_note(16 * 8192, 8192, 16) == "" and full_context_note(1000, None, 16) == ""


def test_concurrent_learning_keeps_every_span(tmp_path):
    from redraft.server.corpora import TenantCorpora

    def open_corpora():
        return TenantCorpora(["t"], str(tmp_path), vocab_size=1000, fingerprint=None, cap_tokens=None, sync=False)

    corpora = open_corpora()
    spans = [[w, *range(100 + 10 * i, 110 + 10 * i)] for w in range(8) for i in range(20)]

    def learn(w):
        for s in spans[w * 20:(w + 1) * 20]:
            assert corpora.learn_span("t", s)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(learn, range(8)))
    held = {tuple(s.tolist()) for s in corpora.get("t").corpus.span_list()}
    corpora.close()
    reopened = open_corpora()
    again = {tuple(s.tolist()) for s in reopened.get("t").corpus.span_list()}
    reopened.close()
    assert held == again == {tuple(s) for s in spans}
