"""``redraft serve`` end to end with the official ``openai`` client against a live server on 127.0.0.1 (a tiny saved
model with a word-level tokenizer): outputs equal plain greedy decoding and ``redraft run``, streaming deltas
concatenate to the whole text, the corpus learns from answers per tenant, a client that leaves stops its
generation, metrics count what happened."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import plain_greedy
from serverkit import CONTEXT, EOS, live_server, serve_args, words

from redraft.bench.serve_bench import metric_value


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    """An open server (one default tenant) without n-gram drafts, so corpus drafts are the only speed-up."""
    with live_server(serve_args(model_dir, "--no-ngram"), loaded) as srv:
        yield srv


def expected_text(loaded, prompt_ids, n) -> tuple[str, list[int], str]:
    """Plain greedy's text (EOS is a special token: not in the text), ids and finish reason."""
    out = plain_greedy(loaded.model, prompt_ids, n, eos=[EOS])
    return words([t for t in out if t != EOS]), out, "stop" if out and out[-1] == EOS else "length"


def stats(resp) -> dict:
    return resp.model_extra["redraft"]


def metric(live, name: str, **labels) -> float:
    """The value of one metric of /metrics (summed over the samples that match ``labels``; 0 when absent)."""
    return metric_value(httpx.get(f"{live.base}/metrics", timeout=10).text, name, **labels)


# ---- exactness and streaming ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_ids,n", [([10, 11, 12, 13], 40), ([3, 4, 5], 25), ([50, 40, 30, 20, 10], 60)])
def test_completion_equals_plain_greedy(live, loaded, prompt_ids, n):
    client = live.client()
    want, out, reason = expected_text(loaded, prompt_ids, n)
    for prompt in (words(prompt_ids), prompt_ids):  # text and token-id prompts
        r = client.completions.create(model=live.server.model_id, prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == want and r.choices[0].finish_reason == reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(out))
        assert r.usage.total_tokens == len(prompt_ids) + len(out)


def test_chat_equals_redraft_run(live, loaded, model_dir, capsys):
    from redraft.cli import main

    msg = words([7, 8, 9, 10, 11])
    r = live.client().chat.completions.create(model=live.server.model_id, max_tokens=30,
                                              messages=[{"role": "user", "content": msg}])
    assert main(["run", "--model", str(model_dir), "--ngen", "30", "--no-ngram", msg]) == 0
    assert r.choices[0].message.content == capsys.readouterr().out.rstrip("\n")
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_deltas_concatenate_to_the_whole_text(live, kind):
    client, model = live.client(), live.server.model_id
    # a prompt no other test sends (per kind): the server learns answers, and a learned one may replay in one delta
    prompt = words([71, 72, 73, 74, 75] if kind == "completion" else [21, 22, 23, 24])
    if kind == "completion":
        def call(**kw):
            return client.completions.create(model=model, prompt=prompt, max_tokens=50, **kw)

        def piece(ch):
            return ch.choices[0].text
    else:
        def call(**kw):
            return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=50, **kw)

        def piece(ch):
            return ch.choices[0].delta.content or ""
    # streamed first: the prompt is novel, so its answer takes several forwards (the server learns it, and the
    # repeat below may be replayed in one forward)
    stream = call(stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, extra = [], None, None, None
    for ch in stream:
        if not ch.choices:
            usage = ch.usage
            continue
        pieces.append(piece(ch))
        finish = ch.choices[0].finish_reason or finish
        extra = (ch.model_extra or {}).get("redraft", extra)
    whole = call()
    text = whole.choices[0].text if kind == "completion" else whole.choices[0].message.content
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens and extra["forwards"] >= 1


def test_stop_string_cuts_before_it_in_both_modes(live, loaded):
    prompt = [30, 31, 32]
    full, out, _ = expected_text(loaded, prompt, 40)
    stop = full.split(" ")[6]  # a word of the answer
    want = full[:full.index(stop)]
    client = live.client()
    r = client.completions.create(model=live.server.model_id, prompt=prompt, max_tokens=40, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=live.server.model_id, prompt=prompt, max_tokens=40, stop=stop, stream=True) if ch.choices)
    assert streamed == want


def test_sampling_with_a_seed_is_reproducible(live):
    client = live.client()
    kw = dict(model=live.server.model_id, prompt=words([40, 41, 42]), max_tokens=30, temperature=0.9, top_p=0.95,
              seed=1234, extra_body={"top_k": 20, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and stats(a)["seed"] == 1234
    # the seed is what decides the sample: other seeds give other text, and none of it is the greedy text
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert a.choices[0].text not in others and len(others) > 1
    greedy = client.completions.create(**{**kw, "temperature": 0}).choices[0].text
    assert greedy != a.choices[0].text and greedy not in others


# ---- the corpus grows from answers ------------------------------------------------------------------------------

def test_second_identical_request_drafts_from_the_corpus(model_dir, loaded):
    prompt = [60, 61, 62, 63, 60]
    want, out, _ = expected_text(loaded, prompt, 80)
    # a fresh, empty corpus; no answer cache, so the identical repeat is decoded (drafted from the corpus)
    with live_server(serve_args(model_dir, "--no-ngram", "--no-answer-cache"), loaded) as srv:
        client = srv.client()
        first = client.completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=80)
        second = client.completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=80)
        assert first.choices[0].text == second.choices[0].text == want
        assert stats(first)["sources"]["corpus"]["proposed"] == 0 and stats(first)["learned"]
        assert stats(first)["forwards"] == len(out)  # nothing to draft from: plain greedy's forwards
        assert stats(second)["sources"]["corpus"]["accepted"] > 0
        assert stats(second)["forwards"] < stats(first)["forwards"]
        assert metric(srv, "vllm:spec_decode_num_accepted_tokens_total", source="corpus") > 0
        assert stats(first)["learned"] and not stats(second)["learned"]  # the replay is not stored twice
        assert metric(srv, "redraft:corpus_tokens", tenant="default") == len(prompt) + len(out)


def test_greedy_repeats_after_a_sampled_answer_are_learned_once(model_dir, loaded):
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    want, out, _ = expected_text(loaded, prompt, 24)
    with live_server(serve_args(model_dir, "--no-ngram", "--no-answer-cache"), loaded) as srv:  # repeats decoded
        client = srv.client()
        kw = dict(model=srv.server.model_id, prompt=prompt, max_tokens=24)
        sampled = client.completions.create(**kw, temperature=1.0, seed=5)
        assert sampled.choices[0].text != want and stats(sampled)["learned"]  # a different answer, stored
        spans = metric(srv, "redraft:corpus_spans", tenant="default")
        greedy = [client.completions.create(**kw) for _ in range(20)]
        assert all(g.choices[0].text == want for g in greedy)
        assert sum(bool(stats(g)["learned"]) for g in greedy) <= 1
        assert metric(srv, "redraft:corpus_spans", tenant="default") <= spans + 1
        assert stats(greedy[-1])["sources"]["corpus"]["accepted"] >= len(out) - 2


def test_tenants_never_draft_from_each_other(model_dir, loaded, tmp_path):
    from openai import AuthenticationError

    keys = tmp_path / "tenants.json"
    keys.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    with live_server(serve_args(model_dir, "--no-ngram", "--no-answer-cache", "--tenants", str(keys)),
                     loaded) as srv:  # no answer cache: alice's repeat is decoded, drafted from her corpus
        alice, bob = srv.client("key-a"), srv.client("key-b")
        kw = dict(model=srv.server.model_id, prompt=[12, 34, 56, 7], max_tokens=60)
        a1 = alice.completions.create(**kw)
        b1 = bob.completions.create(**kw)
        a2 = alice.completions.create(**kw)
        assert a1.choices[0].text == b1.choices[0].text == a2.choices[0].text
        assert stats(b1)["sources"]["corpus"]["proposed"] == 0  # bob's corpus has never seen it
        assert stats(a2)["sources"]["corpus"]["accepted"] > 0  # alice's has
        assert stats(a1)["learned"] and stats(b1)["learned"] and not stats(a2)["learned"]  # a replay adds nothing
        assert metric(srv, "redraft:corpus_spans", tenant="alice") == metric(srv, "redraft:corpus_spans",
                                                                             tenant="bob") == 1
        with pytest.raises(AuthenticationError):
            srv.client("wrong-key").completions.create(**kw)
        no_key = httpx.post(f"{srv.url}/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/models", timeout=10).status_code == 401
        assert alice.models.list().data[0].id == srv.server.model_id


def test_no_learn_keeps_the_corpus_empty(model_dir, loaded):
    with live_server(serve_args(model_dir, "--no-ngram", "--no-learn"), loaded) as srv:
        kw = dict(model=srv.server.model_id, prompt=[5, 6, 7, 8], max_tokens=30)
        srv.client().completions.create(**kw)
        again = srv.client().completions.create(**kw)
        assert "corpus" not in stats(again)["sources"] and not stats(again)["learned"]


def test_shared_read_only_corpus_drafts_for_every_tenant(model_dir, loaded, tmp_path):
    prompt = [17, 27, 37, 47]
    want, out, _ = expected_text(loaded, prompt, 50)
    shared = tmp_path / "shared.txt"
    shared.write_text(" ".join(map(str, prompt + out)) + "\n")
    with live_server(serve_args(model_dir, "--no-ngram", "--no-learn", "--corpus", str(shared)), loaded) as srv:
        r = srv.client().completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=50)
    assert r.choices[0].text == want
    assert stats(r)["sources"]["shared"]["accepted"] > 0 and stats(r)["forwards"] < len(out)


def test_cap_bounds_each_tenants_corpus(model_dir, loaded):
    cap = 60
    with live_server(serve_args(model_dir, "--no-ngram", "--cap-tokens", str(cap)), loaded) as srv:
        for i in range(8):
            srv.client().completions.create(model=srv.server.model_id, prompt=[2 + i, 30 + i, 9], max_tokens=20)
            assert metric(srv, "redraft:corpus_tokens", tenant="default") <= 2 * cap
        corpus = srv.server.generator.corpora.get("default")
        corpus.compact()
        assert corpus.n_tokens <= cap and metric(srv, "redraft:corpus_evicted_spans", tenant="default") > 0


# ---- a client that leaves -------------------------------------------------------------------------------------

def long_prompt(loaded) -> list[int]:
    """A prompt whose greedy answer runs to the context end without EOS (so only a disconnect can stop it)."""
    for p in ([2, 9, 4], [44, 45, 46], [15, 25, 35], [8, 16, 24]):
        if EOS not in plain_greedy(loaded.model, p, CONTEXT - len(p) - 1):
            return p
    pytest.skip("no candidate prompt runs to the context end")


def wait_idle(live, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{live.base}/health", timeout=10).json()
        if not h["running"] and h["queue"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server is still generating")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_stops_the_generation(live, loaded, stream, monkeypatch):
    prompt = long_prompt(loaded)
    n = CONTEXT - len(prompt) - 1
    model = live.server.generator.model
    slow = model.forward

    def forward(*a, **kw):  # ~3 s for the whole answer: far longer than the client stays
        time.sleep(0.005)
        return slow(*a, **kw)

    monkeypatch.setattr(model, "forward", forward)
    wait_idle(live)
    aborted = metric(live, "vllm:request_success_total", finished_reason="abort")
    generated = metric(live, "vllm:generation_tokens_total")
    body = {"model": live.server.model_id, "prompt": prompt, "max_tokens": n, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{live.url}/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_idle(live)
    assert metric(live, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(live, "vllm:generation_tokens_total") - generated < n  # it stopped before the end
    assert live.client().completions.create(model=live.server.model_id, prompt=[3, 4], max_tokens=3).choices


def test_health_models_and_metrics(live):
    h = httpx.get(f"{live.base}/health", timeout=10).json()
    assert h["status"] == "ok" and h["queue"] == 0 and h["model"] == live.server.model_id
    models = live.client().models.list().data
    assert [m.id for m in models] == [live.server.model_id]
    text = httpx.get(f"{live.base}/metrics", timeout=10).text
    for name in ("vllm:num_requests_waiting", "vllm:request_queue_time_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "redraft:tokens_per_forward_bucket",
                 "vllm:prompt_tokens_total", "redraft:target_forwards_total", "redraft:http_requests_total"):
        assert name in text


def test_a_streamed_request_gets_its_first_token_before_an_unproven_draft(model_dir, loaded):
    """A replay of a 5-token prompt (matched whole, too short to prove a replay: first-token chance 6/7): answered
    whole, the prompt's forward verifies the learned answer with it (one forward); streamed (asked first, before the
    policy has seen the source right), the first token comes from a draft-free prompt forward and the answer from
    the next. Both equal plain greedy decoding."""
    prompt = [60, 61, 62, 63, 60]
    want, out, _ = expected_text(loaded, prompt, 40)
    with live_server(serve_args(model_dir, "--no-ngram", "--no-answer-cache"), loaded) as srv:
        client = srv.client()
        client.completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=40)  # learned
        chunks = list(client.completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=40,
                                                stream=True))  # first: the policy has not seen the source right
        streamed = next(c.model_extra["redraft"] for c in chunks if (c.model_extra or {}).get("redraft"))
        whole = client.completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=40)
        assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert streamed["forwards"] == 2 and stats(whole)["forwards"] == 1
