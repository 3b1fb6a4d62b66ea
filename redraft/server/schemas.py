"""OpenAI request bodies: parse, type-check and range-check ``/v1/completions`` and ``/v1/chat/completions``.

Every field the OpenAI API defines is either supported, accepted only at its no-op value (``best_of: 1``,
``frequency_penalty: 0``, ``tools: []``, ...), or refused with a 400 that names it: a request is never
answered as if a field it relies on had been honoured. Fields the API does not define are refused the same way,
except redraft's extensions ``top_k`` (0 or -1 = off) and ``repetition_penalty`` (1 = off).
Status codes: every invalid request is a 400 ``invalid_request_error`` naming the field in ``param`` (OpenAI's
convention; never 422). Whole-number floats are integers (JSON Schema's rule: ``"max_tokens": 4.0`` is 4).
The body's JSON itself (depth, Unicode, numbers too large to hold) is checked by :mod:`redraft.server.jsonbody`.

Unlike OpenAI's default of 1.0, ``temperature`` defaults to 0 (greedy): the same request then gives the same
answer and replays from the corpus. With temperature > 0 and no ``seed``, a random seed is drawn and reported in
the response's ``redraft`` field, so the sample can be reproduced.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from redraft.decoding.sampling import SamplingParams


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``message``, ``type`` and the offending ``param`` (or None);
    ``headers``: extra response headers (``Retry-After`` on a 429), or None."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """The JSON body; lone surrogates (from a field name the client sent) are written as ``\\udXXX`` text,
        since a JSON response must be valid UTF-8."""
        return {"error": {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
                          "code": self.code}}


def _printable(s: str | None) -> str | None:
    return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- which fields exist ------------------------------------------------------------------------------------------
_NONE = (None,)
# accepted only at these values (the ones that change nothing); any other value is a 400 naming the field
_NOOP_COMMON: dict[str, tuple] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
}
_NOOP_COMPLETION = {**_NOOP_COMMON, "best_of": (None, 1), "suffix": _NONE}
_NOOP_CHAT = {**_NOOP_COMMON, "functions": (None, []), "function_call": (None, "none"),
              "store": (None, False), "modalities": (None, ["text"]),
              "audio": _NONE, "prediction": _NONE, "reasoning_effort": _NONE, "verbosity": _NONE,
              "web_search_options": _NONE, "service_tier": (None, "auto", "default")}
# a chat message's own OpenAI fields that redraft does not use (the openai client's message.model_dump() sends them)
_NOOP_MESSAGE = {"refusal": _NONE, "annotations": (None, []), "audio": _NONE, "function_call": _NONE}
NOOP_FIELDS = {"CompletionBody": _NOOP_COMPLETION, "ChatBody": _NOOP_CHAT, "Message": _NOOP_MESSAGE}
"""Per request model: the OpenAI fields accepted only at the values that change nothing (the served OpenAPI
document lists them with those values)."""


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions limit
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit
MAX_CHOICES = 128  # prompts x n per request
_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP_STRINGS = 4  # OpenAI's limit on 'stop'


def _whole(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


WholeInt = Annotated[int, BeforeValidator(_whole)]
"""An integer field that also takes a whole-number float (``4.0``), as JSON Schema's ``integer`` does."""
TokenId = Annotated[int, BeforeValidator(_whole), WithJsonSchema({"type": "integer", "minimum": 0})]
"""A token id (a :data:`WholeInt`; the vocabulary check, with its message, comes after parsing)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _doc(**schema: Any) -> Any:
    """An optional field (default None) whose JSON Schema states ``schema`` (ranges, sizes), for the served
    OpenAPI document only: the checks below (:func:`parse_request`) enforce them with OpenAI's messages."""
    return Field(default=None, json_schema_extra=schema)


_INT64 = {"minimum": -2 ** 63, "maximum": 2 ** 63 - 1}


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: WholeInt | None = _doc(minimum=0)
    n: WholeInt | None = _doc(minimum=1, maximum=MAX_CHOICES)
    temperature: float | None = _doc(minimum=0, maximum=2)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    seed: WholeInt | None = _doc(**_INT64)
    stop: str | list[str] | None = _doc(minLength=1, maxItems=MAX_STOP_STRINGS, items={"minLength": 1})
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    top_k: WholeInt | None = _doc(minimum=-1)
    repetition_penalty: float | None = _doc(exclusiveMinimum=0)
    user: str | None = None  # an end-user id for the caller's own records; no effect on output
    response_format: dict | None = None  # checked by server/structured.py


class CompletionBody(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(json_schema_extra={"minLength": 1,
                                                                                          "minItems": 1})
    logprobs: WholeInt | None = _doc(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None


class TextPart(_Strict):
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None


class Message(_Strict):
    # content is required unless the turn carries tool_calls (then it may be null or absent); tool_calls only on
    # assistant turns; a tool turn names the call it answers
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}, {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}}],
        "allOf": [{"if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"]}},
                  {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
                   "then": {"properties": {"tool_calls": {"type": "null"}}}}]})
    role: str = Field(json_schema_extra={"enum": sorted(_ROLES)})
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant turns (checked by server/tools.py)
    tool_call_id: str | None = None  # tool turns


class ChatBody(_Common):
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    max_tokens: WholeInt | None = _doc(minimum=1)
    max_completion_tokens: WholeInt | None = _doc(minimum=1)
    logprobs: bool | None = None
    top_logprobs: WholeInt | None = _doc(minimum=0, maximum=MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None  # stored-completion tags; no effect on output
    prompt_cache_key: str | None = None  # a cache routing hint; no effect on output
    safety_identifier: str | None = None  # an end-user id; no effect on output
    # tool calling and structured output: shapes checked here, contents by server/tools.py and server/structured.py
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


_EXPECTED = {"prompt": "a string, a list of token ids, or a list holding one of those", "messages":
             "a list of {role, content} objects", "stop": "a string or a list of strings",
             "stream_options": "an object like {\"include_usage\": true}", "metadata": "an object of strings"}
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)  # OpenAI's seed is an int64


@dataclass
class ParsedRequest:
    """A valid request.

    Attributes:
        kind: "completion" or "chat". model: the requested model id (None = the served one).
        prompt: text or token ids (completions; the first of ``prompts``). prompts: every prompt of the request
            (several give several choices). messages: [{role, content}] with text content (chat).
        max_tokens: the cap asked for (None = the endpoint's default). sampling: :class:`SamplingParams`.
        stop: stop strings. stream, include_usage: SSE streaming, and a final usage chunk in it.
        tools, tool_choice, parallel_tool_calls: the chat fields as sent (None = not sent); response_format:
            as sent on either endpoint. The server checks them with :func:`redraft.server.tools.parse_tools` and
            :func:`redraft.server.structured.parse_response_format`.
        n: choices per prompt. logprobs: None, or how many alternatives per token to report with each token's
            log-probability (completions ``logprobs``; chat ``top_logprobs`` when ``logprobs`` is true).
        echo: completions only: the choice's text (and logprobs) begin with the prompt's.
    """

    kind: Literal["completion", "chat"]
    model: str | None
    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the cap came from (chat: max_completion_tokens wins)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    echo: bool = False


def check_fields(obj: dict, known, noop: dict[str, tuple], prefix: str) -> None:
    """APIError 400 for a field of ``obj`` that is neither ``known`` nor in ``noop`` at one of its no-op values;
    ``prefix`` (``"messages[0]."``) leads the field's name in the error's ``param``."""
    for name, value in obj.items():
        if name in known:
            continue
        param = f"{prefix}{name}"
        if name in noop:
            if not any(_same(value, ok) for ok in noop[name]):
                allowed = " or ".join(json.dumps(v) for v in noop[name])
                raise APIError(400, f"'{param}' is not supported by redraft (only {allowed} is accepted)",
                               param=param, code="unsupported_parameter")
            continue
        raise APIError(400, f"unrecognized request argument: '{param}'", param=param, code="unrecognized_parameter")


def check_message_fields(messages: Any) -> None:
    """Refuse (APIError 400 naming ``messages[i].field``) a chat message field OpenAI does not define; OpenAI's
    own message fields that redraft does not use (``refusal``, ``annotations``, ``audio``, ``function_call``) are
    accepted at their empty values (null; ``[]`` for annotations). Anything but a list of objects is left to the
    type check. Source: OpenAI's chat completions request message objects."""
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            check_fields(m, Message.model_fields, _NOOP_MESSAGE, f"messages[{i}].")


def parse_request(body: dict, kind: Literal["completion", "chat"]) -> ParsedRequest:
    """Check a decoded body field by field. Raises APIError 400 (unsupported, out of range or wrong type)."""
    model_cls, noop = (CompletionBody, _NOOP_COMPLETION) if kind == "completion" else (ChatBody, _NOOP_CHAT)
    check_fields(body, model_cls.model_fields, noop, "")
    if kind == "chat":
        check_message_fields(body.get("messages"))
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise _type_error(e, body) from None
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    max_tokens = req.max_tokens
    if kind == "chat" and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    echo = kind == "completion" and bool(req.echo)
    param = "max_completion_tokens" if kind == "chat" and req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        also = " (0 only with 'echo')" if kind == "completion" else ""
        raise APIError(400, f"'{param}' must be at least 1{also}, got {max_tokens}", param=param)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                       param="stop")
    if any(s == "" for s in stop):  # an empty string would match everywhere; vLLM refuses it too
        raise APIError(400, "'stop' strings must be non-empty", param="stop")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"'n' must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    logprobs = _logprobs(req, kind)
    if stream and logprobs is not None and echo:
        raise APIError(400, "'echo' with 'logprobs' (prompt scoring) is not supported with 'stream' by redraft",
                       param="echo", code="unsupported_parameter")
    out = ParsedRequest(kind=kind, model=req.model, sampling=_sampling(req), max_tokens=max_tokens,
                        max_tokens_param=param, stop=stop, stream=stream,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        n=n, logprobs=logprobs, echo=echo, response_format=req.response_format)
    if kind == "completion":
        out.prompts = _prompts(req.prompt)
        out.prompt = out.prompts[0]
        if len(out.prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(out.prompts)} prompts x n={n} choices exceed the limit of {MAX_CHOICES} "
                                "choices per request", param="n")
    else:
        out.messages = _messages(req.messages)
        out.tools, out.tool_choice = req.tools, req.tool_choice
        if n > 1 and req.tools and req.tool_choice != "none":
            raise APIError(400, "'n' > 1 with 'tools' is not supported by redraft (one choice per tool-calling "
                                "request)", param="n", code="unsupported_parameter")
        out.parallel_tool_calls = req.parallel_tool_calls
    return out


def _sampling(req: _Common) -> SamplingParams:
    def check(name, value, ok: bool, expected: str):
        if value is not None and not (ok and math.isfinite(value)):
            raise APIError(400, f"'{name}' must be {expected}, got {value}", param=name)

    t, p, k, rp = req.temperature, req.top_p, req.top_k, req.repetition_penalty
    check("temperature", t, t is not None and 0 <= t <= 2, "between 0 and 2")
    check("top_p", p, p is not None and 0 < p <= 1, "in (0, 1]")
    check("top_k", k, k is not None and k >= -1, "-1 or 0 (off) or a positive integer")
    check("repetition_penalty", rp, rp is not None and rp > 0, "greater than 0")
    temperature = t or 0.0
    seed = req.seed
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise APIError(400, f"'seed' must be a 64-bit signed integer (between {SEED_RANGE[0]} and "
                            f"{SEED_RANGE[1]}), got {seed}", param="seed")
    if seed is None:
        seed = secrets.randbits(63) if temperature > 0 else 0
    return SamplingParams(temperature=temperature, top_k=max(0, k or 0), top_p=p if p is not None else 1.0,
                          repetition_penalty=rp if rp is not None else 1.0, seed=seed)


def _logprobs(req: _Common, kind: str) -> int | None:
    """Alternatives per token to report, or None: completions' ``logprobs`` (0..5), chat's ``top_logprobs`` (0..20,
    with ``logprobs: true``)."""
    if kind == "completion":
        k = req.logprobs
        if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {k}",
                           param="logprobs")
        return k
    k = req.top_logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}",
                       param="top_logprobs")
    if not req.logprobs:
        if k:
            raise APIError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
        return None
    return k or 0


def _prompts(prompt) -> list[str | list[int]]:
    """One prompt (text or ids) or a list of them -> the list; each must be non-empty."""
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for i, p in enumerate(prompts):
        if len(p) == 0:
            where = "'prompt'" if len(prompts) == 1 else f"'prompt[{i}]'"
            raise APIError(400, f"{where} is empty", param="prompt")
    return prompts


def _messages(messages: list[Message]) -> list[dict]:
    if not messages:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported (expected one of "
                                f"{', '.join(sorted(_ROLES))})", param=f"messages[{i}].role")
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].tool_calls is only allowed on assistant messages",
                           param=f"messages[{i}].tool_calls")
        if m.content is None and not m.tool_calls:
            raise APIError(400, f"messages[{i}].content is missing (null is allowed only beside tool_calls)",
                           param=f"messages[{i}].content")
        if m.content is None:
            text = None
        elif isinstance(m.content, str):
            text = m.content
        else:
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}] of type {part.type!r} is not supported "
                                        "(text parts only)", param=f"messages[{i}].content")
            text = "".join(part.text for part in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, f"messages[{i}].tool_call_id is required on tool messages (the id of the "
                                    "assistant's tool call this message answers)", param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _type_error(e: ValidationError, body: dict) -> APIError:
    err = e.errors()[0]
    loc = [x for x in err["loc"] if isinstance(x, int) or x in body or x in ("role", "content", "type", "text",
                                                                              "include_usage", "name")]
    top = str(err["loc"][0])
    path = top + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
    if err["type"] == "missing":
        return APIError(400, f"'{path}' is required", param=path)
    if top in _EXPECTED and len(loc) <= 1:
        return APIError(400, f"'{top}' must be {_EXPECTED[top]} (got {type_name(body.get(top))})", param=top)
    return APIError(400, f"'{path}': {err['msg'].lower()} (got {type_name(err.get('input'))})", param=path)


def _same(value: Any, ok: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same number, but false is not 0 and null is only null."""
    if ok is None or value is None or isinstance(ok, bool) or isinstance(value, bool):
        return type(value) is type(ok) and value == ok
    return value == ok


def type_name(v: Any) -> str:
    """How an error names a decoded JSON value's type (``"a list"``, ``"null"``)."""
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)
