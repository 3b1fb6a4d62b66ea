"""``redraft serve``: an OpenAI-compatible HTTP server whose corpus grows from its own answers, per tenant.

Modules, one job each: ``tenants`` (API key -> tenant), ``corpora`` (each tenant's learned corpus plus the shared
read-only one), ``scheduler`` (one model, one loop that advances up to
``--max-running`` requests a step at a time, a fair queue), ``admission`` (one KV budget over running requests and the prefix cache, ``Retry-After``), ``generation`` (one request through
the engine: drafters, stop strings, text deltas, learning), ``schemas`` (OpenAI request validation), ``app``
(FastAPI routes, streaming), ``errors`` (OpenAI error bodies for every failure), ``responses`` (response bodies:
choices, usage, statistics), ``logprobs`` (OpenAI's log-probability objects), ``tokenize`` (prompt text -> ids,
vLLM's tokenizer routes), ``responses_api`` (OpenAI's Responses API), ``openapi`` (the served OpenAPI document),
``metrics`` (prometheus_client, vLLM's names where they exist), ``prefix_cache`` (the KV entries of recent
requests, reused across requests per tenant), ``shared_prefill`` (requests admitted together compute a prompt
prefix they share once), ``access_log`` (a log line and an ``x-request-id`` per request),
``options`` (operator settings: access log, CORS, chat's default max_tokens), ``tools`` / ``toolcalls`` /
``structured`` (tool calling and structured output).
"""
