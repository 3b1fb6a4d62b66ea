"""OpenAI's Responses API on ``redraft serve`` through the ``openai`` client's ``responses.create``: the same output
as chat completions, instructions, previous_response_id over the per-tenant store, store: false, typed stream
events, errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from serverkit import live_server, serve_args, words


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    with live_server(serve_args(model_dir, "--no-ngram"), loaded) as srv:
        yield srv


def chat(live, messages, n=12) -> str:
    r = live.client().chat.completions.create(model=live.server.model_id, messages=messages, max_tokens=n)
    return r.choices[0].message.content


def test_response_equals_chat_completion(live):
    client = live.client()
    r = client.responses.create(model=live.server.model_id, input=words([7, 8, 9]), max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat(live, [{"role": "user", "content": words([7, 8, 9])}])
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens == 3
    assert r.status in ("completed", "incomplete") and r.output[0].status == r.status  # the message's as OpenAI's
    # the request's speculation statistics, as in chat completions; prefix-cache hits are OpenAI's cached tokens
    assert r.model_extra["redraft"]["forwards"] >= 1
    assert r.usage.input_tokens_details.cached_tokens == r.model_extra["redraft"]["prefix_hit_tokens"]
    r2 = client.responses.create(model=live.server.model_id, instructions=words([4]), max_output_tokens=12,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": words([5])}]}])
    assert r2.output_text == chat(live, [{"role": "system", "content": words([4])},
                                         {"role": "user", "content": words([5])}])


def test_previous_response_id_continues_the_conversation(live):
    client = live.client()
    first = client.responses.create(model=live.server.model_id, input=words([20, 21]), max_output_tokens=6,
                                    instructions=words([3]))
    second = client.responses.create(model=live.server.model_id, input=words([30]), max_output_tokens=6,
                                     previous_response_id=first.id)
    # instructions are not carried over; the first turn's input and output are
    want = chat(live, [{"role": "user", "content": words([20, 21])},
                       {"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": words([30])}], 6)
    assert second.output_text == want and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id
    private = client.responses.create(model=live.server.model_id, input=words([9]), max_output_tokens=3,
                                      store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=live.server.model_id, input="t05", previous_response_id=private.id)
    assert e.value.body["param"] == "previous_response_id"
    other = live.client("another-key")  # one tenant without --tenants: the key is ignored, so this still works
    assert other.responses.retrieve(first.id).id == first.id


def test_streamed_events(live):
    events = list(live.client().responses.create(model=live.server.model_id, input=words([11, 12]),
                                                 max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text
    assert text == chat(live, [{"role": "user", "content": words([11, 12])}], 10)


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"),
    ({"input": "t05", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "t05", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "t05", "bogus": 1}, "bogus"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "t05", "max_output_tokens": 10 ** 6}, "max_output_tokens"),  # beyond the context: named as sent
    ({"input": words([5] * 1000)}, "input"),  # over the 640-token context
    ({"input": []}, "input"),
])
def test_bad_requests_are_400(live, body, param):
    r = httpx.post(live.url + "/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if body.get("input") == []:
        assert r.json()["error"]["message"].startswith("'input' is empty")
