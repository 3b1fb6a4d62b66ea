"""Server parts without a model: the fair queue, tenants files, request parsing, replay detection, and the
``redraft serve`` refusals that come before any model load."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from redraft.corpus import Corpus
from redraft.server.scheduler import Cancelled, Job, QueueFull, Scheduler
from redraft.server.schemas import APIError, parse_request
from redraft.server.tenants import DEFAULT_TENANT, Tenants, TenantsError


def drain(loop: asyncio.AbstractEventLoop, job: Job, timeout: float = 10.0) -> list:
    """Events posted to a job until its last one (done / aborted / error)."""
    async def collect():
        out = []
        while True:
            kind, value = await asyncio.wait_for(job.events.get(), timeout)
            out.append((kind, value))
            if kind != "delta":
                return out
    return loop.run_until_complete(collect())


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


class Tick:
    """A stand-in for a target forward in a runner's step function: the scheduler runs it alone (no batcher)."""

    def run_alone(self):
        threading.Event().wait(0.001)


def make_job(loop, tenant, payload):
    async def make():  # the queue belongs to the loop it is created under
        return Job(tenant=tenant, payload=payload, loop=loop)
    return loop.run_until_complete(make())


def test_round_robin_across_tenants_fifo_within(loop):
    gate, order = threading.Event(), []

    def runner(job, emit):  # a step function: "hold" waits for the gate one step at a time
        while job.payload == "hold" and not gate.is_set():
            yield Tick()
        order.append(job.payload)
        emit(f"{job.payload}!")
        return job.payload

    s = Scheduler(runner)
    s.start()
    first = make_job(loop, "a", "hold")
    s.submit(first)
    for _ in range(1000):  # until the worker holds it (bounded)
        if s.current is first:
            break
        threading.Event().wait(0.01)
    jobs = [make_job(loop, t, p) for t, p in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"),
                                              ("b", "b2")]]
    for j in jobs:
        s.submit(j)
    assert s.waiting == 6
    gate.set()
    events = [drain(loop, j) for j in [first] + jobs]
    s.stop()
    assert order == ["hold", "a1", "b1", "c1", "a2", "b2", "a3"]
    assert events[1] == [("delta", "a1!"), ("done", "a1")]


class Prefill:  # a stand-in for a forward call of ``n`` rows
    def __init__(self, n):
        self.ids = [0] * n


class RecordingBatcher:  # packs nothing: records which sequences each step carried, then advances them all
    max_batch_tokens = 8
    chunks_prefill = True

    def __init__(self):
        self.steps = []

    def step(self, live):
        self.steps.append(len(live))
        threading.Event().wait(0.01)
        for seq in live:
            seq.advance(None)


@pytest.mark.parametrize("wait,chunks", [(0.5, True), (0.0, True), (0.5, False)])
def test_a_long_prompt_on_an_idle_server_waits_briefly_for_company(loop, wait, chunks):
    """A burst's first request with a prompt longer than one chunk does not run its whole prefill alone while the
    rest of the burst queues behind it: the loop waits (ARRIVAL_WAIT_S) for a second request, so they share steps.
    A batcher that never chunks a prefill (llama.cpp's) does not wait: the prompt runs whole either way."""
    def runner(job, emit):
        yield Prefill(job.payload)
        yield Prefill(1)
        return job.payload

    batcher = RecordingBatcher()
    batcher.chunks_prefill = chunks
    s = Scheduler(runner, max_running=4, batcher=batcher)
    s.ARRIVAL_WAIT_S = wait
    s.start()
    first, second = make_job(loop, "a", 20), make_job(loop, "a", 5)
    s.submit(first)
    threading.Event().wait(0.1)  # within the wait; without it the first request has run alone by then
    s.submit(second)
    assert [e[-1] for e in (drain(loop, first), drain(loop, second))] == [("done", 20), ("done", 5)]
    s.stop()
    assert (batcher.steps[0] == 2) == (wait > 0 and chunks), batcher.steps


def test_cancelled_failed_and_overflowing_jobs(loop):
    calls = []

    def runner(job, emit):
        yield Tick()
        calls.append(job.payload)
        if job.payload == "boom":
            raise RuntimeError("boom")
        if job.payload == "leave":
            raise Cancelled(3)
        return "ok"

    s = Scheduler(runner, max_queue=2)
    gone = make_job(loop, "t", "never")
    s.submit(gone)
    s.submit(make_job(loop, "t", "x"))
    with pytest.raises(QueueFull):
        s.submit(make_job(loop, "t", "y"))
    gone.cancel.set()  # its client left while it waited: its place frees at once, not when the queue reaches it
    assert s.waiting == 1
    s.submit(make_job(loop, "u", "y"))
    assert s.waiting == 2
    assert drain(loop, gone) == [("aborted", None)]
    s.start()
    s.max_queue = 10
    jobs = [make_job(loop, "t", p) for p in ("boom", "leave", "fine")]
    for j in jobs:
        s.submit(j)
    results = [drain(loop, j)[-1] for j in jobs]
    s.stop()
    assert results[0][0] == "error" and "boom" in str(results[0][1])
    assert results[1] == ("aborted", None) and results[2] == ("done", "ok")  # the worker lived on
    assert "never" not in calls


def test_tenants_file(tmp_path):
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"k1": "alice", "k2": "alice", "k3": "bob"}))
    t = Tenants.from_file(str(good))
    assert t.names == ["alice", "bob"] and not t.open
    assert t.resolve("Bearer k1") == "alice" and t.resolve("bearer k3") == "bob"
    assert t.resolve("Bearer nope") is None and t.resolve(None) is None and t.resolve("k1") is None
    assert Tenants().resolve(None) == DEFAULT_TENANT and Tenants().names == [DEFAULT_TENANT]
    for text, says in [("{", "not valid JSON"), ("[]", "JSON object"), ('{"k": 3}', "tenant name string"),
                       ('{"k": "../evil"}', "letters, digits")]:
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(TenantsError, match=says):
            Tenants.from_file(str(bad))
    with pytest.raises(TenantsError, match="cannot read"):
        Tenants.from_file(str(tmp_path / "missing.json"))


def test_request_defaults_and_no_op_fields():
    r = parse_request({"prompt": "hi", "n": 1, "frequency_penalty": 0.0, "logprobs": None, "user": "u"},
                      "completion")
    assert r.sampling.greedy and r.max_tokens is None and r.stop == [] and not r.stream
    r = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}],
                       "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "temperature": 0.5,
                       "top_k": -1, "stream": True, "stream_options": {"include_usage": True}}, "chat")
    assert r.messages == [{"role": "system", "content": "ab"}] and r.max_tokens == 7 and r.stop == ["x"]
    assert r.sampling.temperature == 0.5 and r.sampling.top_k == 0 and r.include_usage
    assert r.sampling.seed >= 0  # drawn, and reported so the sample can be replayed
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "hi", "best_of": 2}, "completion")
    assert e.value.status == 400 and e.value.param == "best_of"


def test_whole_number_floats_are_integers_and_booleans_are_not():
    r = parse_request({"prompt": "hi", "max_tokens": 4.0, "n": 2.0, "seed": 7.0, "logprobs": 1.0}, "completion")
    assert (r.max_tokens, r.n, r.sampling.seed, r.logprobs) == (4, 2, 7, 1) and type(r.max_tokens) is int
    for bad in (4.5, True, "4"):
        with pytest.raises(APIError) as e:
            parse_request({"prompt": "hi", "max_tokens": bad}, "completion")
        assert e.value.status == 400 and e.value.param == "max_tokens"


def test_several_prompts_logprobs_and_echo_parse():
    r = parse_request({"prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 0}, "completion")
    assert r.prompts == [[1, 2], [3]] and r.prompt == [1, 2] and r.max_tokens == 0 and r.echo and r.logprobs == 0
    r = parse_request({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "chat")
    assert r.logprobs == 0 and not r.echo
    r = parse_request({"messages": [{"role": "user", "content": "a"}], "logprobs": False, "top_logprobs": 0}, "chat")
    assert r.logprobs is None


def test_holds_is_contiguity_inside_one_span():
    prompt, out = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]
    c = Corpus.from_spans([prompt + out, [40, 41]])
    assert c.holds(prompt + out) and c.holds(prompt + out[:3]) and c.holds(out[2:]) and c.holds([11])
    assert not c.holds(prompt + out[:3] + [99]) and not c.holds(out + [40])  # never across a separator
    assert not c.holds([0, 1, 2]) and not c.holds([70000]) and not Corpus.from_spans([]).holds(prompt)
    c.append([1, 2, 3, 4, 9])  # an appended segment is searched too
    assert c.holds([3, 4, 9]) and c.holds([40, 41])


def test_a_repeated_request_is_learned_once(tmp_path):
    """After a sampled answer, the greedy answer to the same prompt is learned once, however often it repeats
    (also across a restart: the journal's spans are searched the same way)."""
    from redraft.server.corpora import TenantCorpora

    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    sampled, greedy = [20, 21, 22, 23, 24], [20, 21, 30, 31, 32, 33]
    corpora = TenantCorpora(["default"], str(tmp_path), vocab_size=64, fingerprint=None, cap_tokens=None)
    assert corpora.learn_span("default", prompt + sampled)
    learned = [corpora.learn_span("default", prompt + greedy) for _ in range(20)]
    assert learned == [True] + [False] * 19 and corpora.get("default").n_spans == 2
    assert not corpora.learn_span("default", prompt + greedy[:4])  # a shorter answer (smaller max_tokens): held
    corpora.close()
    again = TenantCorpora(["default"], str(tmp_path), vocab_size=64, fingerprint=None, cap_tokens=None)
    assert not again.learn_span("default", prompt + greedy) and again.get("default").n_spans == 2
    assert again.get("default").propose(prompt + greedy[:2], 8)[1].tolist() == greedy[2:]
    again.close()


def test_serve_refuses_bad_files_before_loading_the_model(tmp_path, capsys):
    from redraft.cli import main

    bad = tmp_path / "t.json"
    bad.write_text("{")
    with pytest.raises(SystemExit) as e:  # --model does not exist: the tenants file is checked first
        main(["serve", "--port", "0", "--model", str(tmp_path / "none"), "--tenants", str(bad)])
    assert "redraft serve: error: tenants file" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--model", str(tmp_path / "none"), "--corpus", str(tmp_path / "c.txt")])
    assert "--corpus" in str(e.value) and "no such file" in str(e.value)


def test_serve_refuses_a_busy_port():
    from redraft.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", str(port), "--model", "/nonexistent"])
    assert f"cannot listen on 127.0.0.1:{port}" in str(e.value)


@pytest.mark.parametrize("argv,says", [(["--port", "70000"], "outside 0..65535"), (["--k", "0"], "outside 1..48"),
                                       (["--minacc", "150"], "outside 0..100"), (["--cap-tokens", "x"], "integer")])
def test_serve_flag_errors_exit_2(capsys, argv, says):
    from redraft.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_listening_socket_disables_nagle_for_accepted_connections():
    """Without TCP_NODELAY every keep-alive response waited ~40 ms for a delayed ACK (asyncio sets the option only
    on sockets created with proto IPPROTO_TCP; accepted sockets inherit it from the listener on Linux)."""
    from redraft.cli.serve import listen

    sock = listen("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2]):
            conn, _ = sock.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


@pytest.mark.slow  # starts several server processes
def test_bench_serve_smoke(tmp_path, capsys, monkeypatch):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from serverkit import save_tiny_model

    from redraft.cli import main

    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))  # the servers' cost curve: never the user's cache
    model = save_tiny_model(tmp_path / "m")
    out = tmp_path / "r.json"
    assert main(["bench", "serve", "--model", str(model), "--phases", "repeat,load,crash", "--questions", "2",
                 "--requests", "6", "--concurrency", "2", "--load-distinct", "3", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["repeat"]["identical"] == 2 and res["repeat"]["second_tokens_per_forward"] > 1
    assert res["load"]["errors"] == 0 and res["load"]["not_identical"] == 0
    assert res["crash"]["kill_ok"] and res["crash"]["truncate_ok"] is not False
