"""OpenAI's Responses API on ``redraft serve``: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

A request is a chat completion in other words: ``instructions`` become a system message, ``input`` (a string, or
message items ``{"role", "content"}`` whose content is a string or ``input_text``/``output_text`` parts) the
conversation, ``max_output_tokens`` the token cap; ``temperature``, ``top_p`` and ``seed``/``top_k`` as in chat.
It runs through the same checks, queue, engine and corpus as ``/v1/chat/completions`` (identical output).

``previous_response_id`` continues a stored response: its conversation (input and output, not its
``instructions``, as OpenAI documents) comes before the new input. Responses are stored per tenant (a tenant can
only continue its own), the newest :data:`MAX_STORED` per tenant (older ones are forgotten: continuing them is a
400); ``store: false`` keeps a response out of the store. ``stream: true`` sends OpenAI's typed events
(``response.created``, ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``), each ``event: TYPE`` + ``data: JSON`` with a
``sequence_number``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import as_api_error, refused
from .generation import Outcome
from .openapi import request_body, route
from .responses import cached_tokens, stats
from .scheduler import Job, QueueFull, ShuttingDown
from .schemas import APIError, WholeInt, parse_request

MAX_STORED = 1000  # stored responses per tenant


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class InputPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class InputItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class ResponsesBody(_Strict):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: WholeInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: WholeInt | None = None
    seed: WholeInt | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto"] | None = None


class Store:
    """The newest ``cap`` responses of each tenant: id -> (conversation messages incl. the answer, response)."""

    def __init__(self, cap: int = MAX_STORED) -> None:
        self.cap = cap
        self.by_tenant: dict[str, OrderedDict[str, tuple[list[dict], dict]]] = {}

    def get(self, tenant: str, rid: str) -> tuple[list[dict], dict] | None:
        return self.by_tenant.get(tenant, OrderedDict()).get(rid)

    def put(self, tenant: str, rid: str, conversation: list[dict], response: dict) -> None:
        d = self.by_tenant.setdefault(tenant, OrderedDict())
        d[rid] = (conversation, response)
        while len(d) > self.cap:
            d.popitem(last=False)


def _parse(body: dict) -> ResponsesBody:
    try:
        return ResponsesBody.model_validate(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # of a union's branches, the one that got furthest
        loc = [x for x in err["loc"] if not (isinstance(x, str) and x.startswith(("str", "list[")))]
        path = "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unrecognized request argument: '{path}'", param=path,
                           code="unrecognized_parameter") from None
        raise APIError(400, f"'{path}': {err['msg'].lower()}", param=path or None) from None


def _messages(req: ResponsesBody) -> list[dict]:
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "'input' is empty: send text or at least one message", param="input")
    out = []
    for it in items:
        text = it.content if isinstance(it.content, str) else "".join(p.text for p in it.content)
        out.append({"role": it.role, "content": text})
    return out


def _response(rid: str, model: str, req: ResponsesBody, status: str, text: str | None, out: Outcome | None,
              msg_id: str) -> dict:
    output = [] if text is None else [{"type": "message", "id": msg_id, "status": status, "role": "assistant",
                                       "content": [{"type": "output_text", "text": text, "annotations": [],
                                                    "logprobs": []}]}]
    usage = None
    if out is not None:
        p, c = len(out.result.prompt_ids), len(out.result.output_ids)
        usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached_tokens(out)},
                 "output_tokens": c,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
    incomplete = {"reason": "max_output_tokens"} if out is not None and out.finish_reason == "length" else None
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature if req.temperature is not None else 0.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "store": req.store is not False,
            "metadata": req.metadata or {}, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage, "user": req.user}


def add_routes(app: FastAPI, server) -> None:
    """The routes on ``app``; ``server`` is the :class:`redraft.server.app.Server` (checks, scheduler, ids)."""
    store = Store()

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesBody), **route("response"))
    async def create(request: Request):
        tenant = server.tenant(request)
        req = _parse(await server.body(request))
        name = server.model_name(req.model)
        if req.tools:
            raise APIError(400, "'tools' is not supported by /v1/responses in redraft", param="tools",
                           code="unsupported_parameter")
        if req.text and req.text.get("format", {"type": "text"}) != {"type": "text"}:
            raise APIError(400, "only the text format is supported", param="text.format",
                           code="unsupported_parameter")
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = store.get(tenant, req.previous_response_id)
            if prev is None:
                raise APIError(400, f"previous response '{req.previous_response_id}' not found (responses are "
                                    f"kept per API key, the newest {store.cap}; store: false ones not at all)",
                               param="previous_response_id", code="previous_response_not_found")
            history = list(prev[0])
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history \
            + _messages(req)
        chat = {"messages": messages}
        for field, key in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("top_k", "top_k"), ("seed", "seed")):
            if getattr(req, field) is not None:
                chat[key] = getattr(req, field)
        try:
            parsed = parse_request(chat, "chat")
            work = server.works(parsed)[0]  # the context checks: max_output_tokens beyond the room left is a 400
        except APIError as e:
            if e.param == "max_tokens":
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
            elif e.param == "messages":  # the conversation: instructions, previous responses and input
                e.param, e.message = "input", e.message.replace("the messages encode", "the input encodes")
            raise
        job = Job(tenant=tenant, payload=work, loop=asyncio.get_running_loop(), kv_tokens=work.kv_tokens)
        request.state.job = job  # for the access log
        try:
            server.scheduler.submit(job)
        except (QueueFull, ShuttingDown) as e:
            raise refused(e) from e
        rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        conversation = [m for m in messages if not (req.instructions and m is messages[0])]

        def finish(out: Outcome) -> dict:
            body = _response(rid, name, req, "completed" if out.finish_reason == "stop" else "incomplete", out.text,
                             out, msg_id)
            body["redraft"] = stats(job, out)
            if req.store is not False:
                store.put(tenant, rid, conversation + [{"role": "assistant", "content": out.text}], body)
            return body

        if req.stream:
            return StreamingResponse(_events(job, req, rid, name, msg_id, finish), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return JSONResponse(finish(value))
                if kind == "aborted":
                    return JSONResponse({}, status_code=499)
                if kind == "error":
                    raise as_api_error(value)
        finally:
            job.cancel.set()

    @app.get("/v1/responses/{response_id}", **route("stored response"))
    async def retrieve(response_id: str, request: Request):
        got = store.get(server.tenant(request), response_id)
        if got is None:
            raise APIError(404, f"response '{response_id}' not found", param="response_id")
        return got[1]


async def _events(job: Job, req: ResponsesBody, rid: str, name: str, msg_id: str, finish):
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    shell = _response(rid, name, req, "in_progress", None, None, msg_id)
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.content_part.added", part=part, **where)
        while True:
            kind, value = await job.events.get()
            if kind == "logprobs":  # not asked for by this API's requests
                continue
            if kind == "delta":
                yield event("response.output_text.delta", delta=value, logprobs=[], **where)
                continue
            if kind == "done":
                body = finish(value)
                done_part = body["output"][0]["content"][0]
                yield event("response.output_text.done", text=value.text, logprobs=[], **where)
                yield event("response.content_part.done", part=done_part, **where)
                yield event("response.output_item.done", output_index=0, item=body["output"][0])
                yield event("response.completed" if body["status"] == "completed" else "response.incomplete",
                            response=body)
            elif kind == "error":
                err = as_api_error(value)
                yield event("error", code=err.code, message=err.message, param=err.param)
            break
    finally:
        job.cancel.set()
