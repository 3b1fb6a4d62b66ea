"""Bad input to ``redraft serve``: an OpenAI-style error body with the right status (400, 401, 404, 405, 413, 415, 429,
503) naming the field, never a 422 or a 500, and never a dead server."""

from __future__ import annotations

import json

import httpx
import pytest
from serverkit import CONTEXT, live_server, serve_args, words


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    with live_server(serve_args(model_dir), loaded) as srv:
        yield srv


COMPLETIONS, CHAT = "/completions", "/chat/completions"
OK_CHAT = [{"role": "user", "content": "t05 t06"}]

CASES = [
    # (endpoint, body (bytes = raw), status, param, words the message must contain)
    (COMPLETIONS, b'{"prompt": [1, 2', 400, None, "not valid JSON"),
    (COMPLETIONS, b'[1, 2]', 400, None, "JSON object"),
    (COMPLETIONS, b'{"prompt": "t05", "temperature": NaN}', 400, None, "NaN"),
    (COMPLETIONS, {"prompt": "t05", "max_tokens": "abc"}, 400, "max_tokens", "integer"),
    (COMPLETIONS, {"prompt": "t05", "temperature": "hot"}, 400, "temperature", "number"),
    (COMPLETIONS, {"prompt": "t05", "stream": "yes"}, 400, "stream", "boolean"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "list of token ids"),
    (COMPLETIONS, {"max_tokens": 5}, 400, "prompt", "required"),
    (CHAT, {"messages": "hello"}, 400, "messages", "list of"),
    (CHAT, {"messages": [{"content": "t05"}]}, 400, "messages[0].role", "required"),
    (COMPLETIONS, {"prompt": "t05", "n": 0}, 400, "n", "between 1 and"),
    (COMPLETIONS, {"prompt": "t05", "n": 2.5}, 400, "n", "integer"),
    (COMPLETIONS, {"prompt": ["t05"] * 65, "n": 2}, 400, "n", "exceed the limit"),
    (COMPLETIONS, {"prompt": "t05", "logprobs": 6}, 400, "logprobs", "between 0 and 5"),
    (COMPLETIONS, {"prompt": "t05", "logprobs": 1, "echo": True, "stream": True}, 400, "echo", "stream"),
    (CHAT, {"messages": OK_CHAT, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "between 0 and 20"),
    (CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", "'logprobs' set to true"),
    (COMPLETIONS, b'{"prompt": "t05", "user": "\\ud800"}', 400, "user", "lone surrogate"),
    (COMPLETIONS, b'{"prompt": "\\udc00 t05"}', 400, "prompt", "lone surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages[0].content", "lone surrogate"),
    (COMPLETIONS, b'{"prompt": "t05", "metadata": ' + b'[' * 40 + b']' * 40 + b'}', 400, "metadata", "nested"),
    # too deep for json.loads itself: the field is found by a scan of the raw body
    (COMPLETIONS, b'{"prompt": ' + b'[' * 100000 + b']' * 100000 + b'}', 400, "prompt", "nested"),
    (CHAT, b'{"messages": [{"role": "user", "content": "t05 ]]"}], "metadata": {"a": '
     + b'{"b": ' * 10000 + b'1' + b'}' * 10001 + b'}', 400, "metadata", "nested"),
    (COMPLETIONS, b'[' * 10000 + b']' * 10000, 400, None, "nested"),
    # numbers too large to hold: the field is named, not the JSON decoder's digit limit
    (COMPLETIONS, b'{"prompt": "t05", "max_tokens": ' + b'9' * 5000 + b'}', 400, "max_tokens", "too large"),
    (CHAT, b'{"messages": [{"role": "user", "content": "t05"}], "max_tokens": -' + b'1' * 5000 + b'}', 400,
     "max_tokens", "too large"),
    (COMPLETIONS, b'{"prompt": "t05", "temperature": 1e999}', 400, "temperature", "too large"),
    (COMPLETIONS, b'{"prompt": [5, ' + b'7' * 4301 + b']}', 400, "prompt[1]", "too large"),
    (COMPLETIONS, {"prompt": "t05", "best_of": 3}, 400, "best_of", "not supported"),
    (CHAT, {"messages": OK_CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools[0]", "function tools"),
    (CHAT, {"messages": OK_CHAT, "tool_choice": "required"}, 400, "tool_choice", "needs 'tools'"),
    (CHAT, {"messages": OK_CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
    # the word-level test tokenizer cannot spell JSON: structured output is refused, not silently ignored
    (CHAT, {"messages": OK_CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "not available for this model"),
    (COMPLETIONS, {"prompt": "t05", "response_format": {"type": "json_schema", "schema": {}}}, 400, "response_format",
     "not available for this model"),
    (CHAT, {"messages": OK_CHAT, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    (COMPLETIONS, {"prompt": "t05", "foo": 1}, 400, "foo", "unrecognized"),
    (COMPLETIONS, {"prompt": "t05", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    (COMPLETIONS, {"prompt": "t05", "max_tokens": 0, "echo": True, "logprobs": -1}, 400, "logprobs", "between"),
    (CHAT, {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", "at least 1"),
    (COMPLETIONS, {"prompt": "t05", "max_tokens": 10 ** 9}, 400, "max_tokens", f"context of {CONTEXT}"),
    (COMPLETIONS, b'{"prompt": "t05", "max_tokens": 1e308}', 400, "max_tokens", "'max_tokens' 1.00e+308 is too large"),
    (COMPLETIONS, b'{"prompt": "t05", "max_tokens": 1' + b'0' * 400 + b'}', 400, "max_tokens", "1.00e+400 is too"),
    (COMPLETIONS, {"prompt": words([5] * (CONTEXT + 10)), "max_tokens": 1}, 400, "prompt", f"context is {CONTEXT}"),
    (CHAT, {"messages": [{"role": "user", "content": words([5] * CONTEXT)}]}, 400, "messages", str(CONTEXT)),
    (COMPLETIONS, {"prompt": "t05", "model": "no-such-model"}, 404, "model", "does not exist"),
    (CHAT, {"messages": []}, 400, "messages", "empty"),
    (CHAT, {"messages": [{"role": "user", "content": "t05", "foo": 1}]}, 400, "messages[0].foo", "unrecognized"),
    (CHAT, {"messages": [{"role": "system", "content": "t05"}, {"role": "user", "content": "t05", "refusal": "no"}]},
     400, "messages[1].refusal", "only null"),
    (CHAT, {"messages": [{"role": "user", "content": "t05"}, {"role": "tool", "content": "12:00"}]}, 400,
     "messages[1].tool_call_id", "required"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content",
     "text parts only"),
    (COMPLETIONS, {"prompt": "t05", "temperature": 5}, 400, "temperature", "between 0 and 2"),
    (COMPLETIONS, {"prompt": "t05", "top_p": 0}, 400, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "t05", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    (COMPLETIONS, {"prompt": [5, 99]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {"prompt": ["t05", ""]}, 400, "prompt", "'prompt[1]' is empty"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    (COMPLETIONS, {"prompt": "t05", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMPLETIONS, {"prompt": "t05", "stop": ""}, 400, "stop", "must be non-empty"),
    (CHAT, {"messages": OK_CHAT, "stop": ["t07", ""]}, 400, "stop", "must be non-empty"),
    (COMPLETIONS, {"prompt": "t05", "seed": 2 ** 63}, 400, "seed", "64-bit"),
    (CHAT, {"messages": OK_CHAT, "seed": -2 ** 63 - 1}, 400, "seed", "64-bit"),
]


@pytest.mark.parametrize("endpoint,body,status,param,says", CASES,
                         ids=[f"{c[2]}-{c[3] or c[4].split()[0]}" for c in CASES])
def test_bad_request_gets_an_openai_error(live, endpoint, body, status, param, says):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(live.url + endpoint, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"]


JSON_ROUTES = [("/v1/completions", {"prompt": "t05", "max_tokens": 2}),
               ("/v1/chat/completions", {"messages": OK_CHAT, "max_tokens": 2}),
               ("/v1/responses", {"input": "t05", "max_output_tokens": 2}),
               ("/tokenize", {"prompt": "t05"}), ("/detokenize", {"tokens": [5]})]


@pytest.mark.parametrize("path,body", JSON_ROUTES, ids=[r[0] for r in JSON_ROUTES])
@pytest.mark.parametrize("sent", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                  "application/jsonp", "json"])
def test_a_body_not_sent_as_json_is_a_415_naming_both_types(live, path, body, sent):
    """A valid JSON body declared as another type is refused, as OpenAI and vLLM refuse it, not read as JSON."""
    r = httpx.post(live.base + path, content=json.dumps(body).encode(), headers={"content-type": sent}, timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_content_type", err
    assert f"'{sent}'" in err["message"] and "'Content-Type: application/json'" in err["message"], err
    assert ("curl -d" in err["message"]) == (sent == "application/x-www-form-urlencoded"), err
    op = httpx.get(live.base + "/openapi.json").json()["paths"][path]["post"]["responses"]
    assert op["415"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse"), op


@pytest.mark.parametrize("path,body", JSON_ROUTES, ids=[r[0] for r in JSON_ROUTES])
@pytest.mark.parametrize("sent", ["application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json",
                                  None, ""])
def test_json_types_and_a_missing_content_type_are_read_as_json(live, path, body, sent):
    """``application/json`` with parameters, any ``application/*+json``, and no Content-Type at all (what httpx
    sends for raw ``content=``) are read as JSON."""
    headers = {} if sent is None else {"content-type": sent}
    r = httpx.post(live.base + path, content=json.dumps(body).encode(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_openai_message_fields_at_their_empty_values_are_accepted(live):
    """What the openai client's ``message.model_dump()`` sends back as the next turn's assistant message."""
    turn = {"role": "assistant", "content": "t06", "refusal": None, "annotations": [], "audio": None,
            "function_call": None, "tool_calls": None}
    body = {"messages": [{"role": "user", "content": "t05"}, turn, {"role": "user", "content": "t07"}],
            "max_tokens": 2}
    r = httpx.post(live.url + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(live.base + "/tokenize", json={"messages": [{"role": "user", "content": "t05", "foo": 1}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].foo", r.text


def test_a_lone_surrogate_in_a_field_name_is_a_400_not_a_500(live):
    # the name is quoted in the message and param, which must still encode as UTF-8: written as the escape
    r = httpx.post(live.url + COMPLETIONS, content=b'{"prompt": "t05", "\\ud800x": 1}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "\\ud800x" and "lone surrogate" in err["message"]
    r = httpx.post(live.url + COMPLETIONS, content=b'{"prompt": "t05", "\\udc00": ' + b'[' * 5000 + b'}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "\\udc00", r.text


def test_openai_client_raises_the_matching_errors(live):
    import openai

    client, model = live.client(), live.server.model_id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="t05", n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="t05")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="t05", extra_body={"top_k": "many"})
    assert e.value.body["param"] == "top_k" and e.value.body["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413(live):
    saved = live.server.max_body
    live.server.max_body = 64
    try:
        r = httpx.post(live.url + COMPLETIONS, json={"prompt": words([5] * 40)}, timeout=30)
    finally:
        live.server.max_body = saved
    assert r.status_code == 413 and "64" in r.json()["error"]["message"]


def test_large_body_over_the_limit_is_read_then_413(live):
    """A client still sending a body past the limit gets the 413, not a connection reset (the rest is drained)."""
    import urllib.error
    import urllib.request

    saved = live.server.max_body
    live.server.max_body = 64
    body = b'{"prompt": "' + b"x" * (4 * 2**20) + b'"}'
    try:
        req = urllib.request.Request(live.url + COMPLETIONS, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        chunked = httpx.post(live.url + COMPLETIONS, content=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                             timeout=60)
    finally:
        live.server.max_body = saved
    assert e.value.code == 413 and "4194" in json.loads(e.value.read())["error"]["message"]
    assert chunked.status_code == 413 and "exceeds the limit" in chunked.json()["error"]["message"]
    req = urllib.request.Request(live.url + COMPLETIONS, data=body, headers={"Content-Type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as e:  # drained as well: the 415 arrives, not a connection reset
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 415 and "text/plain" in json.loads(e.value.read())["error"]["message"]


def test_unknown_route_and_method_get_error_bodies(live):
    r = httpx.get(live.url + "/nope", timeout=10)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(live.url + COMPLETIONS, timeout=10)
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"
    r = httpx.delete(live.url + "/models", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_full_queue_is_429_with_retry_after(live):
    sched = live.server.scheduler
    saved = sched.max_queue
    sched.max_queue = 0
    try:
        r = httpx.post(live.url + COMPLETIONS, json={"prompt": "t05", "max_tokens": 2}, timeout=30)
    finally:
        sched.max_queue = saved
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "requests" and int(r.headers["retry-after"]) >= 1


def test_server_survives_and_never_answered_500(live):
    r = live.client().completions.create(model=live.server.model_id, prompt="t05 t06", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    metrics = httpx.get(live.base + "/metrics", timeout=10).text
    assert 'status="400"' in metrics
    assert 'status="500"' not in metrics and 'status="422"' not in metrics


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(live, monkeypatch):
    from redraft.server import tokenize

    longest = tokenize.max_token_chars(live.server.generator.tokenizer)
    text = "x" * (CONTEXT * longest + 1)  # more characters than CONTEXT tokens can span
    calls = []
    monkeypatch.setattr(tokenize, "text_ids", lambda *a, **k: calls.append(a) or [1])
    for endpoint, body in ((CHAT, {"messages": [{"role": "user", "content": text}]}), (COMPLETIONS, {"prompt": text})):
        r = httpx.post(live.url + endpoint, json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert not calls  # refused from its length alone
    ok = httpx.post(live.url + CHAT, json={"messages": OK_CHAT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
