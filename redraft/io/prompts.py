"""Prompt text -> prompt token ids: the one encoding every command uses (run, freeze, demo, oracle, bench, glide).

Normalisation, the same everywhere so that a prompt typed on the command line, read from a prompts file or piped
on stdin gives the same ids (and a frozen answer replays): **surrounding whitespace of each message's text is
dropped** (``str.strip()``); whitespace inside the text is kept. A shell argument, a file line and a piped line
differ exactly there (``"  hi  "``, ``"hi"``, ``"hi\\n"``), invisibly, and a one-token difference in the prompt
sends a replay down another path. The price: a raw (``--no-chat``) prompt cannot end in whitespace.

Instruct models (the tokenizer has a chat template) get the template with the generation prompt appended; other
models get the text tokenised as is, several messages joined by a blank line. :func:`encode_chat` (the server's
chat encoder) can also keep special-token strings inside message content as plain text.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

Messages = Sequence[Mapping[str, str]]


def normalize_prompt(text: str) -> str:
    """The text of one message as it is encoded: surrounding whitespace dropped (see the module doc)."""
    return text.strip()


def uses_chat_template(tokenizer, chat: bool | None = None) -> bool:
    """Whether :func:`encode_prompt` applies the chat template: ``chat`` when given, else whether the tokenizer
    has one."""
    return getattr(tokenizer, "chat_template", None) is not None if chat is None else chat


def encode_prompt(tokenizer, prompt: str | Messages, *, chat: bool | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids for a user prompt, or for a conversation ending with a user turn.

    Args:
        tokenizer: a transformers tokenizer (``apply_chat_template`` and ``__call__`` are used).
        prompt: the user's text, or chat messages (``{"role": ..., "content": ...}``, oldest first; other keys
            such as ``tool_calls`` go to the template as they are; a None content is written as "").
        chat: force the chat template on/off; None = use it when the tokenizer has one.
        tools: OpenAI tool objects for a template that renders tools (:func:`template_renders_tools`); None = none.
    Returns:
        list of int token ids (prompt only; the generation prompt is appended when templated).
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = [dict(m, content=normalize_prompt(m["content"] or "")) for m in messages]
    if uses_chat_template(tokenizer, chat):
        kw = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "\n\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes OpenAI ``tools`` into the prompt (rendering a probe tool
    changes the text); False for a template that refuses the ``tools`` argument or has none."""
    if not uses_chat_template(tokenizer):
        return False
    probe = [{"type": "function", "function": {"name": "redraft_probe_tool", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # jinja raises for templates that cannot take the argument
        return False
    return "redraft_probe_tool" in text


def _specials(tokenizer) -> list[str]:
    return [t for t in getattr(tokenizer, "all_special_tokens", []) + list(
        getattr(tokenizer, "added_tokens_encoder", {}) or {}) if t]


def encode_chat(tokenizer, messages: Sequence[Mapping], *, literal: bool = True,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
    """Ids of a conversation through the chat template (see the module doc for ``literal``). Each message's text
    is normalised as every redraft command normalises it (:func:`redraft.io.prompts.normalize_prompt`), so a chat
    request replays what ``redraft run`` saw for the same text.

    With ``literal`` (the server's default), a special-token string inside message content (``<|im_end|>
    <|im_start|>system``) is tokenized as the characters it is, while the template's own markers stay control
    tokens: the template is rendered with a placeholder per message, its text tokenized with special tokens parsed
    and each message's content with them split (transformers' ``split_special_tokens``). Content holding no
    special-token string gives exactly :func:`encode_prompt`'s ids. ``literal=False`` parses them everywhere.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: ``{"role", "content"}`` dicts, oldest first.
        add_generation_prompt: append the template's assistant header.
        tools: OpenAI tool objects for a template that renders tools (:func:`template_renders_tools`); None = none.
    Returns:
        list of int token ids.
    Raises:
        whatever the template raises for a conversation it refuses (jinja2 errors, ValueError); ValueError when a
        template changes the content so that it cannot be kept as text.
    """
    messages = [dict(m, content=normalize_prompt(m["content"] or "")) for m in messages]
    specials = _specials(tokenizer)
    kw = {"tools": tools} if tools else {}
    if not literal or not any(s in m["content"] for m in messages for s in specials):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **kw)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    marks = [f"\x00{uuid.uuid4().hex}{i}\x00" for i in range(len(messages))]
    text = tokenizer.apply_chat_template([dict(m, content=k) for m, k in zip(messages, marks, strict=True)],
                                         add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
    ids: list[int] = []
    for m, k in zip(messages, marks, strict=True):
        if k not in text:
            raise ValueError("the chat template changes message content; cannot keep it as plain text "
                             "(serve with --special-tokens-in-content)")
        before, text = text.split(k, 1)
        ids += _plain(tokenizer, before)
        ids += [int(i) for i in tokenizer(m["content"], add_special_tokens=False,
                                          split_special_tokens=True)["input_ids"]]
    return ids + _plain(tokenizer, text)


def _plain(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
