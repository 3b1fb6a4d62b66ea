"""One access-log line per HTTP request on stderr, and the ``x-request-id`` response header.

A pure ASGI middleware (streaming and disconnects pass through untouched). Each request gets an id: the client's
``x-request-id`` header when it sent a usable one (echoed back, as nginx, Envoy and OpenAI's API do), else a fresh
one; every response carries it in ``x-request-id``. When the response ends, one line is written, e.g.::

    redraft serve: 127.0.0.1 "POST /v1/chat/completions" 200 tenant=default prompt_tokens=812 completion_tokens=64
    tokens_per_forward=5.33 prefix_hit_tokens=748 prefix_disk_tokens=0 answer_cache_hits=0 seconds=1.204
    request_id=3f2a...

(one line; ``-`` for what a request does not have; ``/health`` and ``/metrics`` are logged only when they do not
answer 200, as load balancers and scrapers poll them every few seconds; a response the client
left before it ended, e.g. a cancelled stream, is logged with nginx's 499 whatever status it had begun with, and
one whose app failed after its headers as 500; such a line still counts the prompt tokens and the tokens generated
until then).
``prefix_disk_tokens``: those of the prefix-hit tokens read from the prefix cache's entries on disk (written before
a restart, or by another server on the corpus directory). ``answer_cache_hits``: the request's choices answered from the answer cache without a forward
(``tokens_per_forward`` is then ``-`` when none of them ran a forward). The route handler
puts what it knows into the request's state (``request.state.tenant``, ``request.state.job`` whose ``outcome``
holds the generation's result, or ``request.state.jobs`` and ``choices_per_prompt`` for a request of several
choices, counted as ``usage`` counts them) and the middleware reads it when the response is complete.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from typing import Any, TextIO

REQUEST_ID_HEADER = b"x-request-id"
QUIET_PROBES = ("/health", "/metrics")  # logged only when they fail (load balancers and scrapers poll them)
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection before the response ended
_GOOD_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # printable, no spaces: safe to log and to echo


class AccessLog:
    """ASGI middleware: request ids and access-log lines.

    Args:
        app: the wrapped ASGI application.
        enabled: False = no log lines (``--quiet``); the request id header is sent either way.
        stream: where lines go (default ``sys.stderr`` at the time of each write).
    """

    def __init__(self, app, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.app, self.enabled, self.stream = app, enabled, stream

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id(dict(scope.get("headers") or []).get(REQUEST_ID_HEADER))
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0, status, complete = time.perf_counter(), [500], [False]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": headers + [(REQUEST_ID_HEADER, rid.encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete[0] = True
            await send(message)

        failed = [False]
        try:
            await self.app(scope, receive, send_with_id)
        except (OSError, asyncio.CancelledError):  # the connection went away (a write to it failed, or cancelled)
            raise
        except Exception:
            failed[0] = True  # the app itself failed, headers sent or not: a server error
            raise
        finally:
            if self.enabled:
                # a response started but never finished without the app failing: the client left (nginx's 499)
                code = status[0]
                if failed[0]:
                    code = 500
                elif code < 400 and not complete[0]:
                    code = CLIENT_CLOSED
                if not (code == 200 and scope.get("path") in QUIET_PROBES):  # a probe every few seconds: noise
                    line = access_line(scope, code, time.perf_counter() - t0, state)
                    print(line, file=self.stream or sys.stderr, flush=True)


def request_id(sent: bytes | None) -> str:
    """The client's id when it is 1-128 characters of letters, digits and ``._:-``; else a fresh uuid4 hex."""
    if sent:
        text = sent.decode("latin-1")
        if _GOOD_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


def access_line(scope, status: int, seconds: float, state: dict[str, Any]) -> str:
    """The log line of one finished request (see the module doc for its fields)."""
    client = scope.get("client") or ("-", 0)
    path = scope.get("path", "")
    fields: dict[str, Any] = {"tenant": state.get("tenant", "-"), "prompt_tokens": "-", "completion_tokens": "-",
                              "tokens_per_forward": "-", "prefix_hit_tokens": "-", "prefix_disk_tokens": "-",
                              "answer_cache_hits": "-"}
    jobs = state.get("jobs") or [state.get("job")]
    n = state.get("choices_per_prompt", 1)
    outcomes = [getattr(j, "outcome", None) for j in jobs]
    results = [getattr(o, "result", None) for o in outcomes]
    done = [r for r in results if r is not None]
    # a choice without a result (the client left, or it failed): its prompt and the tokens generated until then
    prompts = [len(r.prompt_ids) if r is not None else _prompt_tokens(j) for j, r in zip(jobs, results, strict=True)]
    if done or any(p is not None for p in prompts):
        fields.update(prompt_tokens=sum(p for p in prompts[::n] if p is not None),
                      completion_tokens=sum(len(r.output_ids) if r is not None else getattr(j, "generated", 0)
                                            for j, r in zip(jobs, results, strict=True)))
    if done:  # several choices (prompts x n): summed as usage sums them, each prompt counted once
        forwards = sum(r.forwards for r in done)
        tpf = sum(len(r.output_ids) for r in done) / forwards if forwards else done[0].tokens_per_forward
        hits = sum(bool(getattr(o, "answer_cache_hit", False)) for o in outcomes if o is not None)
        fields.update(tokens_per_forward=f"{tpf:.2f}" if forwards or not hits else "-",
                      prefix_hit_tokens=sum(r.prefix_hit_tokens for r in done),
                      prefix_disk_tokens=sum(r.prefix_disk_tokens for r in done), answer_cache_hits=hits)
    kv = " ".join(f"{k}={v}" for k, v in fields.items())
    return (f"redraft serve: {client[0]} \"{scope.get('method', '-')} {path}\" {status} {kv} "
            f"seconds={seconds:.3f} request_id={state.get('request_id', '-')}")


def _prompt_tokens(job) -> int | None:
    """A job's prompt length from its payload (None for no job, or one without prompt ids)."""
    ids = getattr(getattr(job, "payload", None), "prompt_ids", None)
    return None if ids is None else len(ids)
