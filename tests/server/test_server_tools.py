"""Tools and structured output on ``redraft serve``, through the ``openai`` client against a live server.

The tiny random model has a real byte-level BPE tokenizer (tests/grammarkit.py), so llguidance can enforce JSON
schemas and tool-call grammars on it: whatever its random weights prefer, a json_schema answer validates and a
required tool call parses. Grammar drafts must not change any answer (compared with --no-grammar-drafts).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from grammarkit import PERSON, save_bpe_model
from serverkit import live_server, serve_args

from redraft.server.toolcalls import FORMATS, ContentFilter
from redraft.server.tools import ToolRequest, chat_messages

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["paris", "rome", "oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "the weather in paris"}]
BAD_TOOL = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """The BPE model saved once per module; while the module runs, redraft's cache (the server's cost curve) is a
    temporary directory, as for ``model_dir``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDRAFT_CACHE", str(tmp_path_factory.mktemp("bpe-cache")))
        yield save_bpe_model(tmp_path_factory.mktemp("bpe-model"))


@pytest.fixture(scope="module")
def bpe_loaded(bpe_dir):
    from redraft.io.loading import load_model

    return load_model(bpe_dir)


@pytest.fixture(scope="module")
def live(bpe_dir, bpe_loaded):
    with live_server(serve_args(bpe_dir), bpe_loaded) as srv:
        yield srv


def chat(live, **kw):
    return live.client().chat.completions.create(model=live.server.model_id, messages=kw.pop("messages", ASK),
                                                 max_tokens=kw.pop("max_tokens", 90), **kw)


def test_json_schema_answer_parses_validates_and_uses_grammar_drafts(live):
    r = chat(live, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                          "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), PERSON)
    g = r.model_extra["redraft"]["sources"]["grammar"]
    assert g["proposed"] > 0 and g["accepted"] > 0


OPENAI_FORM = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
LLAMA_CPP_FORMS = [{"type": "json_object", "schema": PERSON}, {"type": "json_schema", "schema": PERSON}]


@pytest.mark.parametrize("form", LLAMA_CPP_FORMS, ids=["json_object+schema", "json_schema+schema"])
def test_llama_cpp_response_formats_constrain_as_json_schema_does(live, form):
    """llama.cpp's server's forms (the schema at the top of ``response_format``), sent by clients written for it,
    through the openai client's ``response_format`` and ``extra_body``: on chat and on completions the answer
    validates and is the one OpenAI's ``json_schema`` form gives (the same grammar)."""
    client, model = live.client(), live.server.model_id
    answers = []
    for fmt in (form, OPENAI_FORM):
        direct = chat(live, response_format=fmt).choices[0]
        extra = chat(live, extra_body={"response_format": fmt}).choices[0]
        text = client.completions.create(model=model, prompt="a person:", max_tokens=90,
                                         extra_body={"response_format": fmt}).choices[0]
        for c, content in ((direct, direct.message.content), (extra, extra.message.content), (text, text.text)):
            assert c.finish_reason == "stop", content
            jsonschema.validate(json.loads(content), PERSON)
        answers.append((direct.message.content, extra.message.content, text.text))
    assert answers[0] == answers[1]


def test_json_object_answer_is_an_object(live):
    r = chat(live, response_format={"type": "json_object"}, max_tokens=200)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_required_tool_call_parses_with_valid_arguments(live):
    r = chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_named_function_is_the_one_called(live):
    r = chat(live, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls  # exactly one call, parallel_tool_calls or not
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_streamed_tool_call_equals_the_whole_one(live):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = chat(live, **kw).choices[0].message.tool_calls[0]
    parts, finish = {}, None
    for chunk in chat(live, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            assert not ch.delta.content  # nothing of the call leaks out as text
            for tc in ch.delta.tool_calls or []:
                p = parts.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                p["id"] = tc.id or p["id"]
                p["name"] += tc.function.name or ""
                p["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and list(parts) == [0]
    assert parts[0]["id"].startswith("call_")
    assert (parts[0]["name"], parts[0]["arguments"]) == (whole.function.name, whole.function.arguments)


def test_streamed_parallel_calls_come_one_chunk_each(live):
    """Several calls stream as docs/serving.md says: after any content, one chunk per call, in order, each holding
    one ``tool_calls`` entry with its ``index``, ``id``, ``type`` and ``function`` (name and whole arguments, valid
    JSON); together they equal the non-streamed answer's calls. A cut-off last call (``length``) is in neither."""
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=200)  # parallel: calls until max_tokens cuts one off
    whole = chat(live, **kw).choices[0]
    assert len(whole.message.tool_calls) >= 2, whole
    seen, finish = [], []
    for chunk in chat(live, stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content
            if ch.finish_reason:
                finish.append(ch.finish_reason)
            if ch.delta.tool_calls:
                assert not finish, "a call after the finishing chunk"
                (tc,) = ch.delta.tool_calls  # one call per chunk
                seen.append(tc)
    assert finish == [whole.finish_reason]
    assert [tc.index for tc in seen] == list(range(len(seen)))  # each index once, in order
    for tc in seen:
        assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
        schema = {"get_weather": WEATHER, "get_time": TIME}[tc.function.name]
        jsonschema.validate(json.loads(tc.function.arguments), schema)
    assert [(tc.function.name, tc.function.arguments) for tc in seen] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len({tc.id for tc in seen}) == len(seen)


def test_tool_round_trip_with_null_content_and_a_tool_message(live):
    first = chat(live, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    r = chat(live, messages=history, tools=TOOLS, max_tokens=12)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > chat(live, tools=TOOLS, max_tokens=1).usage.prompt_tokens


def test_tool_choice_none_answers_in_text_without_the_tools_in_the_prompt(live):
    with_tools = chat(live, tools=TOOLS, tool_choice="none", max_tokens=8)
    plain = chat(live, max_tokens=8)
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.choices[0].message.content == plain.choices[0].message.content


def test_grammar_drafts_do_not_change_answers(bpe_dir, bpe_loaded, live):
    asks = [dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}),
            dict(tools=TOOLS, tool_choice="required"),
            dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                 temperature=1.0, seed=7)]
    with live_server(serve_args(bpe_dir, "--no-grammar-drafts", "--no-ngram", "--no-learn"), bpe_loaded) as off:
        for kw in asks:
            a, b = chat(live, **kw), chat(off, **kw)
            assert "grammar" not in b.model_extra["redraft"]["sources"]
            ma, mb = a.choices[0].message, b.choices[0].message
            assert ma.content == mb.content
            assert [(c.function.name, c.function.arguments) for c in ma.tool_calls or []] == \
                [(c.function.name, c.function.arguments) for c in mb.tool_calls or []]


@pytest.mark.parametrize("body, param, says", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters",
     "schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool call"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema", "cannot be enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema", "no output satisfies it"),
    ({"tools": TOOLS + [BAD_TOOL]}, "tools[2].function.parameters", "cannot be enforced"),
    ({"tools": TOOLS + [BAD_TOOL], "tool_choice": "required"}, "tools[2].function.parameters", "cannot be enforced"),
    ({"tools": [BAD_TOOL] + TOOLS, "tool_choice": {"type": "function", "function": {"name": "broken"}}},
     "tools[0].function.parameters", "cannot be enforced"),
    ({"response_format": {"type": "json_object", "foo": 1}}, "response_format.foo", "unrecognized"),
    ({"response_format": {"type": "json_object", "schema": 3}}, "response_format.schema", "schema object"),
    ({"response_format": {"type": "json_schema", "schema": PERSON, "json_schema": {"name": "p", "schema": PERSON}}},
     "response_format.schema", "send one"),
    ({"response_format": {"type": "json_schema", "schema": {"$ref": "#"}}}, "response_format.schema",
     "no output satisfies it"),
    ({"response_format": {"type": "text", "schema": PERSON}}, "response_format.schema", "unrecognized"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema", "unrecognized"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON, "strict": True,
                                                                 "foo": 1}}},
     "response_format.json_schema.foo", "unrecognized"),
    ({"tools": TOOLS, "n": 2}, "n", "not supported"),
    ({"messages": [{"role": "user", "content": None, "tool_calls": []}]}, "messages[0].tool_calls", "assistant"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_bad_tool_and_format_requests_are_400s_naming_the_field(live, body, param, says):
    r = httpx.post(live.url + "/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


# ---- the formats, without a server ------------------------------------------------------------------------------

def test_hermes_parser_reads_calls_and_keeps_the_rest_as_content():
    fmt = FORMATS["hermes"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}</tool_call>'
    content, calls = fmt.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": "utc"}), ("get_weather", {"city": "rome", "days": 2})]
    assert fmt.parse("no calls here") == ("no calls here", [])
    assert fmt.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    # an unclosed last block (the answer hit max_tokens right after the JSON) still counts
    assert fmt.parse('<tool_call>\n{"name": "f", "arguments": {}}')[1][0]["function"]["name"] == "f"


def test_a_cut_off_call_is_dropped_from_content_but_prose_about_the_wrapper_is_not():
    fmt = FORMATS["hermes"]
    whole = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
    content, calls = fmt.parse(whole + '<tool_call>\n{"name":')  # max_tokens hit inside the second call
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    assert fmt.parse('Checking.\n<tool_call>\n{"name": "get_ti') == ("Checking.", [])
    assert fmt.parse("Checking.\n<tool_call>\n") == ("Checking.", [])
    assert fmt.parse("Write <tool_call> before a call") == ("Write <tool_call> before a call", [])
    f = ContentFilter(fmt)  # streamed: the fragment is never sent, not even when the answer is finished
    out = "".join(f.feed(d) for d in ["Checking.\n", "<tool_call>", '\n{"name":'])
    assert out + f.finish(fmt.parse(f.text)[0]) == "Checking.\n"


def test_forced_call_cut_off_by_max_tokens_has_no_content(live):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    n = chat(live, **kw).usage.completion_tokens
    c = chat(live, max_tokens=n // 2, **kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and not c.message.tool_calls
    chunks = list(chat(live, stream=True, max_tokens=n // 2, **kw))
    assert not any(ch.delta.content or ch.delta.tool_calls for x in chunks for ch in x.choices)
    assert [ch.finish_reason for x in chunks for ch in x.choices if ch.finish_reason] == ["length"]


def test_llama3_json_parser():
    fmt = FORMATS["llama3_json"]
    content, calls = fmt.parse('{"name": "get_time", "parameters": {"zone": "cet"}}')
    assert content is None and calls[0]["function"]["arguments"] == '{"zone": "cet"}'
    assert fmt.parse("It is sunny.") == ("It is sunny.", [])


def test_content_filter_streams_text_before_the_call_only():
    f = ContentFilter(FORMATS["hermes"])
    out = "".join(f.feed(d) for d in ["Sure", ", checking", " <tool", "_call>\n{\"name\"", ": \"f\"}"])
    assert out == "Sure, checking "
    assert f.finish("Sure, checking") == ""
    g = ContentFilter(FORMATS["hermes"])
    assert "".join(g.feed(d) for d in ["a <", "b"]) == "a <b"  # a '<' that did not start a call is released


def test_fallback_prompt_describes_tools_and_rewrites_the_history():
    fmt = FORMATS["hermes"]
    tools = ToolRequest(tools=[t["function"] for t in TOOLS])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    msgs = chat_messages(history, tools, fmt, native=False)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": fmt.render("get_time", {"zone": "utc"})}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    assert chat_messages(history, ToolRequest(tools=tools.tools, choice="none"), fmt, native=False)[0] == ASK[0]


def test_a_template_that_renders_tools_gets_them_natively():
    from grammarkit import CHATML, bpe_tokenizer

    from redraft.server.tools import encode_tool_chat, template_renders_tools

    plain_tok, native_tok = bpe_tokenizer(), bpe_tokenizer()
    plain_tok.chat_template = CHATML
    native_tok.chat_template = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }} "
                                "{% endfor %}<|im_end|>\n{% endif %}" + CHATML)
    assert not template_renders_tools(plain_tok) and template_renders_tools(native_tok)
    tools = ToolRequest(tools=[t["function"] for t in TOOLS])
    fmt = FORMATS["hermes"]
    native = native_tok.decode(encode_tool_chat(native_tok, ASK, tools, fmt))
    assert "get_weather get_time" in native and "<tools>" not in native  # the template's own rendering only
    fallback = plain_tok.decode(encode_tool_chat(plain_tok, ASK, tools, fmt))
    assert "<tools>" in fallback and "get_weather" in fallback
    none = ToolRequest(tools=tools.tools, choice="none")
    assert "get_weather" not in native_tok.decode(encode_tool_chat(native_tok, ASK, none, fmt))


def test_auto_mode_grammar_leaves_text_free_and_enforces_a_begun_call():
    """tool_choice auto: free text (every token but the special ones), but once '<tool_call>' is written the call
    must be a valid call of a tool; the forced part after the wrapper is what grammar drafts propose."""
    from grammarkit import bpe_tokenizer, tiny_for

    from redraft.decoding.engine import Engine
    from redraft.decoding.sampling import SamplingParams
    from redraft.grammar import Constraint, grammar_tokenizer

    tok = bpe_tokenizer()
    eos = tok.eos_token_id
    fmt = FORMATS["hermes"]
    c = Constraint.lark(fmt.lazy_grammar([t["function"] for t in TOOLS], special=False),
                        grammar_tokenizer(tok, len(tok), [eos]), len(tok))
    m = c.matcher()
    assert m.consume_tokens(tok.encode("the weather is sunny today "))
    assert m.consume_tokens(tok.encode("<tool_call>"))
    forced = tok.decode(m.compute_ff_tokens())
    assert forced.startswith('\n{"name": "get_')  # which tool is still a choice
    bad = m.deep_copy()
    assert not bad.consume_tokens(tok.encode('\n{"name": "rm_rf"'))
    good = m.deep_copy()
    assert good.consume_tokens(tok.encode('\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'))
    assert good.consume_tokens(tok.encode(" done"))  # text may follow the call
    # a model that writes no call decodes exactly as without the grammar (no special token in its answer)
    model = tiny_for(tok, seed=9)
    prompt = tok.encode("the weather in paris")
    free = Engine(model, [], eos_token_ids=[eos]).generate(prompt, 40).output_ids
    held = Engine(model, [], eos_token_ids=[eos]).generate(prompt, 40, sampling=SamplingParams(constraint=c)).output_ids
    specials = set(tok.all_special_ids) - {eos}
    first_special = next((i for i, t in enumerate(free) if t in specials), len(free))
    assert held[:first_special] == free[:first_special]
    assert not set(held) & specials
    assert fmt.lazy_grammar([t["function"] for t in TOOLS], special=False) is not None
    assert FORMATS["llama3_json"].lazy_grammar([t["function"] for t in TOOLS], special=False) is None


@pytest.mark.parametrize("kw", [{}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"},
                                {"tools": TOOLS, "tool_choice": "none"}],
                         ids=["no-tools", "auto", "required", "none"])
def test_streamed_chunks_carry_content_only_when_there_is_text(live, kw):
    """Only the first chunk (the role) may carry ``content: ""``, as OpenAI streams; with or without tools."""
    body = {"messages": ASK, "max_tokens": 40, "stream": True, **kw}
    with httpx.stream("POST", live.url + "/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    for d in deltas[1:]:
        assert d.get("content") != "" and "role" not in d, deltas
