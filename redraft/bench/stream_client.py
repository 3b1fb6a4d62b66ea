"""Streaming OpenAI-style requests from many concurrent clients (httpx + asyncio), timed chunk by chunk.

Each request is a greedy ``stream: true`` request with ``stream_options.include_usage`` (OpenAI's and vLLM's
server-sent events: ``data: {chunk}`` lines, a usage chunk, ``data: [DONE]``); the arrival time of every chunk that
carries generated text is recorded, so time to first token and inter-token gaps are measured client side, as
vLLM's ``benchmark_serving.py`` measures them. A 429 or 503 answer is waited out (its ``Retry-After`` header, else
one second) and sent again until the deadline; time to first token counts from the first attempt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

from redraft.bench.concurrency_stats import StreamRecord

RETRY_STATUSES = (429, 503)


def chat_body(content: str, max_tokens: int) -> dict:
    """A greedy streamed chat request body for one user message."""
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def completion_body(prompt: str | list[int], max_tokens: int) -> dict:
    """A greedy streamed completions request body (``prompt``: text or token ids)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def _chunk_text(event: dict) -> str:
    out = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        out += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return out


async def stream_request(client, url: str, body: dict, deadline: float,
                         on_chunk: Callable[[float], None] | None = None) -> StreamRecord:
    """Send one streamed request to ``url`` and time it (see the module doc); never raises for HTTP failures.

    Args:
        client: an ``httpx.AsyncClient``. body: the JSON body (``stream: true``). deadline: ``time.perf_counter``
            time after which no retry is sent and the read gives up.
        on_chunk: called with the arrival time of each text chunk (the long-prompt probe watches progress with it).
    Returns:
        the :class:`StreamRecord` (``error`` set and ``done`` None on failure).
    """
    import httpx

    rec = StreamRecord(sent=time.perf_counter())
    while True:
        try:
            timeout = httpx.Timeout(max(1.0, deadline - time.perf_counter()))
            async with client.stream("POST", url, json=body, timeout=timeout) as r:
                rec.status = r.status_code
                if r.status_code in RETRY_STATUSES and time.perf_counter() < deadline:
                    wait = float(r.headers.get("retry-after") or 1.0)
                    rec.retries += 1
                    await r.aclose()
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))
                    continue
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                    return rec
                await _read_events(r, rec, on_chunk)
                return rec
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return rec


async def _read_events(response, rec: StreamRecord, on_chunk) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec.done = time.perf_counter()
            return
        event = json.loads(data)
        if "error" in event:
            rec.error = str(event["error"])[:300]
            return
        now = time.perf_counter()
        text = _chunk_text(event)
        if text:
            rec.chunk_times.append(now)
            rec.text += text
            if on_chunk:
                on_chunk(now)
        if event.get("usage"):
            rec.completion_tokens = int(event["usage"]["completion_tokens"])
        if isinstance(event.get("redraft"), dict):  # the final chunk's speculation statistics and queue wait
            rec.stats = dict(event["redraft"])
    rec.error = rec.error or "the stream ended without [DONE]"


async def closed_loop(base: str, bodies: Sequence[dict], concurrency: int, timeout: float,
                      path: str = "/v1/chat/completions",
                      progress: Callable[[int, int], None] | None = None) -> tuple[list[StreamRecord], float]:
    """Send ``bodies`` from ``concurrency`` clients, each sending its next request when its last one ended (a
    closed loop, as a fixed number of users); returns one record per body (in ``bodies``' order) and the wall
    time (s) from the first send to the last stream's end.

    ``progress(done, total)`` is called after each request ends.
    """
    import httpx

    todo = list(enumerate(bodies))
    records: list[StreamRecord | None] = [None] * len(bodies)
    deadline = time.perf_counter() + timeout
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(client) -> None:
        while todo and time.perf_counter() < deadline:
            i, body = todo.pop(0)
            records[i] = await stream_request(client, base + path, body, deadline)
            if progress:
                progress(sum(r is not None for r in records), len(bodies))

    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    out = [r if r is not None else StreamRecord(sent=t0, error="not sent before the deadline") for r in records]
    return out, wall
