"""What a server operator sets beyond the model and corpora: logging, browser access, default answer length.

Defaults are what ``redraft serve`` uses without flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerOptions:
    """Operator settings of one server.

    Attributes:
        access_log: one line per request on stderr (``--quiet`` turns it off).
        cors_origins: origins browsers may call from (``*`` = any); empty = no CORS headers, as without the
            middleware. Uses FastAPI's (Starlette's) ``CORSMiddleware``, which also answers ``OPTIONS`` preflights.
        max_tokens_default: the token cap of a chat request that sends no ``max_tokens`` (None = up to the end of
            the context, as vLLM does). Completions keep OpenAI's default of 16.
        tokenizer_info: serve ``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``). Off by default, as in
            vLLM: the route shows the chat template, and its presence makes lm-evaluation-harness' API models pick
            their ``remote`` tokenizer backend, which cannot apply a chat template to completions prompts.
    """

    access_log: bool = True
    cors_origins: list[str] = field(default_factory=list)
    max_tokens_default: int | None = None
    tokenizer_info: bool = False
