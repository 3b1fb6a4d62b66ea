"""Statistics of the concurrent-serving benchmarks, from client-side timings (pure functions, no I/O).

Every time is in seconds on one monotonic clock (``time.perf_counter`` of the benchmark process). A request record
is a :class:`StreamRecord`: when it was sent, when each streamed content chunk arrived, its text and its completion
token count. The figures follow what serving benchmarks report (vLLM's ``benchmarks/benchmark_serving.py``:
output throughput = all generated tokens / the run's wall time, time to first token and end-to-end latency
percentiles; inter-token gaps measured between streamed chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StreamRecord:
    """One streamed request as the client saw it.

    Attributes:
        sent: when the request was first sent (s). done: when its stream ended (s; None if it never did).
        chunk_times: arrival time of each chunk that carried generated text (s, increasing).
        text: the generated text. completion_tokens: tokens generated (the server's usage figure).
        status: the HTTP status of the last attempt (0: no answer). retries: attempts refused (429/503) and sent again.
        error: why the request failed, or None. stats: the server's ``redraft`` statistics of the answer, if sent.
    """

    sent: float
    done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    status: int = 0
    retries: int = 0
    error: str | None = None
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Answered whole: HTTP 200, no error, the stream ended."""
        return self.status == 200 and self.error is None and self.done is not None

    @property
    def ttft(self) -> float | None:
        """Time to first token (s): first text chunk - sent; None when no text came."""
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        """End-to-end latency (s): stream end - sent; None when it did not end."""
        return None if self.done is None else self.done - self.sent


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of ``values``, linear interpolation as numpy's default; None when empty.

    Raises:
        ValueError: q outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected a percentile in 0..100, got {q}")
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def aggregate_rate(records: Sequence[StreamRecord], wall: float) -> float:
    """Output tokens/s of a run: completion tokens of the answered requests / the run's wall time (s); 0 if wall <= 0."""
    return sum(r.completion_tokens for r in records if r.ok) / wall if wall > 0 else 0.0


def summarize(records: Sequence[StreamRecord], wall: float) -> dict:
    """A run's figures: requests, ``ok``, ``errors``, ``retries``, ``output_tokens``, ``wall_seconds``,
    ``tokens_per_second`` (aggregate), ``ttft_p50``/``ttft_p95``, ``latency_p50``/``latency_p95`` (s; None without
    answered requests) and ``queue_p50`` (the server's own queue wait, when it reports one)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    lat = [r.latency for r in ok]
    queue = [r.stats["queue_seconds"] for r in ok if "queue_seconds" in r.stats]
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "retries": sum(r.retries for r in records), "output_tokens": sum(r.completion_tokens for r in ok),
            "wall_seconds": wall, "tokens_per_second": aggregate_rate(records, wall),
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "latency_p50": percentile(lat, 50), "latency_p95": percentile(lat, 95),
            "queue_p50": percentile(queue, 50)}


def per_request(records: Sequence[StreamRecord]) -> list[dict]:
    """Each request's own figures, in ``records``' order, to explain a run's tails: ``sent`` (s after the run's first
    send), ``ttft`` and ``latency`` (s, None as :attr:`StreamRecord.ttft` / :attr:`StreamRecord.latency`),
    ``tokens`` (completion tokens), ``queue`` (the server's queue wait, s, None when not reported) and ``ok``."""
    t0 = min((r.sent for r in records), default=0.0)

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return [{"sent": r3(r.sent - t0), "ttft": r3(r.ttft), "latency": r3(r.latency), "tokens": r.completion_tokens,
             "queue": r3(r.stats.get("queue_seconds")), "ok": r.ok} for r in records]


def identical(texts: Sequence[str | None], reference: Sequence[str | None]) -> dict:
    """Compare answers pairwise with a reference: ``{"identical": n, "compared": m, "differing": [indices]}``.

    A pair where either side is None (no answer) is not compared. Raises ValueError when the lengths differ.
    """
    if len(texts) != len(reference):
        raise ValueError(f"texts: expected {len(reference)} answers (one per reference), got {len(texts)}")
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(texts, reference, strict=True)) if a is not None and b is not None]
    differing = [i for i, a, b in pairs if a != b]
    return {"identical": len(pairs) - len(differing), "compared": len(pairs), "differing": differing}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def gaps(times: Sequence[float]) -> list[tuple[float, float]]:
    """Consecutive chunk intervals ``(start, end)`` of increasing arrival ``times``."""
    return list(zip(times[:-1], times[1:], strict=False))


def arrival_delay(times: Sequence[float], baseline: Sequence[float], start: float, end: float) -> dict:
    """How much a stream's chunks were delayed while something else ran between ``start`` and ``end``.

    Args:
        times: the stream's chunk arrival times in the run with the interruption (s).
        baseline: the same stream's chunk arrival times in a run without it (s).
        start, end: the interruption's window (s, same clock as ``times``): e.g. a long prompt's send time and the
            arrival of its first token (its prefill done).
    Returns:
        ``baseline_gap`` (median gap without the interruption), ``largest_gap`` (the largest gap of ``times``
        that overlaps [start, end]; None when none does: the stream had ended or not started), ``extra_delay``
        (largest_gap - baseline_gap, s; None as largest_gap), ``gaps_in_window`` (how many gaps overlap it) and
        ``window_gaps`` (each such gap as [its start - start, its length], s: where in the window the delay fell).
    Raises:
        ValueError: end before start.
    """
    if end < start:
        raise ValueError(f"end: expected a time at or after start ({start}), got {end}")
    base = [b - a for a, b in gaps(baseline)]
    base_gap = percentile(base, 50)
    spans = [(a, b) for a, b in gaps(times) if b >= start and a <= end]
    window = [b - a for a, b in spans]
    largest = max(window) if window else None
    extra = None if largest is None or base_gap is None else largest - base_gap
    return {"baseline_gap": base_gap, "largest_gap": largest, "extra_delay": extra, "gaps_in_window": len(window),
            "window_gaps": [[a - start, b - a] for a, b in spans]}
