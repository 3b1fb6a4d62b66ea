"""OpenAI wire conventions of ``redraft serve`` (tiny saved model, live server): log-probabilities (completions'
legacy object with echo and prompt scoring, chat's), several prompts and ``n``, the tokenizer routes, the served
OpenAPI document, model aliases and ``system_fingerprint``.

Log-probabilities are compared with transformers' ``log_softmax(model(ids).logits)`` within 1e-3 (verify rows differ
from a full forward's rows by float rounding).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import plain_greedy
from serverkit import EOS, live_server, serve_args, words

TOL = 1e-3


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    with live_server(serve_args(model_dir, "--served-model-name", "tiny", "tiny-alias",
                                        "--enable-tokenizer-info-endpoint"), loaded) as srv:
        yield srv


def reference(loaded, ids) -> torch.Tensor:
    """[len(ids), V] float32 log-probabilities of one transformers forward (row i scores ids[i + 1])."""
    with torch.inference_mode():
        return torch.log_softmax(loaded.model(torch.tensor([ids])).logits[0].float(), -1)


def post(live, path, body, **kw):
    return httpx.post(live.url + path, json=body, timeout=60, **kw)


def test_completion_logprobs_match_plain_decoding(live, loaded):
    prompt = [10, 11, 12, 13]
    want = plain_greedy(loaded.model, prompt, 20, eos=[EOS])
    r = post(live, "/completions", {"prompt": prompt, "max_tokens": 20, "logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [loaded.tokenizer.decode([t]) for t in want]  # the same ids as plain decoding
    ref = reference(loaded, prompt + want)
    for i, t in enumerate(want):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp["token_logprobs"][i] - row[t].item()) < TOL
        top = row.topk(3)
        assert list(lp["top_logprobs"][i]) == [loaded.tokenizer.decode([j]) for j in top.indices.tolist()]
        assert max(lp["top_logprobs"][i].values()) == lp["token_logprobs"][i]  # greedy: the chosen one is top
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_lm_eval_scoring_request_several_prompts(live, loaded):
    """lm-eval's loglikelihood request: token-id prompts, echo, max_tokens 1, logprobs 1, four prompts at once."""
    prompts = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35], [40, 41, 42]]
    grew = live.server.generator.corpora.get("default").n_tokens
    r = post(live, "/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 1, "logprobs": 1,
                                    "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert body["usage"]["completion_tokens"] == 4
    for p, c in zip(prompts, body["choices"], strict=True):
        first = plain_greedy(loaded.model, p, 1)
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(p) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(loaded, p + first)
        for i in range(1, len(p) + 1):
            assert abs(lp["token_logprobs"][i] - ref[i - 1, (p + first)[i]].item()) < TOL
        for i in range(1, len(p) + 1):  # the row's most likely token and the prompt's own (when not the same)
            top = lp["top_logprobs"][i]
            best = loaded.tokenizer.decode([int(ref[i - 1].argmax())])
            assert lp["tokens"][i] in top and best in top and len(top) == 1 + (best != lp["tokens"][i])
            assert top[lp["tokens"][i]] == lp["token_logprobs"][i] and list(top)[0] == best
        assert lp["tokens"][-1] == loaded.tokenizer.decode(first)
        assert c["text"].startswith(loaded.tokenizer.decode(p, skip_special_tokens=False))
    assert live.server.generator.corpora.get("default").n_tokens == grew  # scoring learns nothing


def test_prompt_scoring_with_no_tokens_runs_one_forward(live, loaded):
    prompt = [3, 4, 5, 6, 7, 8]
    r = post(live, "/completions", {"prompt": words(prompt), "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == words(prompt) and body["usage"]["completion_tokens"] == 0
    assert body["redraft"]["forwards"] == 1 and not body["redraft"]["learned"]
    ref = reference(loaded, prompt)
    got = c["logprobs"]["token_logprobs"]
    assert got[0] is None and all(abs(got[i] - ref[i - 1, prompt[i]].item()) < 1e-5 for i in range(1, len(prompt)))
    # logprobs 0: the listed token alone, as OpenAI and vLLM answer (up to logprobs + 1 entries)
    assert [list(t) for t in c["logprobs"]["top_logprobs"][1:]] == [[loaded.tokenizer.decode([t])] for t in prompt[1:]]
    assert all(c["logprobs"]["top_logprobs"][i] == {c["logprobs"]["tokens"][i]: got[i]} for i in range(1, len(prompt)))


def test_chat_logprobs(live, loaded):
    r = live.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": words([7, 8, 9])}],
                                              max_tokens=8, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob and t.token == t.top_logprobs[0].token for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_n_choices_reproducible_under_a_seed(live):
    client = live.client()
    kw = dict(model="tiny", prompt=words([12, 13, 14]), max_tokens=12, temperature=1.0, seed=42)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # different seeds: different samples
    for i in range(3):  # choice i is the request with seed + i
        assert client.completions.create(**{**kw, "seed": 42 + i}).choices[0].text == texts[i]
    assert a.usage.completion_tokens == sum(len(t.split()) for t in texts) + sum(
        c.finish_reason == "stop" for c in a.choices)
    g = client.completions.create(model="tiny", prompt=words([12, 13, 14]), max_tokens=12, n=2)
    assert g.choices[0].text == g.choices[1].text  # greedy: identical choices


def test_streamed_choices_carry_their_index(live):
    chunks = list(live.client().completions.create(model="tiny", prompt=[words([21]), words([22, 23])],
                                                   max_tokens=5, stream=True))
    got: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
    whole = live.client().completions.create(model="tiny", prompt=[words([21]), words([22, 23])], max_tokens=5)
    assert got == {c.index: c.text for c in whole.choices}


def test_aliases_fingerprint_and_models(live):
    client = live.client()
    r = client.completions.create(model="tiny-alias", prompt="t05", max_tokens=2)
    assert r.model == "tiny-alias" and r.system_fingerprint.startswith("fp_")
    assert client.completions.create(model="tiny", prompt="t05", max_tokens=2).system_fingerprint == \
        r.system_fingerprint
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_tokenizer_routes(live, loaded):
    r = httpx.post(live.base + "/tokenize", json={"prompt": "t05 t06 t07", "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == [5, 6, 7] and r.json()["count"] == 3
    r = httpx.post(live.base + "/tokenize", json={"messages": [{"role": "user", "content": "t05"}]})
    assert r.json()["tokens"] == loaded.tokenizer.apply_chat_template([{"role": "user", "content": "t05"}],
                                                                      add_generation_prompt=True, tokenize=True)["input_ids"]
    assert httpx.post(live.base + "/detokenize", json={"tokens": [5, 6.0]}).json() == {"prompt": "t05 t06"}
    info = httpx.get(live.base + "/tokenizer_info").json()
    assert info["eos_token"] == "t01" and info["chat_template"] == loaded.tokenizer.chat_template
    for body, param in (({"tokens": [99]}, "tokens[0]"), ({"tokens": "x"}, "tokens")):
        r = httpx.post(live.base + "/detokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(live.base + "/tokenize", json={"prompt": "a", "messages": []})
    assert r.status_code == 400


def test_tokenizer_info_is_opt_in_as_in_vllm(model_dir, loaded):
    """Without --enable-tokenizer-info-endpoint the route is absent (404, not in /openapi.json), as in vLLM: its
    presence is what sends lm-eval's API models to their remote tokenizer backend."""
    with live_server(serve_args(model_dir), loaded) as srv:
        assert httpx.get(srv.base + "/tokenizer_info").status_code == 404
        assert "/tokenizer_info" not in httpx.get(srv.base + "/openapi.json").json()["paths"]
        assert httpx.post(srv.base + "/tokenize", json={"prompt": "t05"}).status_code == 200


def test_openapi_documents_every_route(live):
    doc = httpx.get(live.base + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = schema["$ref"].rsplit("/", 1)[1]
        assert name in doc["components"]["schemas"]
        assert "200" in doc["paths"][path]["post"]["responses"]
    assert "logprobs" in doc["components"]["schemas"]["CompletionBody"]["properties"]
    for path in ("/v1/models", "/health", "/metrics", "/tokenizer_info"):
        assert "get" in doc["paths"][path]
    assert httpx.get(live.base + "/docs").status_code == 200


def test_responses_and_stream_chunks_match_the_served_schemas(live):
    """Real bodies (with logprobs, several choices, usage, the redraft statistics) and streamed chunks validate
    against /openapi.json's own schemas; request models list OpenAI's no-op fields at their accepted values."""
    import json

    import jsonschema

    doc = httpx.get(live.base + "/openapi.json").json()
    comps = doc["components"]["schemas"]

    def check(name, body):
        jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
                                        ).validate(body)

    chat = {"messages": [{"role": "user", "content": "t05 t06"}], "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2, "n": 2, "seed": 3, "temperature": 0.5}
    check("CompletionResponse", post(live, "/completions", {"prompt": "t05 t06", "max_tokens": 6, "logprobs": 2,
                                                            "n": 2}).json())
    check("ChatCompletionResponse", post(live, "/chat/completions", chat).json())
    for path, name, body in (("/completions", "CompletionChunk", {"prompt": "t07", "max_tokens": 6, "logprobs": 1}),
                             ("/chat/completions", "ChatCompletionChunk", chat)):
        with httpx.stream("POST", live.url + path, json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        for e in events[:-1]:
            check(name, json.loads(e))
    bad = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/RedraftStats", "components": doc["components"]})
    assert not bad.is_valid({"forwards": 1})  # the statistics object is described, not an open dict
    assert comps["Message"]["properties"]["refusal"]["enum"] == [None]
    assert comps["ChatBody"]["additionalProperties"] is False and "frequency_penalty" in comps["ChatBody"]["properties"]
