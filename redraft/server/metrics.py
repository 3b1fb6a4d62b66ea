"""Prometheus metrics of a server, with vLLM's metric names wherever vLLM has the same quantity.

vLLM names used (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:request_success`` (by ``finished_reason``), ``vllm:prompt_tokens``,
``vllm:generation_tokens``, ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens``, ``vllm:request_queue_time_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``; so vLLM's PromQL for the acceptance
rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts) works unchanged. redraft adds a
``source`` label to the spec-decode counters (corpus, shared, ngram, ...) and its own ``redraft:`` metrics where vLLM
has none: HTTP requests by status, target forwards, tokens per forward, learned corpus size per tenant. The prefix
cache counts as vLLM's does (``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``, in prompt tokens), plus
``redraft:prefix_cache_evictions``, ``redraft:prefix_cache_tokens`` and ``redraft:prefix_cache_entries``; requests
answered from the answer cache without a forward: ``redraft:answer_cache_hits``. The KV
budget (:mod:`redraft.server.admission`): ``redraft:kv_tokens_used`` (running requests' reservations plus the prefix
cache), ``redraft:kv_tokens_capacity`` and vLLM's ``vllm:kv_cache_usage_perc`` (their ratio, 0..1); the step
batcher: ``redraft:batch_steps`` and ``redraft:batch_rows`` (their rate ratio is rows per batched forward).
Counters are exposed with prometheus_client's ``_total`` suffix, as vLLM's are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from redraft.decoding.engine import GenerationResult
from redraft.server.prefix_cache import PrefixCache

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TPF = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 49)


PREFIX_DISK = {  # the prefix cache's disk entries (redraft.runtimes.prefix_store.StoreStats), counted since start
    "hit_tokens": "Prompt tokens whose KV entries were read from the prefix cache's entries on disk.",
    "reads": "Prefix KV entries read from disk.", "bytes_read": "Bytes of prefix KV entries read from disk.",
    "writes": "Prefix KV entries written to disk.", "bytes_written": "Bytes of prefix KV entries written to disk.",
    "evictions": "Prefix KV entries on disk removed by the disk budget.",
    "rejected": "Prefix KV entries on disk that failed their checks (key, length, checksum) and were removed.",
    "errors": "Prefix KV entries that could not be written (disk full, read-only directory).",
    "dropped": "Prefix KV entries not written because the write queue was full.",
    "too_large": "Prefix KV entries not written because one alone exceeds the disk budget.",
    "covered": "Prefix KV entries not written because an entry on disk already holds all but a short tail of them.",
}


class ServerMetrics:
    """All metrics of one server, in their own registry (several servers can live in one process, as in tests).

    Args:
        model_name: the served model id (the ``model_name`` label, as vLLM's).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests generating now (up to --max-running).",
                             m, registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting in the queue.", m,
                             registry=r).labels(model_name)
        self.http = Counter("redraft:http_requests", "HTTP requests by endpoint and status code.",
                            m + ["endpoint", "status"], registry=r)
        self.success = Counter("vllm:request_success", "Finished generations by finish reason (abort = the client "
                               "left).", m + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=r).labels(model_name)
        self.forwards = Counter("redraft:target_forwards", "Target model forwards (prefill and verify).", m,
                                registry=r).labels(model_name)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify forwards that carried a draft of this "
                              "source.", m + ["source"], registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed by this source.",
                                    m + ["source"], registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens of this source the "
                                       "target accepted.", m + ["source"], registry=r)
        self.tokens_per_forward = Histogram("redraft:tokens_per_forward", "Generated tokens per target forward, "
                                            "per request.", m, buckets=_TPF, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Seconds a request waited in the queue.", m,
                                    buckets=_SECONDS, registry=r).labels(model_name)
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "Seconds from arrival to the last token.", m,
                                 buckets=_SECONDS, registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.", m,
                              buckets=_SECONDS, registry=r).labels(model_name)
        self.corpus_tokens = Gauge("redraft:corpus_tokens", "Ids in each tenant's learned corpus.", m + ["tenant"],
                                   registry=r)
        self.corpus_spans = Gauge("redraft:corpus_spans", "Spans in each tenant's learned corpus.", m + ["tenant"],
                                  registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      m, registry=r).labels(model_name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens whose KV entries came from the prefix "
                                   "cache.", m, registry=r).labels(model_name)
        self.prefix_evictions = Counter("redraft:prefix_cache_evictions", "Prefix cache entries evicted by the "
                                        "token budget.", m, registry=r).labels(model_name)
        self.prefix_tokens = Gauge("redraft:prefix_cache_tokens", "Tokens whose KV entries the prefix cache holds, "
                                   "all tenants.", m, registry=r).labels(model_name)
        self.prefix_entries = Gauge("redraft:prefix_cache_entries", "Entries in the prefix cache, all tenants.", m,
                                    registry=r).labels(model_name)
        self._prefix_evicted = 0
        self.prefix_disk = {name: Counter(f"redraft:prefix_disk_{name}", text, m, registry=r).labels(model_name)
                            for name, text in PREFIX_DISK.items()}
        self._disk_seen: dict[str, int] = {}
        self.answer_cache_hits = Counter("redraft:answer_cache_hits", "Greedy choices (each of a request's n) "
                                         "answered from the answer cache (the tenant's stored answer to the "
                                         "identical prompt), without a forward.", m, registry=r).labels(model_name)
        self.kv_used = Gauge("redraft:kv_tokens_used", "KV tokens in use: running requests' reservations (prompt + "
                             "max_tokens) plus the prefix cache.", m, registry=r).labels(model_name)
        self.kv_capacity = Gauge("redraft:kv_tokens_capacity", "The KV budget in tokens (--kv-tokens).", m,
                                 registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV budget in use, 0..1 (kv_tokens_used / capacity).", m,
                              registry=r).labels(model_name)
        self.batch_steps = Counter("redraft:batch_steps", "Batched target forwards (steps of the step batcher).", m,
                                   registry=r).labels(model_name)
        self.batch_rows = Counter("redraft:batch_rows", "Rows (tokens) carried by batched target forwards, all "
                                  "requests.", m, registry=r).labels(model_name)
        self._batch_seen = (0, 0)
        self.corpus_evicted = Gauge("redraft:corpus_evicted_spans", "Spans evicted by the per-tenant cap since "
                                    "start.", m + ["tenant"], registry=r)
        self.corpus_followed = Gauge("redraft:corpus_followed_spans", "Spans read from other writers' journals "
                                     "of the tenant's corpus directory since start.", m + ["tenant"], registry=r)
        self.corpus_follow_delay = Gauge("redraft:corpus_follow_delay_seconds", "Seconds between another writer's "
                                         "newest record and its read here, at the last read that found one.",
                                         m + ["tenant"], registry=r)

    def http_request(self, endpoint: str, status: int) -> None:
        self.http.labels(self.model_name, endpoint, str(status)).inc()

    def finished(self, res: GenerationResult | None, reason: str) -> None:
        """Count one generation that ended (``res`` None when it was aborted before a result existed)."""
        self.success.labels(self.model_name, reason).inc()
        if res is None:
            return
        self.prompt_tokens.inc(len(res.prompt_ids))
        self.generation_tokens.inc(len(res.output_ids))
        self.forwards.inc(res.forwards)
        if res.forwards:
            self.tokens_per_forward.observe(res.tokens_per_forward)
        for name, st in res.sources.items():
            self.drafts.labels(self.model_name, name).inc(st.steps)
            self.draft_tokens.labels(self.model_name, name).inc(st.proposed)
            self.accepted_tokens.labels(self.model_name, name).inc(st.accepted)

    def prefix_cache(self, res: GenerationResult, cache: PrefixCache) -> None:
        """Count one finished request's prefix cache lookup (its prompt tokens, the hit) and the store's state."""
        self.prefix_queries.inc(len(res.prompt_ids))
        self.prefix_hits.inc(res.prefix_hit_tokens)
        evicted = cache.stats.evictions
        self.prefix_evictions.inc(max(0, evicted - self._prefix_evicted))
        self._prefix_evicted = evicted
        self.prefix_tokens.set(cache.tokens)
        self.prefix_entries.set(len(cache))
        self.prefix_disk_counts(cache)

    def prefix_disk_counts(self, cache) -> None:
        """Bring the counters of the prefix cache's disk entries up to its store's counts (after each request and at
        each scrape: the store writes in a thread of its own)."""
        disk = getattr(cache, "disk", None)
        if disk is not None:
            for name, counter in self.prefix_disk.items():
                now = int(getattr(disk.stats, name))
                counter.inc(max(0, now - self._disk_seen.get(name, 0)))
                self._disk_seen[name] = now

    def corpus(self, tenant: str, corpus) -> None:
        """The gauges of one tenant's learned corpus (a :class:`redraft.corpus.online.OnlineCorpus`)."""
        labels = (self.model_name, tenant)
        self.corpus_tokens.labels(*labels).set(corpus.n_tokens)
        self.corpus_spans.labels(*labels).set(corpus.n_spans)
        self.corpus_evicted.labels(*labels).set(corpus.evicted_spans)
        self.corpus_followed.labels(*labels).set(corpus.followed_spans)
        self.corpus_follow_delay.labels(*labels).set(corpus.follow_delay)

    def kv(self, budget, batcher=None) -> None:
        """Read the KV budget (a :class:`~redraft.server.admission.KVBudget` or None) and the step batcher's counts
        (``steps``, ``rows``; None without one) into their metrics (at each scrape)."""
        if budget is not None:
            self.prefix_disk_counts(budget.prefix_cache)
            used = budget.used
            self.kv_used.set(used)
            self.kv_capacity.set(budget.capacity)
            self.kv_usage.set(used / budget.capacity)
        if batcher is not None:
            steps, rows = int(batcher.steps), int(batcher.rows)
            self.batch_steps.inc(max(0, steps - self._batch_seen[0]))
            self.batch_rows.inc(max(0, rows - self._batch_seen[1]))
            self._batch_seen = (steps, rows)

    def render(self) -> bytes:
        """The text exposition format (``GET /metrics``)."""
        return generate_latest(self.registry)
