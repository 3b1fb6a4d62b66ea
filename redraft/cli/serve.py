"""``redraft serve``: the OpenAI-compatible server (see :mod:`redraft.server`).

Registering the parser imports neither the server nor torch; :func:`build_server` imports them when it runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from redraft.cli.common import (
    add_dtype_arg,
    add_model_arg,
    add_threads_arg,
    int_between,
    load_model_or_exit,
    percent,
    positive,
)
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, MAX_DRAFT_DEPTH, SERVE_CORPUS_K_MAX
from redraft.io.loading import DEFAULT_MODEL_FILE

DEFAULT_CAP_TOKENS = 1_000_000


def register(sub) -> None:
    """Add ``serve`` to the top-level sub-parsers."""
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server whose corpus grows from its own answers",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Every finished "
                    "answer joins its tenant's corpus and drafts the next requests, so a repeated request comes "
                    "back faster with identical output.")
    add_model_arg(p)
    add_dtype_arg(p)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id clients send and see (default: the model directory's name); several names are "
                        "aliases: requests may name any, /v1/models lists all, the first is the main one")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="parse special-token strings (e.g. <|im_start|>) inside chat message content as control "
                        "tokens; default: content is plain text and only the chat template's own markers are "
                        "control tokens")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_between(0, 65535), default=8000, help="TCP port (default 8000)")
    p.add_argument("--corpus-dir", default=None, metavar="DIR",
                   help="where each tenant's learned corpus is kept (journal + binary base); default: in memory "
                        "only, lost at exit")
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
    p.add_argument("--k", type=int_between(1, MAX_DRAFT_DEPTH), default=CORPUS_K_DEFAULT,
                   help=f"corpus draft depth (default {CORPUS_K_DEFAULT})")
    p.add_argument("--k-max", type=int_between(1, MAX_DRAFT_DEPTH), default=SERVE_CORPUS_K_MAX,
                   help=f"adaptive corpus depth: doubles while drafts are accepted whole, up to K "
                        f"(default {SERVE_CORPUS_K_MAX})")
    p.add_argument("--minacc", type=percent, default=100 * CORPUS_MINACC, metavar="PCT",
                   help=f"pause a corpus source whose acceptance falls below PCT%% (default {100 * CORPUS_MINACC:g})")
    p.add_argument("--no-ngram", action="store_true", help="no n-gram drafts from the live context")
    p.add_argument("--max-queue", type=positive, default=256, help="most waiting requests; 503 beyond (default 256)")
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


def build_server(args, loaded=None):
    """Everything but the socket: tenants, model, corpora, generator and :class:`redraft.server.app.Server`.

    Raises SystemExit with one line for a bad tenants file, corpus file, corpus directory or model.
    """
    from redraft.corpus import tokenizer_fingerprint

    # torch-bound: the generator runs the engine
    from redraft.server.app import Server
    from redraft.server.corpora import CorporaError, TenantCorpora
    from redraft.server.generation import DraftSettings, Generator
    from redraft.server.tenants import Tenants, TenantsError

    try:  # the cheap checks first, before the model load
        tenants = Tenants.from_file(args.tenants) if args.tenants else Tenants()
    except TenantsError as e:
        raise _fail(str(e))
    for path in args.corpus:
        if not os.path.isfile(path):
            raise _fail(f"--corpus {path}: no such file")
    if loaded is None:
        loaded = load_model_or_exit(args.model, dtype=args.dtype)
    try:
        corpora = TenantCorpora(tenants.names, args.corpus_dir, vocab_size=loaded.vocab_size,
                                fingerprint=tokenizer_fingerprint(loaded.tokenizer), cap_tokens=args.cap_tokens,
                                sync=args.sync, learn=not args.no_learn, shared=args.corpus)
    except CorporaError as e:
        raise _fail(str(e))
    draft = DraftSettings(k=args.k, k_max=max(args.k, args.k_max), minacc=args.minacc / 100.0,
                          ngram=not args.no_ngram)
    generator = Generator(loaded, corpora, draft)
    names = args.served_model_name or []
    return Server(generator, tenants, model_id_of(loaded, names), max_queue=args.max_queue,
                  aliases=tuple(names[1:]), literal_content=not args.special_tokens_in_content)


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
        raise _fail(f"cannot listen on {host}:{port} ({e.strerror or e})")
    return sock


def cmd_serve(args) -> int:
    import uvicorn

    sock = listen(args.host, args.port)  # before the model load: a busy port fails in a second
    server = build_server(args)
    host, port = sock.getsockname()[:2]
    corpora = server.generator.corpora
    learned = sum(c.n_tokens for c in corpora.learned.values())
    where = args.corpus_dir or "memory only"
    print(f"redraft serve: {server.model_id} on http://{host}:{port}/v1 ({len(server.tenants.names)} tenant"
          f"{'s' if len(server.tenants.names) != 1 else ''}, learned corpus {learned} ids in {where}"
          f"{', not learning' if args.no_learn else ''})", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
