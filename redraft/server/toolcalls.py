"""Tool-call formats: how a model writes a tool call, how redraft reads it back, and the grammar that forces one.

A :class:`ToolCallFormat` is what vLLM calls a tool-call parser (``--tool-call-parser``): the text convention a
model family was trained on. redraft ships two, selected by ``redraft serve --tool-call-parser``:

- ``hermes`` (default; NousResearch Hermes 2 Pro, Qwen 2.5 and most ChatML models)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  one block per call; text before the first block is the message's content.
- ``llama3_json`` (Llama 3.1/3.2's JSON tool calling): the whole answer is ``{"name": ..., "parameters": {...}}``,
  several calls separated by ``; ``.

Each format gives (1) the fallback system message that describes the tools to a model whose chat template does not
render them, (2) the Lark grammar (llguidance dialect, arguments as embedded JSON schemas) that makes the output a
valid call of the allowed tools (``tool_choice`` ``required`` or a named function), (3) the parser that turns the
output text into OpenAI ``tool_calls``, and (4) :class:`ContentFilter`, which streams the content before a call and
holds the call back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from redraft.grammar import JSON_OPTIONS, json_rule


@dataclass(frozen=True)
class ToolCallFormat:
    """One convention for writing tool calls in text.

    Attributes:
        name: the ``--tool-call-parser`` value.
        begin, end: the text around each call's JSON object ("" for a bare JSON answer).
        separator: between two calls.
        arguments_key: the key holding the arguments object ("arguments" or "parameters").
    """

    name: str
    begin: str
    end: str
    separator: str
    arguments_key: str

    def render(self, name: str, arguments: dict) -> str:
        """One call as the model writes it (for assistant turns of the history)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.begin}{body}{self.end}"

    def instructions(self, tools: list[dict]) -> str:
        """The fallback system message describing ``tools`` (OpenAI function objects) and the call syntax."""
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        example = self.render("function_name", {"argument": "value"})
        return ("You may call one or more functions to assist with the user query. The functions you can call "
                f"are listed within <tools></tools>:\n<tools>\n{listing}\n</tools>\n"
                f"To call a function, answer with its name and JSON arguments exactly like this:\n{example}")

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar whose sentences are one call (or, with ``parallel``, one or more calls) of ``tools``,
        each with arguments valid under that tool's parameters schema."""
        rules = []
        for i, t in enumerate(tools):
            schema = {"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                      "properties": {"name": {"const": t["name"]},
                                     self.arguments_key: t.get("parameters") or {"type": "object"}}}
            rules.append(f"obj_{i}: {json_rule(schema)}")
        alts = " | ".join(f"obj_{i}" for i in range(len(tools)))
        call = f"call: {json.dumps(self.begin)} obj {json.dumps(self.end)}" if self.begin else "call: obj"
        start = f"start: call ({json.dumps(self.separator)} call)*" if parallel else "start: call"
        return "\n".join([start, call, f"obj: {alts}", *rules])

    def lazy_grammar(self, tools: list[dict], special: bool) -> str | None:
        """For ``tool_choice: "auto"``: a Lark grammar of free text in which every call, once its wrapper begins,
        must be a valid call of one of ``tools`` (llguidance's structural tags: the wrapper is a lazy trigger).
        Free text may use every token but the tokenizer's special ones (EOS aside). None for a format without a
        wrapper (a bare JSON answer cannot be told from text until it is complete).

        Args:
            special: the wrapper's opening tag is one special token of the tokenizer (Hermes / Qwen vocabularies).
        """
        import llguidance

        if not self.begin:
            return None
        tags = [llguidance.StructTag(
            trigger=self.begin.strip(), begin=f'{self.begin}{{"name": {json.dumps(t["name"])}, "{self.arguments_key}": ',
            grammar={**(t.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}, end="}" + self.end)
            for t in tools]
        return llguidance.StructTag.to_grammar(tags, assume_special=special)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of an answer: calls as OpenAI ``tool_calls`` entries (``arguments`` a JSON string);
        content is the text outside the calls, None when there is none. Text that does not parse as a call stays
        content (a model may write the wrapper about something else), except a cut-off call: an unclosed wrapper
        at the end of the answer followed by nothing or by the start of a JSON object (an answer stopped by
        ``max_tokens`` inside a call), which is dropped, as a stream never shows text after a wrapper begins."""
        if not self.begin:
            return self._parse_bare(text)
        calls, pieces, pos, cut = [], [], 0, False
        end = self.end.strip()
        pattern = re.compile(re.escape(self.begin.strip()) + r"\s*(.*?)\s*(?:" + re.escape(end) + r"|$)", re.S)
        for m in pattern.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                if m.end() == len(text) and not m.group(0).endswith(end) and m.group(1)[:1] in ("", "{"):
                    pieces.append(text[pos:m.start()])  # a cut-off call: dropped
                    pos, cut = len(text), True
                continue
            pieces.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        pieces.append(text[pos:])
        content = "".join(pieces).strip() if calls or cut else text
        return (content or None), calls

    def _parse_bare(self, text: str) -> tuple[str | None, list[dict]]:
        parts = [p for p in text.strip().split(self.separator.strip())] if text.strip() else []
        calls = [self._call(p) for p in parts]
        if not calls or any(c is None for c in calls):
            return (text or None), []
        return None, calls

    def _call(self, blob: str) -> dict | None:
        try:
            obj = json.loads(blob)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ToolCallFormat("llama3_json", "", "", "; ", "parameters"),
}
DEFAULT_FORMAT = "hermes"


class ContentFilter:
    """Streams the content part of an answer that may contain tool calls.

    Text is passed on until the format's call wrapper begins; a tail that could be the start of the wrapper is held
    back, and nothing after the wrapper's start is streamed (the calls go out whole at the end). For a format
    without a wrapper (a bare JSON answer) everything is held until the answer is complete.
    """

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.shown = 0
        self.closed = not fmt.begin

    def feed(self, delta: str) -> str:
        """The part of ``delta`` that is surely content ('' while it may be a call)."""
        self.text += delta
        if self.closed:
            return ""
        marker = self.fmt.begin.strip()
        at = self.text.find(marker)
        if at >= 0:
            self.closed = True
            safe = at
        else:
            safe = len(self.text)
            for k in range(min(len(marker) - 1, len(self.text)), 0, -1):
                if self.text.endswith(marker[:k]):
                    safe -= k
                    break
        safe = max(safe, self.shown)
        out, self.shown = self.text[self.shown:safe], safe
        return out

    def finish(self, content: str | None) -> str:
        """What remains to stream of the final ``content`` (the parsed answer's content part)."""
        content = content or ""
        return content[self.shown:] if content.startswith(self.text[:self.shown]) else ""
