"""Prompt text -> ids for the server, and vLLM's tokenizer routes, so a harness needs no local tokenizer.

- Completions text is tokenized **exactly as sent** (no whitespace stripped, unlike the CLI's
  :func:`redraft.io.prompts.encode_prompt`): a few-shot prompt ending in ``"Answer: "`` keeps its space.
- Chat message content is **plain text**: a special-token string inside it (``<|im_end|><|im_start|>system``)
  is tokenized as the characters it is, while the chat template's own markers stay control tokens. The template is
  rendered with a placeholder per message, its text is tokenized with special tokens parsed and each message's
  content with them split (transformers' ``split_special_tokens``). Content holding no special-token string is
  tokenized exactly as before (the whole rendered text at once). ``literal=False`` (``redraft serve
  --special-tokens-in-content``) restores parsing them everywhere.
- ``POST /tokenize`` (``{"prompt", "add_special_tokens"}`` or ``{"messages", "add_generation_prompt"}``) ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``; ``POST /detokenize`` (``{"tokens"}``) -> ``{"prompt"}``;
  ``GET /tokenizer_info`` -> the special tokens and the chat template (vLLM's routes, which
  lm-evaluation-harness' ``tokenizer_backend=remote`` calls). ``/tokenizer_info`` is served only when the
  operator asks (``ServerOptions.tokenizer_info``), as vLLM serves it only with ``--enable-tokenizer-info-endpoint``:
  lm-eval's API models choose their remote tokenizer when the route answers, and that backend hands a chat-templated
  conversation to a text tokenizer (lm-eval's chat template option on ``local-completions`` fails).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from redraft.io.prompts import encode_chat

from .openapi import error_responses, request_body
from .schemas import APIError, Message, ParsedRequest, TokenId, check_message_fields, parse_request

_MAX_TOKEN_CHARS: dict[int, int] = {}  # id(tokenizer) -> the longest vocabulary entry in characters


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer``'s vocabulary spans (its longest entry, added tokens included;
    a byte-level entry has a character per byte, at least as many as the text it decodes to). Cached per tokenizer."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        _MAX_TOKEN_CHARS[key] = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return _MAX_TOKEN_CHARS[key]


def refuse_overlong(tokenizer, req: ParsedRequest, context: int | None) -> None:
    """Refuse a prompt whose text is too long for ``context`` tokens before tokenizing it: at least
    characters / :func:`max_token_chars` tokens, so it could never fit. Tokenizing megabytes takes seconds, which
    would hold up every other request. Raises APIError 400 (context_length_exceeded)."""
    if not context:
        return
    if req.kind == "chat":
        what, verb = "messages", "hold"
        chars = sum(len(c) if isinstance(c, str) else sum(len(p.get("text") or "") for p in c if isinstance(p, dict))
                    for c in (m.get("content") or "" for m in req.messages or []))
    elif isinstance(req.prompt, str):
        what, verb, chars = "prompt", "holds", len(req.prompt)
    else:
        return
    longest = max_token_chars(tokenizer)
    if chars > context * longest:
        raise APIError(400, f"the {what} {verb} {chars} characters; this model's context is {context} tokens and a "
                            f"token spans at most {longest} characters, so they cannot fit", param=what,
                       code="context_length_exceeded")


def text_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Ids of ``text`` exactly as given (the tokenizer's own special tokens, e.g. a BOS, added when asked)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Strict):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (a conversation through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int | None
    vocab_size: int


def _parse(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        path = "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x))
                       for i, x in enumerate(err["loc"]))
        raise APIError(400, f"'{path}': {err['msg'].lower()}", param=path or None) from None


def add_routes(app: FastAPI, server) -> None:
    """``/tokenize``, ``/detokenize`` and, when ``server.options.tokenizer_info``, ``/tokenizer_info`` on ``app``
    (authenticated like the API); ``server`` is the :class:`redraft.server.app.Server` (its tenant, body, model_name
    checks, options and generator)."""
    tok = server.generator.tokenizer

    @app.post("/tokenize", response_model=TokenizeResponse, openapi_extra=request_body(TokenizeRequest),
              responses=error_responses(400, 401, 404, 413, 415),
              summary="Token ids of a prompt or a conversation (vLLM's route)")
    async def tokenize(request: Request):
        server.tenant(request)
        body = await server.body(request)
        check_message_fields(body.get("messages"))
        req = _parse(TokenizeRequest, body)
        server.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            ids = text_ids(tok, req.prompt, req.add_special_tokens is not False)
        else:
            msgs = parse_request({"messages": [m.model_dump(exclude_none=True) for m in req.messages]},
                                 "chat").messages
            try:
                ids = encode_chat(tok, msgs, literal=server.literal_content,
                               add_generation_prompt=req.add_generation_prompt)
            except Exception as e:  # the template refused the conversation
                raise APIError(400, f"the chat template refused these messages ({e})", param="messages") from e
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.generator.context_length, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=request_body(DetokenizeRequest),
              responses=error_responses(400, 401, 404, 413, 415),
              summary="Text of token ids (vLLM's route)")
    async def detokenize(request: Request):
        server.tenant(request)
        req = _parse(DetokenizeRequest, await server.body(request))
        server.model_name(req.model)
        vocab = server.generator.vocab_size
        bad = [i for i, t in enumerate(req.tokens) if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"'tokens[{bad[0]}]' {req.tokens[bad[0]]} is outside the vocabulary "
                                f"(0..{vocab - 1})", param=f"tokens[{bad[0]}]")
        return {"prompt": tok.decode(req.tokens)}

    if not server.options.tokenizer_info:
        return

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=error_responses(401), summary="The tokenizer's special tokens and chat "
             "template (vLLM's route)")
    async def tokenizer_info(request: Request):
        server.tenant(request)
        ctx = server.generator.context_length
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": ctx, "vocab_size": server.generator.vocab_size}
