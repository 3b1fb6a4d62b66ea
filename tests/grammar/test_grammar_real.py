"""Grammar-constrained decoding on the default model (slow): speculative equals plain, answers validate.

The model comes from ``redraft.io.loading.load_model()`` (see tests/decoding/test_real_model.py); skipped only when its
package is not installed.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import load_default_model

from redraft.decoding.engine import Engine
from redraft.decoding.sampling import SamplingParams
from redraft.drafters import NgramDrafter
from redraft.drafters.grammar import GrammarDrafter
from redraft.grammar import Constraint, grammar_tokenizer

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
ASKS = ["Describe a fictional person named Alice as JSON with name, age, city and hobbies.",
        "Give me a JSON record for a chef from Lyon: name, age, city, hobbies."]
N = 64


@pytest.fixture(scope="module")
def real():
    from redraft.io.prompts import encode_prompt

    loaded = load_default_model()
    c = Constraint.json_schema(SCHEMA, grammar_tokenizer(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids),
                               loaded.vocab_size)
    return loaded, c, [encode_prompt(loaded.tokenizer, a) for a in ASKS]


def test_constrained_speculative_equals_constrained_plain_on_the_default_model(real):
    loaded, c, prompts = real
    eos = loaded.eos_token_ids
    for ids in prompts:
        base = Engine(loaded.model, [], eos_token_ids=eos).generate(ids, N, sampling=SamplingParams(constraint=c))
        spec = Engine(loaded.model, [GrammarDrafter(c), NgramDrafter()], eos_token_ids=eos).generate(
            ids, N, sampling=SamplingParams(constraint=c))
        assert spec.output_ids == base.output_ids
        assert spec.forwards < base.forwards
        assert spec.sources["grammar"].accepted > 0
        text = loaded.tokenizer.decode(base.output_ids, skip_special_tokens=True)
        if base.stop_reason == "eos":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert text.startswith('{"name": "')


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_server_tool_calls_and_json_schema_on_the_default_model(real):
    """The default model through ``redraft serve`` and the openai client: a required call parses and validates,
    streamed equals whole, a json_schema answer validates, and grammar drafts are accepted."""
    from serverkit import live_server, serve_args

    from redraft.io.loading import resolve_model_dir

    loaded, _, _ = real
    _, model_dir = resolve_model_dir(None, quiet=True)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    with live_server(serve_args(model_dir), loaded) as srv:
        client = srv.client(timeout=600)
        kw = dict(model=srv.server.model_id, messages=ask, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert r.model_extra["redraft"]["sources"]["grammar"]["accepted"] > 0
        streamed = ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                streamed += tc.function.arguments or ""
        assert streamed == call.function.arguments
        r = client.chat.completions.create(
            model=srv.server.model_id, max_tokens=80,
            messages=[{"role": "user", "content": "Invent a person: name, age, city and hobbies."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
