"""``redraft serve`` operator features against a live server: prefix KV reuse across requests (exact, per tenant,
counted in /metrics and in each response), the access log and ``--quiet``, ``x-request-id``, ``--max-tokens-default``,
``--cors-origins`` with preflight ``OPTIONS``, and OpenAI's limit of 4 stop strings."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import plain_greedy
from serverkit import EOS, live_server, serve_args, words

from redraft.bench.serve_bench import metric_value
from redraft.io.prompts import encode_prompt


@pytest.fixture(scope="module")
def live(model_dir, loaded, tenants_file):
    """Two tenants, n-gram drafts on, a prefix cache of 2,000 tokens, browsers from one origin, chat capped at 12;
    no answer cache (identical repeats reach the prefix cache, as with sampling)."""
    args = serve_args(model_dir, "--tenants", str(tenants_file), "--prefix-cache-tokens", "2000", "--no-answer-cache",
                      "--cors-origins", "http://localhost:3000", "--max-tokens-default", "12")
    with live_server(args, loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def logged(model_dir, loaded, tenants_file):
    """Two tenants, writing the access log (each test waits for the lines it expects, so none spills over)."""
    with live_server(serve_args(model_dir, "--tenants", str(tenants_file), quiet=False), loaded) as srv:
        yield srv


def _complete(live, key: str, prompt: list[int], n: int, **headers) -> httpx.Response:
    r = httpx.post(f"{live.url}/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                   headers={"Authorization": f"Bearer {key}", **headers}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _metric(live, name: str) -> float:
    return metric_value(httpx.get(f"{live.base}/metrics", timeout=10).text, name)


def _plain_text(loaded, prompt, n) -> tuple[str, list[int]]:
    out = plain_greedy(loaded.model, prompt, n, eos=[EOS])
    return words([t for t in out if t != EOS]), out


# ---- prefix KV reuse ----------------------------------------------------------------------------------------------

def test_agent_turns_reuse_the_conversation_and_match_plain_greedy(live, loaded):
    prompt = [3, 14, 15, 9, 26, 5]
    hits_before, queries_before = _metric(live, "vllm:prefix_cache_hits_total"), \
        _metric(live, "vllm:prefix_cache_queries_total")
    hit_sum, prev = 0, prompt
    for turn in range(3):
        want, out = _plain_text(loaded, prompt, 20)
        body = _complete(live, "key-a", prompt, 20).json()
        assert body["choices"][0]["text"] == want
        hit = body["redraft"]["prefix_hit_tokens"]
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
        if turn == 0:
            assert hit == 0
        else:  # the previous prompt and its answer (but the last answer token, never fed) came from the cache
            assert hit >= len(prev) - 1
        hit_sum += hit
        prev = prompt + out
        prompt = prev + [40 + turn, 41, 42]  # previous request + its answer + an observation
    assert _metric(live, "vllm:prefix_cache_hits_total") - hits_before == hit_sum
    assert _metric(live, "vllm:prefix_cache_queries_total") > queries_before
    assert 0 < _metric(live, "redraft:prefix_cache_tokens") <= 2000


def test_chat_usage_reports_prefix_hits_as_cached_tokens(live):
    """A chat turn resent whole (as agents do) reuses its KV entries: usage.prompt_tokens_details.cached_tokens."""
    msgs = [{"role": "user", "content": "t21 t22 t23 t24 t25 t26 t27 t28"}]
    bodies = []
    for _ in range(2):
        r = httpx.post(f"{live.url}/chat/completions", json={"messages": msgs, "max_tokens": 4},
                       headers={"Authorization": "Bearer key-a"}, timeout=60)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    first, second = (b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    assert first == bodies[0]["redraft"]["prefix_hit_tokens"] == 0
    assert second == bodies[1]["redraft"]["prefix_hit_tokens"] > 0
    assert second < bodies[1]["usage"]["prompt_tokens"]


def test_one_tenants_cache_never_serves_another(live, loaded):
    prompt = [50, 51, 52, 53, 54, 55, 56]
    _complete(live, "key-a", prompt, 8)
    again = prompt + [57]
    other = _complete(live, "key-b", again, 8).json()
    assert other["redraft"]["prefix_hit_tokens"] == 0
    assert other["choices"][0]["text"] == _plain_text(loaded, again, 8)[0]
    own = _complete(live, "key-a", again, 8).json()
    assert own["redraft"]["prefix_hit_tokens"] >= len(prompt)


def test_prefix_cache_evicts_within_its_budget(model_dir, loaded):
    with live_server(serve_args(model_dir, "--prefix-cache-tokens", "40"), loaded) as srv:
        for base in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
            _complete(srv, "none", base * 3, 10)  # 12 + 10 tokens each: a third entry cannot fit with two
        assert _metric(srv, "redraft:prefix_cache_evictions_total") >= 1
        assert _metric(srv, "redraft:prefix_cache_tokens") <= 40


def test_prefix_cache_off(model_dir, loaded):
    with live_server(serve_args(model_dir, "--prefix-cache-tokens", "0"), loaded) as srv:
        first = _complete(srv, "none", [7, 8, 9], 6).json()
        assert first["redraft"]["prefix_hit_tokens"] == 0
        assert _complete(srv, "none", [7, 8, 9, 1, 2], 6).json()["redraft"]["prefix_hit_tokens"] == 0
        assert srv.server.generator.prefix_cache is None


# ---- access log, request ids ----------------------------------------------------------------------------------------

def _log_lines(capsys, *wanted: str, timeout: float = 10.0) -> list[str]:
    """Access-log lines written so far, waiting until each of ``wanted`` appears in one (a line is written once
    the response has been sent, so it may come a moment after the client has the response)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        lines += [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("redraft serve: ")]
        if all(any(w in ln for ln in lines) for w in wanted) or time.monotonic() > deadline:
            return lines


def test_access_log_line_per_request(logged, capsys):
    capsys.readouterr()
    httpx.get(f"{logged.base}/health", timeout=10)
    httpx.get(f"{logged.base}/metrics", timeout=10)
    r = _complete(logged, "key-b", [20, 21, 22], 5)
    httpx.get(f"{logged.base}/v1/nothing-here", timeout=10)
    lines = _log_lines(capsys, '"POST /v1/completions" 200', '"GET /v1/nothing-here" 404')
    gen = [ln for ln in lines if '"POST /v1/completions" 200' in ln]
    assert len(gen) == 1, lines
    usage = r.json()["usage"]
    for field in ("tenant=bob", f"prompt_tokens={usage['prompt_tokens']}",
                  f"completion_tokens={usage['completion_tokens']}", "prefix_hit_tokens=",
                  f"request_id={r.headers['x-request-id']}"):
        assert field in gen[0], (field, gen[0])
    assert "tokens_per_forward=" in gen[0] and " seconds=" in gen[0]
    assert any('"GET /v1/nothing-here" 404 tenant=- ' in ln for ln in lines)
    assert not any("/health" in ln or "/metrics" in ln for ln in lines), lines  # probes that answered: not logged


def test_access_log_counts_every_choice_as_usage_does(logged, capsys):
    capsys.readouterr()
    r = httpx.post(f"{logged.url}/completions", json={"prompt": [[20, 21, 22], [30, 31]], "max_tokens": 4, "n": 2},
                   headers={"Authorization": "Bearer key-b"}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 5
    gen = [ln for ln in _log_lines(capsys, '"POST /v1/completions" 200') if '"POST /v1/completions" 200' in ln]
    assert len(gen) == 1 and f"prompt_tokens=5 completion_tokens={usage['completion_tokens']} " in gen[0], gen


def test_a_stream_the_client_left_is_logged_as_499_with_its_token_counts(logged, capsys, monkeypatch):
    """The 499 line counts the prompt and the tokens generated until the client left, as a finished line does."""
    model = logged.server.generator.model
    inner = model.forward

    def slow(*a, **kw):  # every step slowed: the stream is still running when the client leaves
        time.sleep(0.02)
        return inner(*a, **kw)

    monkeypatch.setattr(model, "forward", slow)
    capsys.readouterr()
    prompt = [20, 21, 22, 23]
    body = {"prompt": prompt, "max_tokens": 500, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{logged.url}/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-a"}) as r:
        lines = r.iter_lines()
        events = (x for x in lines if x.startswith("data: "))
        seen = [next(events) for _ in range(3)]
        assert len(seen) == 3 and '"text"' in seen[-1]
        lines.close()
    gen = [ln for ln in _log_lines(capsys, '"POST /v1/completions" 499', timeout=20)
           if '"POST /v1/completions" 499' in ln]
    assert len(gen) == 1, gen
    assert f"tenant=alice prompt_tokens={len(prompt)} completion_tokens=" in gen[0], gen[0]
    generated = int(gen[0].split("completion_tokens=")[1].split()[0])
    assert 1 <= generated < 500, gen[0]


def test_unauthorized_request_is_logged_with_its_status(logged, capsys):
    capsys.readouterr()
    r = httpx.post(f"{logged.url}/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
    assert r.status_code == 401 and r.headers["x-request-id"]
    assert any('"POST /v1/completions" 401' in ln for ln in _log_lines(capsys, '"POST /v1/completions" 401'))


def test_quiet_writes_no_access_log(model_dir, loaded, capsys):
    with live_server(serve_args(model_dir, quiet=True), loaded) as srv:
        capsys.readouterr()
        _complete(srv, "none", [4, 5, 6], 3)
        assert _log_lines(capsys, "never written", timeout=1.0) == []


def test_request_id_is_echoed_or_made(live):
    sent = _complete(live, "key-a", [9, 8, 7], 2, **{"X-Request-ID": "client-abc.123"})
    assert sent.headers["x-request-id"] == "client-abc.123"
    made = _complete(live, "key-a", [9, 8, 7], 2)
    other = _complete(live, "key-a", [9, 8, 7], 2)
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != other.headers["x-request-id"]
    junk = _complete(live, "key-a", [9, 8, 7], 2, **{"X-Request-ID": "has spaces and\ttabs"})
    assert junk.headers["x-request-id"] != "has spaces and\ttabs"
    streamed = httpx.post(f"{live.url}/completions", headers={"Authorization": "Bearer key-a",
                                                               "x-request-id": "s-1"},
                          json={"prompt": [9, 8, 7], "max_tokens": 2, "stream": True}, timeout=60)
    assert streamed.headers["x-request-id"] == "s-1" and streamed.text.endswith("data: [DONE]\n\n")


# ---- request defaults and limits ------------------------------------------------------------------------------------

def test_max_tokens_default_caps_chat_requests_without_max_tokens(live, loaded):
    msg = words([33, 34, 35])
    r = httpx.post(f"{live.url}/chat/completions", headers={"Authorization": "Bearer key-a"},
                   json={"messages": [{"role": "user", "content": msg}]}, timeout=60).json()
    prompt = encode_prompt(loaded.tokenizer, [{"role": "user", "content": msg}], chat=True)
    out = plain_greedy(loaded.model, list(prompt), 12, eos=[EOS])
    assert r["usage"]["completion_tokens"] == len(out) <= 12
    if len(out) == 12 and out[-1] != EOS:
        assert r["choices"][0]["finish_reason"] == "length"
    asked = httpx.post(f"{live.url}/chat/completions", headers={"Authorization": "Bearer key-a"},
                       json={"messages": [{"role": "user", "content": msg}], "max_tokens": 20}, timeout=60).json()
    assert asked["usage"]["completion_tokens"] == len(plain_greedy(loaded.model, list(prompt), 20, eos=[EOS]))


def test_more_than_four_stop_strings_are_refused(live):
    r = httpx.post(f"{live.url}/completions", headers={"Authorization": "Bearer key-a"},
                   json={"prompt": [1, 2], "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "stop" and err["type"] == "invalid_request_error" and "at most 4" in err["message"]
    ok = httpx.post(f"{live.url}/completions", headers={"Authorization": "Bearer key-a"},
                    json={"prompt": [1, 2], "max_tokens": 2, "stop": ["a", "b", "c", "d"]}, timeout=60)
    assert ok.status_code == 200


# ---- CORS -----------------------------------------------------------------------------------------------------------

def test_cors_preflight_and_headers(live):
    pre = httpx.options(f"{live.url}/chat/completions", timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = _complete(live, "key-a", [1, 2, 3], 2, Origin="http://localhost:3000")
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    bad = httpx.options(f"{live.url}/chat/completions", timeout=10, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    err = bad.json()["error"]  # an OpenAI-style body, like every other error
    assert err["param"] == "origin" and err["type"] == "invalid_request_error" and "origin" in err["message"]


def test_no_cors_headers_without_origins(model_dir, loaded):
    with live_server(serve_args(model_dir, quiet=True), loaded) as srv:
        r = _complete(srv, "none", [1, 2, 3], 2, Origin="http://localhost:3000")
        assert "access-control-allow-origin" not in r.headers
        pre = httpx.options(f"{srv.url}/chat/completions", timeout=10, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 405 and pre.headers["allow"] == "POST"
        assert "does not take OPTIONS (it takes POST)" in pre.json()["error"]["message"]


# ---- the agent benchmark phase ----------------------------------------------------------------------------------------

def test_agent_phase_reuses_prefixes_and_keeps_answers_identical(model_dir, loaded):
    """``bench serve``'s agent phase against in-process servers of the tiny model (short system prompt: its context
    is 640 tokens): answers identical across the six runs, hits only with reuse, replays drafted or answered from
    the answer cache."""
    from contextlib import ExitStack

    from redraft.bench.agent_bench import AgentBenchConfig, run_agent_phase

    started: list[tuple[str, bool, bool]] = []
    with ExitStack() as stack:
        def start(name: str, reuse: bool, answers: bool):
            started.append((name, reuse, answers))
            extra = ([] if reuse else ["--prefix-cache-tokens", "0"]) + ([] if answers else ["--no-answer-cache"])
            srv = stack.enter_context(live_server(serve_args(model_dir, "--no-ngram", *extra), loaded))
            return srv.base, lambda: None, time.process_time  # in process: this process's CPU seconds

        cfg = AgentBenchConfig(conversations=2, turns=3, max_tokens=8, system=words([5, 6, 7, 8, 9]),
                               observation=words([11, 12, 13]))
        res = run_agent_phase(start, cfg)
    assert started == [("agent-no_reuse", False, False), ("agent-reuse", True, False),
                       ("agent-answer_cache", True, True)]
    assert res["requests"] == 6 and res["answers"] == 30 and res["identical"] == 30
    assert res["first_no_reuse_prefix_hit_tokens"] == res["second_no_reuse_prefix_hit_tokens"] == 0
    assert res["first_reuse_prefix_hit_tokens"] > 0
    assert res["second_reuse_prefix_hit_tokens"] > res["first_reuse_prefix_hit_tokens"]  # whole prompts cached
    assert res["second_reuse_tokens_per_forward"] > res["first_reuse_tokens_per_forward"]  # answers replayed
    assert res["first_speedup_with_reuse"] > 0 and res["replay_speedup_with_reuse"] > 0
    assert all(res[f"{run}_cpu_seconds"] > 0 for run in ("first_no_reuse", "second_no_reuse", "first_reuse",
                                                           "second_reuse"))
    assert res["replay_speedup_with_reuse_cpu"] == res["first_reuse_cpu_seconds"] / res["second_reuse_cpu_seconds"]
    # the answer cache: no hit in a first run, every request of the replay a hit, without a forward
    assert res["first_answer_cache_answer_cache_hits"] == 0 and res["first_answer_cache_forwards"] > 0
    assert res["second_answer_cache_answer_cache_hits"] == 6 and res["second_answer_cache_forwards"] == 0
    assert res["second_reuse_answer_cache_hits"] == res["second_no_reuse_answer_cache_hits"] == 0


@pytest.mark.parametrize("flag,value", [("--prefix-cache-tokens", "-1"), ("--prefix-cache-tokens", "many"),
                                        ("--max-tokens-default", "0")])
def test_bad_operator_flags_are_refused_by_the_parser(flag, value, capsys):
    from redraft.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_response_the_client_left_is_logged_as_499():
    """A stream that began with 200 but never sent its last body message (the client went away) logs nginx's 499;
    a finished one logs its own status."""
    import asyncio
    import io

    from redraft.server.access_log import AccessLog

    def app_sending(last_more_body: bool):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": last_more_body})
        return app

    async def noop_send(message):
        return None

    def scope():
        return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "client": ("1.2.3.4", 5)}

    for more, want in ((True, " 499 "), (False, " 200 ")):
        out = io.StringIO()
        asyncio.run(AccessLog(app_sending(more), stream=out)(scope(), None, noop_send))
        assert want in out.getvalue(), out.getvalue()

    async def failing(scope, receive, send):  # the app fails mid-stream: a server error, not a client that left
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("generation failed")

    out = io.StringIO()
    with pytest.raises(ValueError):
        asyncio.run(AccessLog(failing, stream=out)(scope(), None, noop_send))
    assert " 500 " in out.getvalue(), out.getvalue()
