"""Structured output on ``/v1/chat/completions`` and ``/v1/completions``: ``response_format`` and forced tool calls
as one grammar.

``response_format`` (OpenAI's chat completions API; vLLM and llama.cpp take it on completions too):

- ``{"type": "text"}`` (default): free text.
- ``{"type": "json_object"}``: the answer is one JSON object.
- ``{"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?, "description"?}}``: the answer is one JSON
  value valid under ``schema`` (``name`` is required, as OpenAI requires it; without ``schema``, any JSON
  value). redraft always enforces the schema (``strict: false`` is enforced too: a grammar
  costs nothing extra and an answer that does not validate helps nobody).
- llama.cpp's server's forms (its ``tools/server/README.md``), for clients written for it:
  ``{"type": "json_object", "schema": {...}}`` (llama.cpp's, llama-cpp-python's and Together's JSON mode with a
  schema) and ``{"type": "json_schema", "schema": {...}}`` (the schema without OpenAI's ``json_schema`` wrapper,
  so without a name): the answer is one JSON value valid under ``schema``, exactly as with ``json_schema``.

``tool_choice`` ``required`` or a named function compiles the tool-call format's grammar (one call or, with
``parallel_tool_calls``, several; arguments valid under each tool's ``parameters``). Both give a
:class:`redraft.grammar.Constraint` that every verify row is masked with; the constraint also drives the grammar
drafter, which proposes the tokens it forces.
"""

from __future__ import annotations

from dataclasses import dataclass

from redraft.grammar import Constraint, GrammarError, grammar_tokenizer

from .schemas import APIError, check_fields
from .toolcalls import ToolCallFormat
from .tools import ToolRequest


@dataclass(frozen=True)
class ResponseFormat:
    """A checked ``response_format``: kind "json_object" or "json_schema" as sent; ``schema`` (None: any JSON
    object) and ``name`` of the schema; ``param``: the field the schema came from, named when it cannot be
    enforced (``response_format.json_schema.schema``, or ``response_format.schema`` in llama.cpp's forms)."""

    kind: str = "text"
    schema: dict | None = None
    name: str = "response"
    param: str = "response_format.json_schema.schema"


_FORMS = ("{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., "
          "\"schema\": {...}}} (llama.cpp's {\"type\": \"json_object\" or \"json_schema\", \"schema\": {...}} too)")


def parse_response_format(value) -> ResponseFormat | None:
    """Check ``response_format``; None for text. Raises APIError 400 naming the field, also for a property neither
    OpenAI nor llama.cpp defines for the type (``response_format.foo``, ``response_format.json_schema.foo``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"'response_format' must be {_FORMS}", param="response_format")
    kind = value["type"]
    known = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema", "schema")}
    check_fields(value, known[kind], {}, "response_format.")
    if kind == "text":
        return None
    if "schema" in value:  # llama.cpp's forms: the schema at the top, no name
        if kind == "json_schema" and "json_schema" in value:
            raise APIError(400, "'response_format.schema' and 'response_format.json_schema' both give a schema: send "
                                "one (OpenAI's json_schema object or llama.cpp's schema)", param="response_format.schema")
        return ResponseFormat(kind, _schema(value["schema"], "response_format.schema"), param="response_format.schema")
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "'response_format.json_schema' must be an object {\"name\", \"schema\", \"strict\"} (or "
                            "give llama.cpp's 'response_format.schema')", param="response_format.json_schema")
    check_fields(spec, ("name", "description", "schema", "strict"), {}, "response_format.json_schema.")
    if "name" not in spec:  # required, as OpenAI and vLLM require it
        raise APIError(400, "'response_format.json_schema.name' is required: the schema's name, a non-empty string",
                       param="response_format.json_schema.name")
    name = spec["name"]
    if not isinstance(name, str) or not name:
        raise APIError(400, "'response_format.json_schema.name' must be a non-empty string",
                       param="response_format.json_schema.name")
    schema = _schema(spec.get("schema", {}), "response_format.json_schema.schema")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(400, "'response_format.json_schema.strict' must be a boolean",
                       param="response_format.json_schema.strict")
    return ResponseFormat("json_schema", schema, name)


def _schema(schema, param: str) -> dict:
    if not isinstance(schema, dict):
        raise APIError(400, f"'{param}' must be a JSON schema object", param=param)
    return schema


def check_combination(fmt: ResponseFormat | None, tools: ToolRequest | None) -> None:
    """A JSON answer and a forced tool call cannot both hold: APIError 400 naming ``response_format``."""
    if fmt is not None and tools is not None and tools.forced is not None:
        raise APIError(400, f"'response_format' {fmt.kind} cannot be combined with 'tool_choice' "
                            f"{tools.choice if tools.choice != 'function' else 'naming a function'}: the answer is "
                            "a tool call", param="response_format")


def constraint_for(fmt: ResponseFormat | None, tools: ToolRequest | None, call_format: ToolCallFormat, tokenizer,
                   vocab_size: int, eos_token_ids) -> Constraint | None:
    """The request's output constraint, or None for free text: the response format's schema; a forced tool call
    (``required`` / named); with ``tool_choice: "auto"``, free text whose tool calls must be valid once begun
    (:meth:`ToolCallFormat.lazy_grammar`; None for a tokenizer llguidance cannot read or a format without a
    wrapper).

    Raises:
        APIError: 400 naming ``response_format...schema`` or ``tools[i].function.parameters`` (``tools`` when no
            single tool's schema is at fault) when the grammar library cannot compile the schema; 400 on ``response_format`` for a tokenizer llguidance cannot read.
    """
    auto = fmt is None and tools is not None and tools.choice == "auto"
    if fmt is None and (tools is None or (tools.forced is None and not auto)):
        return None
    try:
        tok = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
    except GrammarError as e:
        if auto:
            return None  # tool calls in text are still parsed, only not enforced
        param = "response_format" if fmt is not None else "tool_choice"
        raise APIError(400, f"'{param}' cannot be honoured: structured output is not available for this model ({e})",
                       param=param) from e
    try:
        if fmt is not None and fmt.schema is None:
            return Constraint.json_object(tok, vocab_size)
        if fmt is not None:
            return Constraint.json_schema(fmt.schema, tok, vocab_size, f"JSON schema {fmt.name!r}")
    except GrammarError as e:
        raise APIError(400, f"'{fmt.param}' cannot be enforced: {e}", param=fmt.param) from e
    if auto:  # free text, but a call that begins must be a valid call
        marker = call_format.begin.strip()
        special = bool(marker) and marker in getattr(tokenizer, "get_added_vocab", dict)()
        source = call_format.lazy_grammar(tools.tools, special)
        if source is None:
            return None
        try:
            return Constraint.lark(source, tok, vocab_size, f"{call_format.name} tool calls in text")
        except GrammarError as e:
            raise _tools_error(e, tools.tools, tools.tools, tok, vocab_size) from e
    try:
        # a named function is called once (as OpenAI and vLLM do); required: one or more with parallel_tool_calls
        parallel = tools.parallel and tools.choice == "required"
        return Constraint.lark(call_format.grammar(tools.forced, parallel), tok, vocab_size,
                               f"{call_format.name} tool call")
    except GrammarError as e:
        raise _tools_error(e, tools.forced, tools.tools, tok, vocab_size) from e


def _tools_error(e: GrammarError, compiled: list[dict], tools: list[dict], tok, vocab_size: int) -> APIError:
    """The 400 for a tool-call grammar that did not compile: ``param`` ``tools[i].function.parameters`` for the
    first of the ``compiled`` tools whose parameters schema fails alone (``i``: its index in the request's
    ``tools``), else ``tools``."""
    for t in compiled:
        if t.get("parameters") is None:
            continue
        try:
            Constraint.json_schema(t["parameters"], tok, vocab_size, f"parameters of {t['name']!r}")
        except GrammarError as alone:
            where = f"tools[{tools.index(t)}].function.parameters"
            return APIError(400, f"'{where}' cannot be enforced: {alone}", param=where)
    return APIError(400, f"the tools' parameters cannot be enforced: {e}", param="tools")
