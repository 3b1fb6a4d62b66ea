"""FastAPI routes of ``redraft serve``: OpenAI completions and chat completions, models, health, metrics.

Each generation request is checked (auth 401, body 400/413, model 404, context 400 ``context_length_exceeded``),
admitted when its KV reservation (prompt + max_tokens) fits the server's KV budget, else queued (429 with
``Retry-After`` when the queue is full), generated on one of the scheduler's threads and returned whole or streamed
as server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. A request with several prompts, or ``n`` > 1, is one job per
choice (prompt p's choice i is choice ``p * n + i``; with sampling, choice i uses seed + i). Every response carries
the request's speculation statistics in a ``redraft`` field. Errors are OpenAI-style bodies
``{"error": {message, type, param, code}}`` (:mod:`redraft.server.errors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from redraft.io.prompts import encode_chat, uses_chat_template
from redraft.runtimes.sequence import Steps

from . import errors, openapi, responses_api, tokenize
from .access_log import AccessLog
from .generation import Generator, Outcome, Work
from .jsonbody import read_json_body
from .logprobs import ChunkLogprobs
from .metrics import ServerMetrics
from .options import ServerOptions
from .responses import completion_body, fingerprint, prompt_text, stats, usage
from .scheduler import Cancelled, Job, QueueFull, Scheduler, ShuttingDown
from .schemas import APIError, ParsedRequest, parse_request
from .structured import check_combination, constraint_for, parse_response_format
from .tenants import Tenants
from .toolcalls import DEFAULT_FORMAT, FORMATS
from .tools import encode_tool_chat, history_calls, parse_tools

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
NO_CONTEXT_LIMIT = 32768  # max_tokens cap for a model that does not state its context length
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/tokenizer_info")



class Server:
    """Everything one server needs; :meth:`app` builds the FastAPI application around it.

    Args:
        generator: runs jobs (model, tokenizer, corpora, draft settings).
        tenants: API keys. model_id: the served model's id (``model`` in requests and responses).
        max_queue: most waiting requests (429 beyond). max_body: most request body bytes (413 beyond).
        max_running: most requests generating at once (1 = one at a time). The KV budget is the generator's
            (``generator.budget``): a request that could never fit in it is a 400.
        options: :class:`~redraft.server.options.ServerOptions` (access log, CORS, chat's default max_tokens).
        tool_call_parser: how the model writes tool calls (a key of :data:`redraft.server.toolcalls.FORMATS`).
        aliases: more ids requests may name (``--served-model-name A B``); responses name the one asked for.
        literal_content: chat message content is tokenized as plain text (special-token strings in it are not
            control tokens); False restores parsing them.
    """

    def __init__(self, generator: Generator, tenants: Tenants, model_id: str, *, max_queue: int = 256,
                 max_running: int = 1, max_body: int = 8 << 20, options: ServerOptions | None = None,
                 tool_call_parser: str = DEFAULT_FORMAT, aliases: tuple[str, ...] = (),
                 literal_content: bool = True) -> None:
        self.generator, self.tenants, self.model_id, self.max_body = generator, tenants, model_id, max_body
        self.options = options or ServerOptions()
        self.tool_format = FORMATS[tool_call_parser]
        self.model_ids = (model_id, *[a for a in aliases if a != model_id])
        self.literal_content = literal_content
        self.fingerprint = fingerprint(model_id, generator)
        self.metrics = ServerMetrics(model_id)
        self.scheduler = Scheduler(self._run, max_queue=max_queue, max_running=max_running, budget=generator.budget,
                                   on_queue=self.metrics.waiting.set, batcher=generator.batcher)
        self.created = int(time.time())
        generator.on_learned = self._corpus_gauges
        for t in generator.corpora.learned:
            self._corpus_gauges(t)

    # ---- the scheduler's jobs ------------------------------------------------------------------------------
    def _run(self, job: Job, emit) -> Steps[Outcome]:
        """The scheduler's runner: the job's step function, made now (the generator announces the job to the jobs
        starting with it: redraft/server/shared_prefill.py), counted as it runs."""
        return self._counted(job, self.generator(job, emit))

    def _counted(self, job: Job, steps: Steps[Outcome]) -> Steps[Outcome]:
        """Run the job's step function, then count it (here, so a client leaving cannot skip the count)."""
        self.metrics.running.inc()
        self.metrics.queue_time.observe(job.queue_seconds)
        try:
            out = yield from steps
        except Cancelled as e:
            self.metrics.finished(None, "abort")
            self.metrics.generation_tokens.inc(e.emitted)
            raise
        finally:
            self.metrics.running.dec()
        self.metrics.finished(out.result, out.finish_reason)
        if out.answer_cache_hit:  # served without a forward: the prefix cache was not consulted
            self.metrics.answer_cache_hits.inc()
        elif self.generator.prefix_cache is not None:
            self.metrics.prefix_cache(out.result, self.generator.prefix_cache)
        self.metrics.latency.observe(time.perf_counter() - job.arrived)
        if job.first_token is not None:
            self.metrics.ttft.observe(job.first_token - job.arrived)
        return out

    def _corpus_gauges(self, tenant: str) -> None:
        c = self.generator.corpora.get(tenant)
        if c is not None:
            self.metrics.corpus(tenant, c)

    # ---- request checks -------------------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        t = self.tenants.resolve(request.headers.get("authorization"))
        if t is None:
            raise APIError(401, "missing or unknown API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        request.state.tenant = t  # for the access log
        return t

    async def body(self, request: Request) -> dict:
        return await read_json_body(request.stream(), request.headers, self.max_body)

    def model_name(self, requested: str | None) -> str:
        """The id to answer with: the requested one when it is served (404 otherwise), else the main one."""
        if requested is not None and requested not in self.model_ids:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.model_ids)}", param="model",
                           code="model_not_found")
        return requested or self.model_id

    def works(self, req: ParsedRequest) -> list[Work]:
        """One Work per choice, prompt by prompt, ``n`` per prompt (choice i sampled with seed + i)."""
        out = []
        for p in (req.prompts or [req.prompt]) if req.kind == "completion" else [None]:
            w = self.work(req if p is None else replace(req, prompt=p))
            for i in range(req.n):
                s = w.sampling
                out.append(replace(w, sampling=replace(s, seed=s.seed + i) if s.temperature > 0 and i else s))
        return out

    def work(self, req: ParsedRequest) -> Work:
        """Prompt ids and the token cap, checked against the vocabulary and the context length."""
        self.model_name(req.model)
        tools, fmt = self._structure(req)
        ctx = self.generator.context_length
        tokenize.refuse_overlong(self.generator.tokenizer, req, ctx)
        ids = self._prompt_ids(req, tools)
        room = ctx - len(ids) if ctx else NO_CONTEXT_LIMIT
        budget = self.generator.budget
        what, verb = ("messages", "encode") if req.kind == "chat" else ("prompt", "encodes")
        if ctx and room <= 0:
            raise APIError(400, f"the {what} {verb} to {len(ids)} tokens; this model's context is {ctx} tokens "
                                "(prompt + max_tokens must fit)", param=what, code="context_length_exceeded")
        if budget is not None and not budget.fits_ever(len(ids) + 1):
            raise APIError(400, f"the {what} {verb} to {len(ids)} tokens; this server's KV capacity is "
                                f"{budget.capacity} tokens (prompt + max_tokens must fit, --kv-tokens)", param=what,
                           code="context_length_exceeded")
        max_tokens, field = req.max_tokens, req.max_tokens_param
        if max_tokens is None:
            default = DEFAULT_COMPLETION_TOKENS if req.kind == "completion" else self.options.max_tokens_default
            max_tokens = room if default is None else min(default, room)
            if budget is not None:
                max_tokens = min(max_tokens, budget.capacity - len(ids))
        shown = errors.short_int(max_tokens)
        if max_tokens > room:
            where = f"this model's context of {ctx} tokens" if ctx else f"the limit of {NO_CONTEXT_LIMIT} tokens"
            raise APIError(400, f"'{field}' {shown} is too large: the prompt's {tokens(len(ids))} plus "
                                f"{shown} exceed {where} (at most {room} here)", param=field,
                           code="context_length_exceeded")
        if budget is not None and not budget.fits_ever(len(ids) + max_tokens):
            raise APIError(400, f"'{field}' {shown} is too large: the prompt's {tokens(len(ids))} plus "
                                f"{shown} exceed this server's KV capacity of {budget.capacity} tokens (at most "
                                f"{budget.capacity - len(ids)} here)", param=field,
                           code="context_length_exceeded")
        sampling = req.sampling
        g = self.generator
        constraint = constraint_for(fmt, tools, self.tool_format, g.tokenizer, g.vocab_size, g.eos)
        if constraint is not None:
            sampling = dataclasses.replace(sampling, constraint=constraint)
        return Work(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=req.stop,
                    tool_calls=self.tool_format if tools is not None and tools.calls_possible else None,
                    single_call=tools is not None and not tools.parallel,
                    forced_calls=tools is not None and tools.forced is not None, logprobs=req.logprobs, echo=req.echo,
                    streaming=bool(req.stream))

    def _structure(self, req: ParsedRequest):
        """The request's tools (:class:`~redraft.server.tools.ToolRequest` or None) and response format
        (:class:`~redraft.server.structured.ResponseFormat` or None), checked; the history's tool calls checked."""
        if req.kind != "chat":
            return None, parse_response_format(req.response_format)
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
                    ids = encode_tool_chat(tok, req.messages, tools, self.tool_format, literal=self.literal_content)
                else:
                    ids = encode_chat(tok, req.messages, literal=self.literal_content)
            except Exception as e:  # jinja raises for conversations its template refuses (roles out of order...)
                raise APIError(400, f"the chat template refused these messages ({e})", param="messages") from e
        elif isinstance(req.prompt, str):
            ids = tokenize.text_ids(tok, req.prompt)  # exactly as sent: surrounding whitespace is kept
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
        name = self.model_name(req.model)
        works = self.works(req)
        loop = asyncio.get_running_loop()
        jobs = [Job(tenant=tenant, payload=w, loop=loop, kv_tokens=w.kv_tokens) for w in works]
        request.state.jobs, request.state.choices_per_prompt = jobs, req.n  # for the access log
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except (QueueFull, ShuttingDown) as e:
            for job in jobs:
                job.cancel.set()
            raise errors.refused(e) from e
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._sse(jobs, req, rid, name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watchers = [asyncio.create_task(_watch_disconnect(request, jobs))]
        try:
            outcomes = []
            for job in jobs:
                outcome = await _final(job)
                if outcome is None:  # the client left; nobody reads this
                    return Response(status_code=499)
                outcomes.append(outcome)
        finally:
            for w in watchers:
                w.cancel()
            for job in jobs:
                job.cancel.set()  # no-op once finished; stops the generation if this handler is torn down early
        body = completion_body(req, rid, name, jobs, outcomes, self.generator.tokenizer)
        body["system_fingerprint"] = self.fingerprint
        return JSONResponse(body)

    async def _sse(self, jobs: list[Job], req: ParsedRequest, rid: str, name: str):
        chat = req.kind == "chat"
        created, tok = int(time.time()), self.generator.tokenizer
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False, calls=None,
                  logprobs: dict | None = None, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                if calls:
                    delta = {"tool_calls": calls}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return _event({"id": rid, "object": obj, "created": created, "model": name,
                           "system_fingerprint": self.fingerprint, "choices": [choice], **extra})

        outcomes: list[Outcome] = []
        try:
            for index, job in enumerate(jobs):
                lp = ChunkLogprobs(tok, chat)  # events come only when the request asked for logprobs
                if chat:
                    yield chunk(index, None, role=True)
                elif req.echo:
                    yield chunk(index, prompt_text(tok, req, index, job.payload.prompt_ids))
                while True:
                    kind, value = await job.events.get()
                    if kind == "logprobs":  # the entries of the tokens whose text comes next
                        lp.pending.extend(value)
                        continue
                    if kind == "delta":
                        yield chunk(index, value, logprobs=lp.take())
                        continue
                    if kind == "done":
                        outcomes.append(value)
                        for i, call in enumerate(value.tool_calls or ()):  # one chunk per call, as OpenAI's
                            yield chunk(index, None, calls=[{"index": i, **call}])
                        yield chunk(index, None, value.finish_reason, logprobs=lp.finish(value.result.logprobs),
                                    redraft=stats(job, value))
                    elif kind == "error":
                        yield _event(errors.as_api_error(value).body())
                    break  # done, error, or aborted (the client is gone)
                if len(outcomes) <= index:
                    break
            if req.include_usage and len(outcomes) == len(jobs):
                yield _event({"id": rid, "object": obj, "created": created, "model": name,
                              "system_fingerprint": self.fingerprint, "choices": [],
                              "usage": usage(req, jobs, outcomes)})
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel.set()  # the client left mid-stream: stop the generation at its next step

    def health(self) -> dict:
        s = self.scheduler
        budget = self.generator.budget
        return {"status": "ok", "model": self.model_id, "running": s.running, "queue": s.waiting,
                "oldest_wait_seconds": round(s.oldest_wait(), 3),
                "kv_tokens_used": budget.used if budget is not None else None,
                "kv_tokens_capacity": budget.capacity if budget is not None else None}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": self.created,
                                            "owned_by": "redraft", "root": self.model_id,
                                            "max_model_len": self.generator.context_length}
                                           for m in self.model_ids]}

    # ---- application ----------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        """The ASGI application (starts the scheduler loop at startup, stops it and closes corpora and the prefix
        store at exit)."""
        @asynccontextmanager
        async def lifespan(_app):
            self.scheduler.start()
            try:
                yield
            finally:
                print(f"redraft serve: shutting down ({self.scheduler.running} running and {self.scheduler.waiting} "
                      "waiting requests are stopped)", file=sys.stderr, flush=True)
                await asyncio.to_thread(self.scheduler.stop)
                self.generator.close()

        app = openapi.application(title="redraft", lifespan=lifespan,
                                  summary="OpenAI-compatible server whose corpus grows from its own answers")
        errors.install(app)

        @app.post("/v1/completions", **openapi.route("completion"))
        async def completions(request: Request):
            return await self.generate(request, "completion")

        @app.post("/v1/chat/completions", **openapi.route("chat"))
        async def chat_completions(request: Request):
            return await self.generate(request, "chat")

        @app.get("/v1/models", **openapi.route("models"))
        async def models(request: Request):
            self.tenant(request)
            return self.models()

        @app.get("/v1/models/{model_id:path}", **openapi.route("model"))
        async def model(model_id: str, request: Request):
            self.tenant(request)
            if model_id not in self.model_ids:
                raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
            return next(m for m in self.models()["data"] if m["id"] == model_id)

        @app.get("/health", **openapi.route("health"))
        async def health():
            return self.health()

        @app.get("/metrics", **openapi.route("metrics"))
        async def metrics():
            for t in self.generator.corpora.learned:  # evictions happen in the background: read sizes now
                self._corpus_gauges(t)
            self.metrics.kv(self.generator.budget, self.generator.batcher)
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        tokenize.add_routes(app, self)
        responses_api.add_routes(app, self)
        openapi.install(app)
        if self.options.cors_origins:
            app.add_middleware(errors.CORS, allow_origins=self.options.cors_origins, allow_methods=["*"],
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


def tokens(n: int) -> str:
    """``n`` with the right noun: "1 token", "5 tokens"."""
    return f"{n:,} token" + ("" if n == 1 else "s")


async def _final(job: Job) -> Outcome | None:
    """Wait for the end of a job: its Outcome, None when aborted; an error event is raised as APIError."""
    while True:
        kind, value = await job.events.get()
        if kind == "done":
            return value
        if kind == "aborted":
            return None
        if kind == "error":
            raise errors.as_api_error(value)


async def _watch_disconnect(request: Request, jobs: list[Job], every: float = 0.1) -> None:
    """Set every job's ``cancel`` when the client of a non-streaming request goes away (the handler cancels this
    task once it has all outcomes)."""
    while not all(job.cancel.is_set() for job in jobs):
        if await request.is_disconnected():
            for job in jobs:
                job.cancel.set()
            return
        await asyncio.sleep(every)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
