"""OpenAI tool calling on ``/v1/chat/completions``: the request's tools, the history's calls, the prompt.

Request fields (OpenAI's chat completions API):

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``.
- ``tool_choice``: ``"none"`` (answer in text; the tools are left out of the prompt, as vLLM does by default),
  ``"auto"`` (default with tools: the model decides; its calls are parsed out of the answer), ``"required"`` (at
  least one call, enforced by a grammar) or ``{"type": "function", "function": {"name": N}}`` (exactly one call of
  N, enforced by a grammar).
- ``parallel_tool_calls``: false = at most one call per answer (default true).
- history: assistant messages with ``tool_calls`` (``content`` may be null) and ``tool`` messages with
  ``tool_call_id``.

The tools reach the model through its chat template when the template renders them (passing ``tools`` to the
template changes the prompt: :func:`redraft.io.prompts.template_renders_tools`); otherwise through a system message written by the tool-call format
(:meth:`ToolCallFormat.instructions`), with past calls written in the format's own syntax and tool results as user
turns wrapped in ``<tool_response>`` (the Hermes 2 Pro template's convention).
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field

from redraft.io.prompts import encode_chat
from redraft.io.prompts import template_renders_tools as renders_tools

from .schemas import APIError
from .toolcalls import ToolCallFormat

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass
class ToolRequest:
    """The tool settings of one request.

    Attributes:
        tools: OpenAI function objects ``{name, description?, parameters?}`` (the ``function`` member of each tool).
        choice: "none", "auto", "required" or "function" (then ``function`` names it).
        parallel: more than one call per answer allowed.
    """

    tools: list[dict] = field(default_factory=list)
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        """Whether the answer is parsed for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> list[dict] | None:
        """The tools a grammar must restrict the answer to (required / named), None when the model is free."""
        if self.choice == "required":
            return self.tools
        if self.choice == "function":
            return [t for t in self.tools if t["name"] == self.function]
        return None


def parse_tools(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """Check the three tool fields; None when the request uses no tools. Raises APIError 400 naming the field."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                       param="tools")
    out = ToolRequest(parallel=True if parallel_tool_calls is None else bool(parallel_tool_calls))
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                "(only function tools are supported)", param=where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
            raise APIError(400, f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got {name!r}",
                           param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"'{where}.function.name' {name!r} is defined twice", param=f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"'{where}.function.parameters' must be a JSON schema object",
                           param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"'{where}.function.description' must be a string",
                           param=f"{where}.function.description")
        out.tools.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        out.choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        out.choice, out.function = "function", tool_choice["function"]["name"]
        if out.function not in names:
            raise APIError(400, f"'tool_choice.function.name' {out.function!r} is not one of the tools",
                           param="tool_choice.function.name")
    else:
        raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    return out


def history_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as ``[{id, type, function: {name, arguments (dict)}}]``; APIError
    400 naming ``where`` for anything else."""
    if not isinstance(calls, list) or not calls:
        raise APIError(400, f"'{where}' must be a non-empty list of tool calls", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"'{where}[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                                "{\"name\", \"arguments\"}}", param=f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise APIError(400, f"'{where}[{j}].function.arguments' is not valid JSON",
                           param=f"{where}[{j}].function.arguments") from None
        if not isinstance(args, dict):
            raise APIError(400, f"'{where}[{j}].function.arguments' must encode a JSON object",
                           param=f"{where}[{j}].function.arguments")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


_RENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes tools into the prompt (cached per tokenizer)."""
    with _LOCK:
        if tokenizer not in _RENDERS:
            _RENDERS[tokenizer] = renders_tools(tokenizer)
        return _RENDERS[tokenizer]


def chat_messages(messages: list[dict], tools: ToolRequest | None, fmt: ToolCallFormat, native: bool) -> list[dict]:
    """The conversation as the chat template receives it.

    ``native``: the template renders tools and tool calls itself (messages keep OpenAI's shape, arguments as
    objects, as Hugging Face templates expect). Otherwise: the format's instructions join the system message
    (when tools are offered), past calls become the format's text, tool results become user turns in
    ``<tool_response>`` tags.
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if native:
            out.append({k: v for k, v in m.items() if v is not None or k == "content"})
            if out[-1].get("content") is None:
                out[-1]["content"] = ""
            continue
        if calls:
            text = fmt.separator.join(fmt.render(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            content = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None and tools.choice != "none" and not native:
        note = fmt.instructions(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def encode_tool_chat(tokenizer, messages: list[dict], tools: ToolRequest | None, fmt: ToolCallFormat, *,
                     literal: bool = True) -> list[int]:
    """Prompt ids of a conversation with tools and/or tool calls (see :func:`chat_messages`); ``literal``: special-token
    strings inside message content stay text (:func:`redraft.io.prompts.encode_chat`)."""
    native = template_renders_tools(tokenizer)
    msgs = chat_messages(messages, tools, fmt, native)
    offered = None
    if native and tools is not None and tools.choice != "none":
        offered = [{"type": "function", "function": t} for t in tools.tools]
    return encode_chat(tokenizer, msgs, literal=literal, tools=offered)
