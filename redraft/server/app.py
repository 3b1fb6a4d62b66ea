"""FastAPI routes of ``redraft serve``: OpenAI completions and chat completions, models, health, metrics.

Each generation request is checked (auth 401, body 400/413/422, model 404, context 413/400), queued (503 when
full), generated on the scheduler's thread and returned whole or streamed as server-sent events in OpenAI's chunk
format, ending with ``data: [DONE]``. Every response carries the request's speculation statistics in a
``redraft`` field. Errors are OpenAI-style bodies ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from redraft.io.prompts import encode_prompt, uses_chat_template

from .access_log import AccessLog
from .generation import Generator, Outcome, Work
from .metrics import ServerMetrics
from .options import ServerOptions
from .scheduler import Cancelled, Job, QueueFull, Scheduler, ShuttingDown
from .schemas import APIError, ParsedRequest, parse_json, parse_request
from .structured import check_combination, constraint_for, parse_response_format
from .tenants import Tenants
from .toolcalls import DEFAULT_FORMAT, FORMATS
from .tools import encode_chat, history_calls, parse_tools

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
NO_CONTEXT_LIMIT = 32768  # max_tokens cap for a model that does not state its context length
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Server:
    """Everything one server needs; :meth:`app` builds the FastAPI application around it.

    Args:
        generator: runs jobs (model, tokenizer, corpora, draft settings).
        tenants: API keys. model_id: the served model's id (``model`` in requests and responses).
        max_queue: most waiting requests (503 beyond). max_body: most request body bytes (413 beyond).
        options: :class:`~redraft.server.options.ServerOptions` (access log, CORS, chat's default max_tokens).
        tool_call_parser: how the model writes tool calls (a key of :data:`redraft.server.toolcalls.FORMATS`).
    """

    def __init__(self, generator: Generator, tenants: Tenants, model_id: str, *, max_queue: int = 256,
                 max_body: int = 8 << 20, options: ServerOptions | None = None,
                 tool_call_parser: str = DEFAULT_FORMAT) -> None:
        self.generator, self.tenants, self.model_id, self.max_body = generator, tenants, model_id, max_body
        self.options = options or ServerOptions()
        self.tool_format = FORMATS[tool_call_parser]
        self.metrics = ServerMetrics(model_id)
        self.scheduler = Scheduler(self._run, max_queue=max_queue, on_queue=self.metrics.waiting.set)
        self.created = int(time.time())
        generator.on_learned = self._corpus_gauges
        for t in generator.corpora.learned:
            self._corpus_gauges(t)

    # ---- generation thread ---------------------------------------------------------------------------------
    def _run(self, job: Job, emit) -> Outcome:
        """The scheduler's runner: generate, then count it (here, so a client leaving cannot skip the count)."""
        self.metrics.running.set(1)
        self.metrics.queue_time.observe(job.queue_seconds)
        try:
            out = self.generator(job, emit)
        except Cancelled as e:
            self.metrics.finished(None, "abort")
            self.metrics.generation_tokens.inc(e.emitted)
            raise
        finally:
            self.metrics.running.set(0)
        self.metrics.finished(out.result, out.finish_reason)
        if self.generator.prefix_cache is not None:
            self.metrics.prefix_cache(out.result, self.generator.prefix_cache)
        self.metrics.latency.observe(time.perf_counter() - job.arrived)
        if job.first_token is not None:
            self.metrics.ttft.observe(job.first_token - job.arrived)
        return out

    def _corpus_gauges(self, tenant: str) -> None:
        c = self.generator.corpora.get(tenant)
        if c is not None:
            self.metrics.corpus(tenant, c.n_tokens, c.n_spans, c.evicted_spans)

    # ---- request checks -------------------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        t = self.tenants.resolve(request.headers.get("authorization"))
        if t is None:
            raise APIError(401, "missing or unknown API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        request.state.tenant = t  # for the access log
        return t

    async def body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {self.max_body}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise APIError(413, f"the request body exceeds the limit of {self.max_body} bytes")
        return parse_json(bytes(raw))

    def work(self, req: ParsedRequest) -> Work:
        """Prompt ids and the token cap, checked against the vocabulary and the context length."""
        if req.model is not None and req.model != self.model_id:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")
        tools, fmt = self._structure(req)
        ids = self._prompt_ids(req, tools)
        ctx = self.generator.context_length
        room = ctx - len(ids) if ctx else NO_CONTEXT_LIMIT
        if ctx and room <= 0:
            what = "messages" if req.kind == "chat" else "prompt"
            raise APIError(413, f"the {what} encode to {len(ids)} tokens; this model's context is {ctx} tokens "
                                "(prompt + max_tokens must fit)", param=what, code="context_length_exceeded")
        max_tokens = req.max_tokens
        if max_tokens is None:
            default = DEFAULT_COMPLETION_TOKENS if req.kind == "completion" else self.options.max_tokens_default
            max_tokens = room if default is None else min(default, room)
        if max_tokens > room:
            where = f"this model's context of {ctx} tokens" if ctx else f"the limit of {NO_CONTEXT_LIMIT} tokens"
            raise APIError(400, f"'max_tokens' {max_tokens} is too large: the prompt's {len(ids)} tokens plus "
                                f"{max_tokens} exceed {where} (at most {room} here)", param="max_tokens",
                           code="context_length_exceeded")
        sampling = req.sampling
        g = self.generator
        constraint = constraint_for(fmt, tools, self.tool_format, g.tokenizer, g.vocab_size, g.eos)
        if constraint is not None:
            sampling = dataclasses.replace(sampling, constraint=constraint)
        return Work(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=req.stop,
                    tool_calls=self.tool_format if tools is not None and tools.calls_possible else None,
                    single_call=tools is not None and not tools.parallel)

    def _structure(self, req: ParsedRequest):
        """The request's tools (:class:`~redraft.server.tools.ToolRequest` or None) and response format
        (:class:`~redraft.server.structured.ResponseFormat` or None), checked; the history's tool calls checked."""
        if req.kind != "chat":
            return None, None
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        fmt = parse_response_format(req.response_format)
        check_combination(fmt, tools)
        for i, m in enumerate(req.messages):
            if m.get("tool_calls"):
                m["tool_calls"] = history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        return tools, fmt

    def _prompt_ids(self, req: ParsedRequest, tools=None) -> list[int]:
        tok = self.generator.tokenizer
        if req.kind == "chat":
            if not uses_chat_template(tok):
                raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
            try:
                if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in req.messages):
                    ids = encode_chat(tok, req.messages, tools, self.tool_format)
                else:
                    ids = encode_prompt(tok, req.messages, chat=True)
            except Exception as e:  # jinja raises for conversations its template refuses (roles out of order...)
                raise APIError(400, f"the chat template refused these messages ({e})", param="messages") from e
        elif isinstance(req.prompt, str):
            ids = encode_prompt(tok, req.prompt, chat=False)
        else:
            vocab = self.generator.vocab_size
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"'prompt' token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
            ids = req.prompt
        ids = [int(i) for i in ids]
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    # ---- responses ------------------------------------------------------------------------------------------
    async def generate(self, request: Request, kind: str):
        tenant = self.tenant(request)
        req = parse_request(await self.body(request), kind)
        job = Job(tenant=tenant, payload=self.work(req), loop=asyncio.get_running_loop())
        request.state.job = job  # for the access log
        try:
            self.scheduler.submit(job)
        except (QueueFull, ShuttingDown) as e:
            raise APIError(503, str(e), code="overloaded" if isinstance(e, QueueFull) else "shutting_down") from e
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._sse(job, req, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            outcome = await _final(job)
        finally:
            watcher.cancel()
            job.cancel.set()  # no-op once finished; stops the generation if this handler is torn down early
        if outcome is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(_body(req, rid, self.model_id, job, outcome))

    async def _sse(self, job: Job, req: ParsedRequest, rid: str):
        chat = req.kind == "chat"
        created = int(time.time())

        def chunk(text: str | None, finish: str | None = None, role: bool = False, calls=None, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                if calls:
                    delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return _event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": self.model_id, "choices": [choice], **extra})

        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    yield chunk(value)
                    continue
                if kind == "done":
                    if value.tool_calls:
                        yield chunk(None, calls=value.tool_calls)
                    yield chunk(None, value.finish_reason, redraft=_stats(job, value))
                    if req.include_usage:
                        yield _event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                      "created": created, "model": self.model_id, "choices": [],
                                      "usage": _usage(value)})
                elif kind == "error":
                    yield _event(_error(value).body())
                break  # done, error, or aborted (the client is gone)
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # the client left mid-stream: stop the generation at its next step

    def health(self) -> dict:
        s = self.scheduler
        return {"status": "ok", "model": self.model_id, "running": s.current is not None, "queue": s.waiting,
                "oldest_wait_seconds": round(s.oldest_wait(), 3)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "redraft",
                                            "max_model_len": self.generator.context_length}]}

    # ---- application ----------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        """The ASGI application (starts the generation thread at startup, stops it and closes corpora at exit)."""
        @asynccontextmanager
        async def lifespan(_app):
            self.scheduler.start()
            try:
                yield
            finally:
                await asyncio.to_thread(self.scheduler.stop)
                self.generator.corpora.close()

        app = FastAPI(title="redraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(_request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def http_error(request, e: HTTPException):
            msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
            return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code)

        @app.exception_handler(Exception)
        async def unexpected(_request, e: Exception):
            return JSONResponse(_error(e).body(), status_code=500)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.generate(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.generate(request, "chat")

        @app.get("/v1/models")
        async def models(request: Request):
            self.tenant(request)
            return self.models()

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request):
            self.tenant(request)
            if model_id != self.model_id:
                raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
            return self.models()["data"][0]

        @app.get("/health")
        async def health():
            return self.health()

        @app.get("/metrics")
        async def metrics():
            for t in self.generator.corpora.learned:  # evictions happen in the background: read sizes now
                self._corpus_gauges(t)
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        if self.options.cors_origins:
            app.add_middleware(CORSMiddleware, allow_origins=self.options.cors_origins, allow_methods=["*"],
                               allow_headers=["*"], expose_headers=["x-request-id"])
        return AccessLog(_CountRequests(app, self.metrics), enabled=self.options.access_log)


class _CountRequests:
    """ASGI middleware counting responses by endpoint and status (pure ASGI: streaming and disconnects pass
    through untouched, which Starlette's BaseHTTPMiddleware does not guarantee)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.http_request(path if path in ENDPOINTS else "other", status[0])


async def _final(job: Job) -> Outcome | None:
    """Wait for the end of a job: its Outcome, None when aborted; an error event is raised as APIError."""
    while True:
        kind, value = await job.events.get()
        if kind == "done":
            return value
        if kind == "aborted":
            return None
        if kind == "error":
            raise _error(value)


async def _watch_disconnect(request: Request, job: Job, every: float = 0.1) -> None:
    """Set ``job.cancel`` when the client of a non-streaming request goes away."""
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.cancel.set()
            return
        await asyncio.sleep(every)


def _error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down")
    return APIError(500, f"internal error ({type(e).__name__}: {e})")


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(out: Outcome) -> dict:
    p, c = len(out.result.prompt_ids), len(out.result.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _stats(job: Job, out: Outcome) -> dict[str, Any]:
    """The ``redraft`` extension field: this request's speculation statistics and timings."""
    res = out.result
    return {"tokens_per_forward": round(res.tokens_per_forward, 4), "forwards": res.forwards,
            "sources": {name: st.to_dict(digits=4) for name, st in res.sources.items()},
            "queue_seconds": round(job.queue_seconds, 4), "generation_seconds": round(res.seconds, 4),
            "tokens_per_second": round(res.tokens_per_second, 2), "learned": out.learned,
            "prefix_hit_tokens": res.prefix_hit_tokens,
            "seed": job.payload.sampling.seed}


def _body(req: ParsedRequest, rid: str, model_id: str, job: Job, out: Outcome) -> dict:
    if req.kind == "chat":
        message = {"role": "assistant", "content": out.text}
        if out.tool_calls:
            message = {"role": "assistant", "content": out.content, "tool_calls": out.tool_calls}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice], "usage": _usage(out),
            "redraft": _stats(job, out)}
