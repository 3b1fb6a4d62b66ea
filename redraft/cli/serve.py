"""``redraft serve``: the OpenAI-compatible server (see :mod:`redraft.server`).

Registering the parser imports neither the server nor torch; :func:`build_server` imports them when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys

from redraft.cli.common import (
    add_dtype_arg,
    add_model_arg,
    add_runtime_args,
    add_speculation_args,
    add_threads_arg,
    byte_size,
    config_from_args,
    int_between,
    load_model_or_exit,
    log_to_stderr,
    nonneg,
    positive,
)
from redraft.defaults import PREFIX_CACHE_TOKENS, PREFIX_DISK_BYTES, TOOL_CALL_PARSERS
from redraft.io.loading import DEFAULT_MODEL_FILE, ModelLoadError, resolve_gguf

DEFAULT_CAP_TOKENS = 1_000_000
DEFAULT_MAX_RUNNING = 16
MAX_RUNNING = 256  # beyond a few dozen the step is compute-bound anyway
DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_KV_TOKENS = 32_768  # redraft.server.admission.DEFAULT_KV_TOKENS (not imported here: no torch at parse time)


def register(sub) -> None:
    """Add ``serve`` to the top-level sub-parsers."""
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server whose corpus grows from its own answers",
        description="Serve OpenAI's /v1/completions, /v1/chat/completions (tools, response_format) and "
                    "/v1/responses, /v1/models, /health, /metrics, vLLM's /tokenize, /detokenize and (with "
                    "--enable-tokenizer-info-endpoint) /tokenizer_info, "
                    "and the OpenAPI document (/openapi.json, /docs): docs/serving.md. Every finished answer joins its tenant's corpus and drafts the next requests, so a repeated request comes "
                    "back faster with identical output.")
    add_model_arg(p)
    add_dtype_arg(p)
    add_runtime_args(p)  # llama.cpp: one request at a time (one sequence), from llama.cpp's own cache
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id clients send and see (default: the model directory's name); several names are "
                        "aliases: requests may name any, /v1/models lists all, the first is the main one")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="parse special-token strings (e.g. <|im_start|>) inside chat message content as control "
                        "tokens; default: content is plain text and only the chat template's own markers are "
                        "control tokens")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the special tokens and the chat template), as vLLM's flag of the "
                        "same name; off by default: with it, lm-eval's API models pick their remote tokenizer, "
                        "which cannot apply a chat template to local-completions prompts (with the route on, pass "
                        "tokenizer_backend=huggingface,tokenizer=MODEL_DIR to lm-eval for that)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_between(0, 65535), default=8000, help="TCP port (default 8000)")
    p.add_argument("--corpus-dir", default=None, metavar="DIR",
                   help="where each tenant's learned corpus is kept (journals + binary base); default: in memory "
                        "only, lost at exit. Several servers and vLLM proposers may share one DIR (a shared volume "
                        "for replicas): each learns from the others' answers within a fraction of a second")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help='JSON object {"API_KEY": "tenant", ...}; unknown keys get 401. Default: one tenant, no key')
    p.add_argument("--corpus", nargs="+", action="extend", default=[], metavar="FILE",
                   help="fixed corpus files every tenant drafts from (read-only)")
    p.add_argument("--no-learn", action="store_true", help="do not learn from answers: draft from --corpus only")
    p.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                   help="fsync each learned span before its response completes (default on; --no-sync leaves "
                        "it to the OS: a power cut may lose the last seconds)")
    p.add_argument("--cap-tokens", type=positive, default=DEFAULT_CAP_TOKENS, metavar="N",
                   help=f"most ids in each tenant's learned corpus; the oldest spans are evicted beyond it "
                        f"(default {DEFAULT_CAP_TOKENS:,})")
    p.add_argument("--compact-tokens", type=positive, default=None, metavar="N",
                   help="token ids in a tenant's journals (all writers') that start a compaction of them into the "
                        "tenant's binary base (default: 65,536 or the base's size, whichever is larger)")
    add_speculation_args(p)  # the policy or fixed depths, as `redraft run`
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=TOOL_CALL_PARSERS[0],
                   help="how the model writes tool calls: hermes = <tool_call>{json}</tool_call> blocks (ChatML "
                        "models), llama3_json = a bare {\"name\", \"parameters\"} answer (default "
                        f"{TOOL_CALL_PARSERS[0]}); also the syntax tool_choice required/named is forced into")
    p.add_argument("--no-grammar-drafts", action="store_true",
                   help="do not propose the tokens a response_format or tool-call grammar forces as drafts")
    p.add_argument("--max-queue", type=positive, default=256, metavar="N",
                   help="most waiting requests; beyond it a request is answered 429 with Retry-After (default 256)")
    p.add_argument("--max-running", type=int_between(1, MAX_RUNNING), default=None, metavar="N",
                   help=f"most requests generating at once, 1..{MAX_RUNNING}, all advanced by one scheduler loop; "
                        f"their forwards are batched into one per step (default {DEFAULT_MAX_RUNNING}; 1 = one "
                        f"request at a time, unbatched; on llama.cpp the default is 1, whose cache the next request of the same "
                        f"tenant starts from, and N > 1 runs N sequences of --n-ctx tokens in one llama.cpp "
                        f"context)")
    p.add_argument("--max-batch-tokens", type=positive, default=None, metavar="N",
                   help=f"most tokens (rows) in one batched forward: running requests' tokens and drafts plus a "
                        f"chunk of a waiting prompt's prefill; a chunk is never under 32 rows, so a step may "
                        f"exceed a smaller value by that much (default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--kv-tokens", type=positive, default=None, metavar="N",
                   help=f"KV capacity in tokens, shared by running requests (each reserves prompt + max_tokens "
                        f"when admitted; requests wait in the queue until theirs fits) and the prefix cache (which "
                        f"keeps what they leave); a request that can never fit is a 400 (default: --max-running "
                        f"requests at the model's full context, within a quarter of the memory the cache lives in "
                        f"(the machine's or the container's, or the GPU's free memory), at least "
                        f"{DEFAULT_KV_TOKENS:,} and one context; float32 SmolLM2-135M takes ~46 KB a token, and a "
                        f"running sequence's cache up to a quarter more for room to grow; llama.cpp: its --n-ctx, "
                        f"one sequence's cache)")
    p.add_argument("--prefix-cache-tokens", type=nonneg, default=PREFIX_CACHE_TOKENS,
                   metavar="N",
                   help=f"keep the KV cache of recent requests (prompt + answer), per tenant, up to N tokens over "
                        f"all tenants (least recently used evicted first), and start each request from the longest "
                        f"cached prefix of its prompt; 0 = off (default {PREFIX_CACHE_TOKENS:,}; float32 "
                        f"SmolLM2-135M takes ~46 KB a token; llama.cpp keeps the previous request's tokens in its own "
                        f"cache, and a request of the same tenant starts from up to N of them)")
    p.add_argument("--prefix-disk-bytes", type=byte_size, default=None, metavar="SIZE",
                   help=f"with --corpus-dir and the prefix cache on: also write each cached prefix of at least 128 "
                        f"tokens to disk beside its tenant's corpus, so a restarted server, and every other server "
                        f"on the directory, starts a request from it instead of prefilling; SIZE (bytes, or 512M, "
                        f"4G) bounds all entries in the directory, least recently used removed first; 0 = memory "
                        f"only (default {PREFIX_DISK_BYTES >> 30}G; float32 SmolLM2-135M takes ~46 KB a token)")
    p.add_argument("--prefix-disk-tenant-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="bound of one tenant's prefix entries on disk (default: --prefix-disk-bytes)")
    p.add_argument("--no-answer-cache", action="store_true",
                   help="decode every request; by default a greedy request (temperature 0, no logprobs, no "
                        "response_format, no tools) whose tenant was already answered for the identical "
                        "prompt under the same settings gets that answer again without a forward, cut at its own "
                        "max_tokens and stop strings (exact: the stored answer is plain greedy decoding's; a request "
                        "that would run past the stored answer is decoded)")
    p.add_argument("--max-tokens-default", type=positive, default=None, metavar="N",
                   help="token cap of a chat request that sends no max_tokens (default: up to the end of the "
                        "context, as vLLM; completions keep OpenAI's default of 16)")
    p.add_argument("--cors-origins", nargs="+", action="extend", default=[], metavar="ORIGIN",
                   help="origins browser front ends may call from, e.g. http://localhost:3000, or '*' for any "
                        "(answers CORS preflight OPTIONS requests); default: none")
    p.add_argument("--quiet", action="store_true",
                   help="no access-log line per request on stderr (status, tenant, tokens, tokens per forward, "
                        "prefix-hit tokens, seconds, request id)")
    add_threads_arg(p)
    p.set_defaults(func=cmd_serve)


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"redraft serve: error: {msg}")


def model_id_of(loaded, served_name: str | list[str] | None) -> str:
    """The id clients use: --served-model-name (its first name), else the model directory's or GGUF file's base
    name."""
    if isinstance(served_name, list):
        served_name = served_name[0] if served_name else None
    if served_name:
        return served_name
    if loaded.name == "default":
        return DEFAULT_MODEL_FILE.split(".")[0]
    return os.path.basename(os.path.normpath(str(loaded.name))) or str(loaded.name)




def max_running_of(args) -> int:
    """``--max-running``, or its default for the runtime: 1 for llama.cpp (one sequence, whose cache the next
    request of the same tenant starts from), else :data:`DEFAULT_MAX_RUNNING`."""
    given = getattr(args, "max_running", None)
    if given is not None:
        return given
    return 1 if getattr(args, "runtime", "transformers") == "llama.cpp" else DEFAULT_MAX_RUNNING


def check_runtime(args) -> None:
    """The runtime's cheap checks, before anything slow (no torch): ``--max-running`` (resolved in ``args`` by
    :func:`max_running_of`), and for llama.cpp that ``--model`` names a GGUF file and ``--dtype`` is float32.

    Raises:
        SystemExit: one line naming the flag.
    """
    args.max_running = max_running_of(args)
    if getattr(args, "runtime", "transformers") != "llama.cpp":
        return
    try:
        resolve_gguf(args.model)
    except ModelLoadError as e:
        raise _fail(str(e)) from None
    if args.dtype != "float32":
        raise _fail(f"--dtype {args.dtype}: the llama.cpp runtime runs the GGUF file's own quantization (leave "
                    "--dtype at float32)")


def speculation_config(args):
    """How requests draft: :meth:`redraft.compose.SpeculationConfig.from_args` on the shared draft flags (the
    environment's ``REDRAFT_CORPUS_K`` / ``..._MINACC`` too, as ``redraft run``); ``--corpus`` files are the shared
    corpus, not a draft-corpus path.

    Raises:
        SystemExit: a bad environment value; ``--k-max`` not above ``--k``.
    """
    cfg = config_from_args(args)
    cfg = dataclasses.replace(cfg, grammar=not getattr(args, "no_grammar_drafts", False))
    if cfg.k_max is not None and cfg.k_max <= cfg.depth:
        raise _fail(f"--k-max {cfg.k_max}: no effect unless above the draft depth --k {cfg.depth}")
    return cfg


def build_server(args, loaded=None):
    """Everything but the socket: tenants, model, corpora, generator and :class:`redraft.server.app.Server`.

    Raises SystemExit with one line for a bad tenants file, corpus file, corpus directory or model, or a runtime
    flag that cannot apply (:func:`check_runtime`). ``args.max_running`` is resolved to its runtime's default.
    """
    check_runtime(args)  # before the imports below (torch)
    from redraft.corpus import tokenizer_fingerprint

    # torch-bound: the generator runs the engine
    from redraft.server.admission import KVBudget
    from redraft.server.answer_cache import AnswerCache
    from redraft.server.app import Server
    from redraft.server.corpora import CorporaError, TenantCorpora
    from redraft.server.generation import Generator
    from redraft.server.options import ServerOptions
    from redraft.server.prefix_cache import open_prefix_cache
    from redraft.server.tenants import Tenants, TenantsError

    config = speculation_config(args)
    try:  # the cheap checks first, before the model load
        tenants = Tenants.from_file(args.tenants) if args.tenants else Tenants()
    except TenantsError as e:
        raise _fail(str(e)) from None
    for path in args.corpus:
        if not os.path.isfile(path):
            raise _fail(f"--corpus {path}: no such file")
    for flag in ("prefix_disk_bytes", "prefix_disk_tenant_bytes"):
        if getattr(args, flag) is not None and not args.corpus_dir:
            raise _fail(f"--{flag.replace('_', '-')}: no effect without --corpus-dir (entries on disk live there)")
    if args.prefix_cache_tokens == 0 and (args.prefix_disk_bytes or args.prefix_disk_tenant_bytes):
        raise _fail("--prefix-disk-bytes: no effect with --prefix-cache-tokens 0 (entries on disk are the cache's)")
    if args.prefix_disk_tenant_bytes is not None and args.prefix_disk_bytes == 0:
        raise _fail("--prefix-disk-tenant-bytes: no effect with --prefix-disk-bytes 0 (no entries on disk)")
    if args.max_running <= 1 and args.max_batch_tokens is not None:
        raise _fail(f"--max-batch-tokens {args.max_batch_tokens}: no effect with --max-running 1 (requests run one "
                    "at a time, unbatched)")
    if loaded is None:
        loaded = load_model_or_exit(args.model, dtype=args.dtype, runtime=getattr(args, "runtime", "transformers"),
                                    n_ctx=getattr(args, "n_ctx", None), sequences=args.max_running)
    elif loaded.runtime != getattr(args, "runtime", "transformers"):
        raise ValueError(f"build_server: a {loaded.runtime} model for --runtime {getattr(args, 'runtime', None)}")
    elif loaded.runtime == "llama.cpp" and loaded.model.n_seq_max < args.max_running:
        raise ValueError(f"build_server: a llama.cpp context of {loaded.model.n_seq_max} sequences for "
                         f"--max-running {args.max_running}")
    try:
        corpora = TenantCorpora(tenants.names, args.corpus_dir, vocab_size=loaded.vocab_size,
                                fingerprint=tokenizer_fingerprint(loaded.tokenizer), cap_tokens=args.cap_tokens,
                                sync=args.sync, learn=not args.no_learn, shared=args.corpus,
                                compact_tokens=args.compact_tokens)
    except CorporaError as e:
        raise _fail(str(e)) from None
    prefix_cache = None
    if args.prefix_cache_tokens and (loaded.runtime == "transformers" or args.max_running == 1):
        # llama.cpp: the tokens its one sequence holds (several sequences: no prefix reuse)
        prefix_cache = open_prefix_cache(loaded.model, args.prefix_cache_tokens, args.corpus_dir,
                                         disk_bytes=PREFIX_DISK_BYTES if args.prefix_disk_bytes is None
                                         else args.prefix_disk_bytes,
                                         tenant_bytes=args.prefix_disk_tenant_bytes)
    budget = KVBudget(kv_capacity(args, loaded), prefix_cache)
    generator = Generator(loaded, corpora, config, prefix_cache=prefix_cache, budget=budget,
                          batcher=step_batcher(args, loaded),
                          answers=None if args.no_answer_cache else AnswerCache())
    generator.warm_up(tenants.names)
    options = ServerOptions(access_log=not args.quiet, cors_origins=list(args.cors_origins),
                            max_tokens_default=args.max_tokens_default,
                            tokenizer_info=args.enable_tokenizer_info_endpoint)
    names = args.served_model_name or []
    return Server(generator, tenants, model_id_of(loaded, names), max_queue=args.max_queue,
                  max_running=args.max_running, options=options, tool_call_parser=args.tool_call_parser,
                  aliases=tuple(names[1:]), literal_content=not args.special_tokens_in_content)


def kv_capacity(args, loaded) -> int:
    """``--kv-tokens``, or the default for the model (:func:`redraft.server.admission.default_kv_tokens`); on
    llama.cpp its cache (``--n-ctx`` tokens for each of the ``--max-running`` sequences), or ``--kv-tokens`` when
    smaller."""
    from redraft.server.admission import default_kv_tokens, kv_bytes_per_token

    if loaded.runtime != "transformers":
        context = loaded.model.max_length  # one sequence's
        cache = context * min(loaded.model.n_seq_max, args.max_running)
        if args.kv_tokens is None:
            return cache
        if args.kv_tokens < context:
            print(f"redraft serve: warning: --kv-tokens {args.kv_tokens:,} is under llama.cpp's {context:,}-token "
                  f"context: a request whose prompt + max_tokens exceeds it is refused (400)", file=sys.stderr)
        elif args.kv_tokens < cache:
            print(f"redraft serve: warning: --kv-tokens {args.kv_tokens:,} holds {args.kv_tokens // context} "
                  f"request(s) at llama.cpp's full {context:,}-token context at once: longer ones wait",
                  file=sys.stderr)
        return min(args.kv_tokens, cache)
    config = loaded.model.config
    if args.kv_tokens is not None:
        context = getattr(config, "max_position_embeddings", None)
        if context and args.kv_tokens < context:
            print(f"redraft serve: warning: --kv-tokens {args.kv_tokens:,} is under the model's {context:,}-token "
                  f"context: a request whose prompt + max_tokens exceeds it is refused (400)", file=sys.stderr)
        return args.kv_tokens
    param = next(loaded.model.parameters())
    return default_kv_tokens(getattr(config, "max_position_embeddings", None), max_running=args.max_running,
                             bytes_per_token=kv_bytes_per_token(getattr(config, "text_config", None) or config,
                                                                param.element_size()),
                             memory_bytes=kv_memory_bytes(param.device))


def full_context_note(capacity: int, context: int | None, max_running: int) -> str:
    """A note for the start-up line when the KV budget holds fewer than ``max_running`` requests at the full
    context (a chat request without max_tokens reserves up to the context's end), else ''."""
    if not context or capacity // context >= max_running:
        return ""
    return (f"; it holds {capacity // context} requests at the full {context:,}-token context: requests without "
            f"max_tokens beyond those wait, set max_tokens or --max-tokens-default to run more")


def kv_memory_bytes(device) -> int | None:
    """The memory the KV cache lives in, in bytes: on a GPU what is free there after the model loaded; on the CPU
    the machine's memory, or the container's limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) when
    lower. None when unknown."""
    import psutil
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    total = int(psutil.virtual_memory().total)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def step_batcher(args, loaded):
    """The step batcher the running requests share (``--max-batch-tokens``), or None with ``--max-running 1``
    (requests one at a time on a plain target, as without batching). On llama.cpp each running request is a
    sequence of the target's context, batched by llama.cpp (:class:`~redraft.runtimes.llamacpp.batching.
    LlamaStepBatcher`)."""
    if args.max_running <= 1:
        return None
    if loaded.runtime == "llama.cpp":
        from redraft.runtimes.llamacpp.batching import LlamaStepBatcher

        if args.max_batch_tokens is not None and args.max_batch_tokens > loaded.model.n_batch:
            print(f"redraft serve: warning: --max-batch-tokens {args.max_batch_tokens}: llama.cpp's batch holds "
                  f"{loaded.model.n_batch} tokens; a step carries at most that many", file=sys.stderr)
        return LlamaStepBatcher(loaded.model, max_batch_tokens=args.max_batch_tokens)
    from redraft.runtimes.transformers.batching import StepBatcher

    return StepBatcher(loaded.model, max_batch_tokens=args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS)


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket; SystemExit with one line when the address cannot be used."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: asyncio sets TCP_NODELAY itself only on sockets made with proto
        # IPPROTO_TCP, and without it every keep-alive response waited ~40 ms for a delayed ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        raise _fail(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def kv_gib(server) -> float | None:
    """GiB the server's KV budget takes at most (tokens x bytes per token in the model's dtype); None on llama.cpp
    (the cache is llama.cpp's own, sized by ``--n-ctx``)."""
    from redraft.server.admission import kv_bytes_per_token

    g = server.generator
    if g.runtime != "transformers":
        return None
    per = kv_bytes_per_token(g.model.config, g.facts.dtype.itemsize)
    return g.budget.capacity * per / 2**30


def disk_note(cache) -> str:
    """The startup line's words on the prefix cache's disk entries ("" without them)."""
    disk = getattr(cache, "disk", None)
    if disk is None:
        return ""
    return f" (on disk too: up to {human_bytes(disk.max_bytes)} in the corpus directory, shared with its other servers)"


def human_bytes(n: int) -> str:
    """``n`` bytes as the largest binary unit that leaves at least 1 (``512 MiB``, ``4 GiB``, ``1.5 KiB``)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def cmd_serve(args) -> int:
    import uvicorn

    from redraft.runtimes.host_memory import first_request_bytes, keep_freed_memory, prefault

    log_to_stderr("serve")
    kept = keep_freed_memory()  # before the threads that allocate start
    sock = listen(args.host, args.port)  # before the model load: a busy port fails in a second
    server = build_server(args)
    backed = first_request_bytes(getattr(server.generator.prefix_cache, "disk", None)) if kept else 0
    seconds = prefault(backed)  # pages given back at once where the heap does not keep them: then none
    if seconds > 0.2:
        print(f"redraft serve: {human_bytes(backed)} of memory backed for the first requests in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    corpora = server.generator.corpora
    learned = sum(c.n_tokens for c in corpora.learned.values())
    where = args.corpus_dir or "memory only"
    capacity = server.generator.budget.capacity
    prefix = min(args.prefix_cache_tokens, capacity)  # the prefix cache keeps what the KV budget leaves
    note = full_context_note(capacity, server.generator.context_length, args.max_running)
    gib = kv_gib(server)
    if gib is None and args.max_running > 1:  # llama.cpp: a sequence of its context per running request
        prefix_text = f"{server.generator.runtime}'s own with --max-running 1 only"
        kv_text = (f"KV {capacity:,} tokens in {server.generator.runtime}'s own cache ({args.max_running} "
                   f"sequences of --n-ctx {server.generator.context_length:,})")
    elif gib is None:  # llama.cpp: one sequence in its own cache
        prefix_text = f"{server.generator.runtime}'s own (the previous request's tokens, same tenant)"
        kv_text = f"KV {capacity:,} tokens in {server.generator.runtime}'s own cache (--n-ctx)"
    else:
        prefix_text = f"{prefix:,} tokens at most"
        kv_text = f"KV budget {capacity:,} tokens = {gib:.2f} GiB at most"
    print(f"redraft serve: {server.model_id} on http://{host}:{port}/v1 ({len(server.tenants.names)} tenant"
          f"{'s' if len(server.tenants.names) != 1 else ''}, learned corpus {learned} ids in {where}"
          f"{', not learning' if args.no_learn else ''}, prefix cache "
          f"{prefix_text if args.prefix_cache_tokens else 'off'}{disk_note(server.generator.prefix_cache)}, answer cache "
          f"{'on' if server.generator.answers is not None else 'off'}, "
          f"{args.max_running} running at most, {kv_text}{note})", file=sys.stderr, flush=True)
    others = sum(c.stats()["journals"] for c in corpora.learned.values()) if args.corpus_dir else 0
    if others:
        print(f"redraft serve: {args.corpus_dir}: also reading {others} journal{'s' if others != 1 else ''} (what "
              f"earlier runs learned, not yet compacted, or other servers and vLLM proposers learning into it now)",
              file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
