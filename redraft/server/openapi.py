"""The served OpenAPI document (``/openapi.json``, ``/docs``, ``/redoc``): every route's request and response models,
and the application whose documentation pages work without internet (:func:`application`).

Request bodies are parsed by hand (:mod:`redraft.server.schemas`) so that every error is OpenAI's 400 with
``param``, so FastAPI cannot infer them from the handlers' signatures: each route declares its body model here
(``openapi_extra``) and :func:`install` adds those models' JSON Schemas to the document's components. Response
models are documentation only (``responses=``): the handlers' bodies are not re-validated.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .schemas import NOOP_FIELDS, ChatBody, CompletionBody

_BODIES: dict[str, type[BaseModel]] = {}

# Where the documentation pages' scripts, stylesheet and icon are served (a static mount of fastapi-offline's files)
DOCS_STATIC = "/docs/static"


def application(**kwargs: Any) -> FastAPI:
    """``FastAPI(**kwargs)`` whose ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) load their scripts, stylesheet and
    icon from this server, under :data:`DOCS_STATIC`, instead of the CDN FastAPI's own pages name: on a machine
    without internet those pages stay blank. The files are the ``fastapi-offline`` package's copies of Swagger UI and
    ReDoc (a pinned dependency), so they change only with that package's version.

    ``/redoc`` is served here rather than by fastapi-offline so that it can forbid images from other hosts: ReDoc's
    side menu always loads Redocly's logo from Redocly's CDN, and with ``img-src 'self' data:`` the browser never asks
    for it (the menu shows the "API docs by Redocly" link without the image)."""
    app = FastAPIOffline(static_url=DOCS_STATIC, redoc_url=None, **kwargs)

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_STATIC}/favicon.png", with_google_fonts=False)
        page.headers["Content-Security-Policy"] = "img-src 'self' data:"
        return page

    return app


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Open):
    """Every error: ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


class PromptTokensDetails(_Open):
    cached_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SourceCounts(_Open):
    """One draft source's counts in a generation (``redraft.decoding.runstats.SourceStats.to_dict``)."""

    proposed: int
    accepted: int
    steps: int
    paused: int
    acceptance: float | None


class RedraftStats(_Open):
    """The ``redraft`` extension field: one generation's speculation statistics and timings (seconds).
    ``tokens_per_forward`` and ``tokens_per_second`` are null when no forward ran (an answer-cache hit); with
    several choices, ``choices`` holds each one's."""

    tokens_per_forward: float | None
    forwards: int
    sources: dict[str, SourceCounts]
    queue_seconds: float
    generation_seconds: float
    tokens_per_second: float | None
    learned: bool
    prefix_hit_tokens: int
    prefix_disk_tokens: int
    answer_cache_hit: bool
    seed: int | None
    choices: list[RedraftStats] | None = None


class LegacyLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Open):
    """``POST /v1/completions`` (``text_completion``); ``redraft`` holds speculation statistics."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    redraft: RedraftStats


class ToolCallFunction(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: str
    function: ToolCallFunction


class ChatMessageOut(_Open):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Open):
    """``POST /v1/chat/completions`` (``chat.completion``); ``redraft`` holds speculation statistics."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    redraft: RedraftStats


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class Health(_Open):
    status: str
    model: str
    running: int
    queue: int
    oldest_wait_seconds: float
    kv_tokens_used: int | None = None
    kv_tokens_capacity: int | None = None


class ResponseObject(_Open):
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` (OpenAI's Responses API ``response`` object)."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    redraft: RedraftStats | None = None


class _Chunk(_Open):
    """What every streamed chunk has: the last choice chunk adds ``redraft``; an ``include_usage`` stream ends
    with a chunk of no choices and ``usage``."""

    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None
    redraft: RedraftStats | None = None


class CompletionChunk(_Chunk):
    """One server-sent event of a streamed completion (``text_completion``)."""

    choices: list[CompletionChoice]  # a chunk's choice has a whole choice's fields


class ChatDelta(_Open):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(_Chunk):
    """One server-sent event of a streamed chat completion (``chat.completion.chunk``)."""

    choices: list[ChatChunkChoice]


class ResponseEvent(_Open):
    """One server-sent event of a streamed response (``response.created``, ``response.output_text.delta``, ...)."""

    type: str


_STREAMED = [CompletionChunk, ChatCompletionChunk, ResponseEvent]

_WHY = {400: "invalid request (``param`` names the field)", 401: "missing or unknown API key",
        404: "unknown model or object", 413: "request body too large",
        415: "the body is not sent as JSON (``Content-Type`` other than ``application/json``)",
        429: "queue full (``Retry-After``: seconds)", 503: "shutting down"}


def _sse(model: type[BaseModel]) -> dict:
    """With ``stream: true`` the 200 answer is server-sent events: each event's ``data`` is ``model`` as JSON (or
    an error object when the generation failed after the stream began), the last one ``[DONE]`` (described as
    OpenAPI 3.2 does: a schema per event, its data's JSON in ``contentSchema``)."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{model.__name__}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"anyOf": [{"type": "string", "enum": ["[DONE]"]},
                      {"type": "string", "pattern": "^[{]", "contentMediaType": "application/json",
                       "contentSchema": payload}]}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}


def error_responses(*codes: int) -> dict:
    """``responses=`` entries (:class:`ErrorResponse` bodies) for the given HTTP error codes (400 401 404 413 415
    429 503)."""
    return {code: {"model": ErrorResponse, "description": _WHY[code]} for code in codes}


_ERRORS = error_responses(400, 401)
_GEN_ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503)


def request_body(model_cls: type[BaseModel]) -> dict:
    """``openapi_extra`` naming ``model_cls`` as the JSON request body (its schema joins the components)."""
    _BODIES[model_cls.__name__] = model_cls
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model_cls.__name__}"}}}}}


def route(name: str) -> dict:
    """Decorator keywords (summary, body, responses) for one of the API's routes."""
    if name == "completion":
        return {"summary": "Text completion (OpenAI's legacy completions)", "openapi_extra": request_body(
            CompletionBody), "responses": {200: {"model": CompletionResponse, "content": _sse(CompletionChunk)}, **_GEN_ERRORS}}
    if name == "chat":
        return {"summary": "Chat completion", "openapi_extra": request_body(ChatBody),
                "responses": {200: {"model": ChatCompletionResponse, "content": _sse(ChatCompletionChunk)}, **_GEN_ERRORS}}
    if name == "response":
        return {"summary": "Create a response (OpenAI's Responses API)",
                "responses": {200: {"model": ResponseObject, "content": _sse(ResponseEvent)}, **_GEN_ERRORS}}
    if name == "stored response":
        return {"summary": "A stored response", "responses": {200: {"model": ResponseObject}, **_ERRORS,
                                                             404: {"model": ErrorResponse}}}
    if name == "models":
        return {"summary": "The served model ids", "responses": {200: {"model": ModelList}, **_ERRORS}}
    if name == "model":
        return {"summary": "One served model id", "responses": {200: {"model": ModelCard}, **_ERRORS,
                                                               404: {"model": ErrorResponse}}}
    if name == "health":
        return {"summary": "Liveness and queue state", "responses": {200: {"model": Health}}}
    if name == "metrics":
        return {"summary": "Prometheus metrics (text exposition format)",
                "responses": {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}}
    raise KeyError(name)


def install(app: FastAPI) -> None:
    """Serve the document with the request body models of :func:`request_body` in its components."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()]
                                         + [(m, "serialization") for m in _STREAMED],
                                         ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            for name, fields in NOOP_FIELDS.items():  # accepted at the values that change nothing; nothing else
                if name in schemas:
                    props = schemas[name].setdefault("properties", {})
                    for field, values in fields.items():
                        props.setdefault(field, {"enum": list(values), "description": "accepted only at these "
                                                 "values (redraft does not use it)"})
                    schemas[name]["additionalProperties"] = False
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
