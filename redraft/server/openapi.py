"""The served OpenAPI document (``/openapi.json``, ``/docs``): every route's request and response models.

Request bodies are parsed by hand (:mod:`redraft.server.schemas`) so that every error is OpenAI's 400 with
``param``, so FastAPI cannot infer them from the handlers' signatures: each route declares its body model here
(``openapi_extra``) and :func:`install` adds those models' JSON Schemas to the document's components. Response
models are documentation only (``responses=``): the handlers' bodies are not re-validated.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .schemas import ChatBody, CompletionBody

_BODIES: dict[str, type[BaseModel]] = {}


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


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
    redraft: dict[str, Any]


class ChatMessageOut(_Open):
    role: str
    content: str | None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
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
    redraft: dict[str, Any]


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


_ERRORS = {400: {"model": ErrorResponse, "description": "invalid request (``param`` names the field)"},
           401: {"model": ErrorResponse, "description": "missing or unknown API key"}}
_GEN_ERRORS = {**_ERRORS, 404: {"model": ErrorResponse, "description": "unknown model"},
               413: {"model": ErrorResponse, "description": "request body too large"},
               429: {"model": ErrorResponse, "description": "queue full (``Retry-After``: seconds)"},
               503: {"model": ErrorResponse, "description": "shutting down"}}


def request_body(model_cls: type[BaseModel]) -> dict:
    """``openapi_extra`` naming ``model_cls`` as the JSON request body (its schema joins the components)."""
    _BODIES[model_cls.__name__] = model_cls
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model_cls.__name__}"}}}}}


def route(name: str) -> dict:
    """Decorator keywords (summary, body, responses) for one of the API's routes."""
    if name == "completion":
        return {"summary": "Text completion (OpenAI's legacy completions)", "openapi_extra": request_body(
            CompletionBody), "responses": {200: {"model": CompletionResponse}, **_GEN_ERRORS}}
    if name == "chat":
        return {"summary": "Chat completion", "openapi_extra": request_body(ChatBody),
                "responses": {200: {"model": ChatCompletionResponse}, **_GEN_ERRORS}}
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
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
