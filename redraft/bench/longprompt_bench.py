"""The ``longprompt`` phase of ``redraft bench serve``: a long prompt arriving beside decoding streams.

See :mod:`redraft.bench.concurrent_bench` for what is measured; this module runs it. The long prompt and the
chunk-sized prompts are token ids (the server's ``/tokenize`` of Spec-Bench summarization and RAG articles, so no
tokenizer is loaded here) sent to ``/v1/completions``; the chunk-sized prompts start at other offsets of the text
than the long prompt, so the prefix cache never serves one from another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redraft.bench import concurrency_stats as st
from redraft.bench.concurrent_bench import ConcurrentBenchConfig, StartServer, log_stderr, novel_questions
from redraft.bench.stream_client import chat_body, completion_body, stream_request


def article_text(min_chars: int) -> str:
    """Spec-Bench summarization and RAG prompts joined until at least ``min_chars`` characters (or all of them)."""
    from redraft.io.questions import load_questions

    parts, size = [], 0
    for q in load_questions():
        if q["category"] in ("summarization", "rag") and size < min_chars:
            parts.append(q["turns"][0])
            size += len(parts[-1]) + 2
    return "\n\n".join(parts)


def prompt_ids(base: str, tokens: int) -> list[int]:
    """At least ``tokens`` + 300 ids of :func:`article_text`, from the server's ``/tokenize`` (no special tokens).

    Raises:
        RuntimeError: the server refused, or the articles give too few tokens.
    """
    import httpx

    r = httpx.post(f"{base}/tokenize", json={"prompt": article_text(8 * tokens + 4096), "add_special_tokens": False},
                   timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"longprompt: /tokenize answered HTTP {r.status_code}: {r.text[:300]}")
    ids = r.json()["tokens"]
    if len(ids) < tokens + 300:
        raise RuntimeError(f"longprompt: the articles give {len(ids)} tokens, fewer than {tokens + 300}")
    return ids


async def _streams_with_arrival(base: str, bodies: list[dict], cfg: ConcurrentBenchConfig,
                                long_ids: list[int] | None) -> dict:
    """The streams, and (``long_ids`` given) the long prompt sent once each stream has ``lead_chunks`` chunks or
    ended, or after ``cfg.wait`` s."""
    import httpx

    counts = [0] * len(bodies)
    deadline = time.perf_counter() + cfg.timeout

    def counter(i: int) -> Callable[[float], None]:
        def bump(_t: float) -> None:
            counts[i] += 1
        return bump

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(bodies) + 4)) as client:
        tasks = [asyncio.create_task(stream_request(client, base + "/v1/chat/completions", b, deadline, counter(i)))
                 for i, b in enumerate(bodies)]
        out: dict = {}
        if long_ids is not None:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < cfg.wait and not all(
                    c >= cfg.lead_chunks or t.done() for c, t in zip(counts, tasks, strict=True)):
                await asyncio.sleep(0.005)
            out["long"] = await stream_request(client, base + "/v1/completions", completion_body(long_ids, 1), deadline)
        out["streams"] = list(await asyncio.gather(*tasks))
    return out


def _chunk_forward(base: str, ids: list[int], cfg: ConcurrentBenchConfig) -> dict:
    """Median time to first token of ``chunk_probes`` chunk-sized prompts and of as many 8-token prompts, alone."""
    import httpx

    async def probe(length: int) -> list[float]:
        out = []
        async with httpx.AsyncClient() as client:
            for k in range(cfg.chunk_probes):
                start = 101 + 37 * k + (0 if length > 8 else 7)  # never at 0: the long prompt starts there
                rec = await stream_request(client, base + "/v1/completions",
                                           completion_body(ids[start:start + length], 1), time.perf_counter() + 600)
                if rec.ok and rec.done is not None:
                    out.append((rec.chunk_times[0] if rec.chunk_times else rec.done) - rec.sent)
        return out

    async def late() -> float | None:
        """A chunk at the long prompt's end: its first tokens sent first (untimed, then in the prefix cache), then
        the whole; the second's time to first token is one chunk's forward over a prefix as long as the prompt's."""
        start, n = 211, cfg.prompt_tokens
        async with httpx.AsyncClient() as client:
            url, deadline = base + "/v1/completions", time.perf_counter() + 600
            await stream_request(client, url, completion_body(ids[start:start + n - cfg.chunk_tokens], 1), deadline)
            rec = await stream_request(client, url, completion_body(ids[start:start + n], 1), deadline)
        return (rec.chunk_times[0] if rec.chunk_times else rec.done) - rec.sent if rec.ok else None

    chunk, short = asyncio.run(probe(cfg.chunk_tokens)), asyncio.run(probe(8))
    return {"chunk_tokens": cfg.chunk_tokens, "chunk_forward_seconds": st.percentile(chunk, 50),
            "short_prompt_seconds": st.percentile(short, 50), "late_chunk_forward_seconds": asyncio.run(late())}


def run_longprompt_phase(start_server: StartServer, cfg: ConcurrentBenchConfig,
                         log: Callable[[str], None] = log_stderr) -> dict:
    """The ``longprompt`` phase (see :mod:`redraft.bench.concurrent_bench`) against one server started with
    ``--no-learn`` and ``cfg.server_args``.

    Returns:
        the long prompt's ``prompt_tokens`` and ``prefill_seconds`` (send -> first token), ``chunk_tokens``,
        ``chunk_forward_seconds`` (a chunk-sized prompt alone), ``late_chunk_forward_seconds`` (a chunk after a
        cached prefix of prompt_tokens - chunk_tokens: the last chunk's forward; None if it failed; with the prefix
        cache off it is a whole prefill), ``short_prompt_seconds``, ``streams_decoding_at_arrival``, per stream
        (``per_stream``: :func:`redraft.bench.concurrency_stats.arrival_delay`'s figures and its time to first
        token with and without the arrival), ``largest_extra_delay_seconds``, ``largest_extra_delay_chunk_forwards``,
        ``largest_extra_delay_late_chunk_forwards`` (the same over the last chunk's forward),
        ``within_one_chunk_forward`` (None when no stream was decoding across the prefill), ``all_streams_decoding``
        (whether every stream was decoding when the prompt arrived: with one request at a time they are not, the
        prompt then waits its turn and interrupts nothing, so the goal's setting was not reached).
    Raises:
        RuntimeError: the server does not start, a request fails, or the articles are too short.
    """
    base, stop = start_server("longprompt", ["--no-learn", *cfg.server_args])
    try:
        ids = prompt_ids(base, cfg.prompt_tokens)
        log(f"longprompt: timing {cfg.chunk_probes} prompts of {cfg.chunk_tokens} tokens alone ...")
        chunk = _chunk_forward(base, ids, cfg)
        bodies = [chat_body(q, cfg.stream_max_tokens) for q in novel_questions(cfg.streams)]
        log(f"longprompt: {cfg.streams} streams alone ...")
        alone = asyncio.run(_streams_with_arrival(base, bodies, cfg, None))
        log(f"longprompt: {cfg.streams} streams + a {cfg.prompt_tokens}-token prompt ...")
        mixed = asyncio.run(_streams_with_arrival(base, bodies, cfg, ids[:cfg.prompt_tokens]))
    finally:
        stop()
    failed = [r.error for r in alone["streams"] + mixed["streams"] + [mixed["long"]] if not r.ok]
    if failed:
        raise RuntimeError(f"longprompt: {len(failed)} request(s) failed: {failed[0]}")
    long = mixed["long"]
    arrive = long.sent
    end = long.chunk_times[0] if long.chunk_times else long.done
    per_stream = []
    for a, m in zip(alone["streams"], mixed["streams"], strict=True):
        d = st.arrival_delay(m.chunk_times, a.chunk_times, arrive, end)
        d.update(ttft_alone=a.ttft, ttft_with_arrival=m.ttft,
                 decoding_at_arrival=bool(m.chunk_times) and m.chunk_times[0] <= arrive < m.chunk_times[-1])
        per_stream.append(d)
    extras = [d["extra_delay"] for d in per_stream if d["extra_delay"] is not None]
    largest = max(extras) if extras else None
    fwd = chunk["chunk_forward_seconds"]
    in_fwd = st.ratio(largest, fwd)
    return {"prompt_tokens": cfg.prompt_tokens, "prefill_seconds": end - arrive, **chunk,
            "streams": cfg.streams, "stream_max_tokens": cfg.stream_max_tokens, "server_args": list(cfg.server_args),
            "streams_decoding_at_arrival": sum(d["decoding_at_arrival"] for d in per_stream),
            "all_streams_decoding": all(d["decoding_at_arrival"] for d in per_stream),
            "per_stream": per_stream, "largest_extra_delay_seconds": largest,
            "largest_extra_delay_chunk_forwards": in_fwd,
            "largest_extra_delay_late_chunk_forwards": st.ratio(largest, chunk["late_chunk_forward_seconds"]),
            "within_one_chunk_forward": None if in_fwd is None else in_fwd <= 1.0}


def longprompt_table(res: dict) -> str:
    """A short text summary of the ``longprompt`` phase."""
    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    return (f"longprompt: a {res['prompt_tokens']}-token prompt beside {res['streams']} streams "
            f"({res['streams_decoding_at_arrival']} decoding when it arrived): prefill {f(res['prefill_seconds'])} s; "
            f"largest extra gap {f(res['largest_extra_delay_seconds'])} s = "
            f"{f(res['largest_extra_delay_chunk_forwards'], '.2f')} chunk forwards "
            f"(one {res['chunk_tokens']}-token chunk: {f(res['chunk_forward_seconds'])} s alone, "
            f"{f(res.get('late_chunk_forward_seconds'))} s as the prompt's last; "
            f"{f(res.get('largest_extra_delay_late_chunk_forwards'), '.2f')} of those); "
            f"within one chunk forward: {res['within_one_chunk_forward']}"
            + ("" if res["all_streams_decoding"] else " (not every stream was decoding when it arrived)"))
