"""A grammar constraint on a generation's output, compiled once per request with llguidance.

:class:`Constraint` holds a compiled grammar (from a JSON schema, "any JSON object", or a Lark grammar with embedded
JSON schemas, the form tool calls use) and the tokenizer it is bound to. Each generation starts its own
:class:`~redraft.grammar.state.GrammarState` (:meth:`Constraint.start`), whose matcher follows the committed tokens
and forks along the token tree, so every verify row is masked with its own node's grammar state.

The grammar library is llguidance (Microsoft's Low-level Guidance, the engine behind OpenAI-style structured output
in vLLM and SGLang): it compiles JSON schemas and Lark grammars lazily against the tokenizer, computes the allowed
token set of a state in microseconds, and forks a state with ``LLMatcher.deep_copy``. Building its tokenizer view
costs milliseconds to a second (49k tokens), so :func:`grammar_tokenizer` caches one per Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

from redraft.grammar.errors import GrammarError

# JSON whitespace is fixed: ", " between items and ": " after keys, no other whitespace, as
# json.dumps writes it. Fixed whitespace makes every separator a forced token (a grammar draft); OpenAI's strict
# structured output allows any whitespace, which a model trained on json.dumps output rarely uses anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
    """llguidance's view of a Hugging Face fast tokenizer (``llguidance.LLTokenizer``), cached per tokenizer.

    Args:
        tokenizer: a ``transformers.PreTrainedTokenizerFast``.
        vocab_size: the model's vocabulary V (rows of its logits; ids the tokenizer lacks are never allowed).
        eos_token_ids: the ids that end a generation; the grammar allows them exactly where the output may end.
    Raises:
        GrammarError: a slow (Python) tokenizer, which llguidance cannot read.
    """
    import llguidance.hf

    eos = sorted(int(e) for e in eos_token_ids)
    key = (int(vocab_size), tuple(eos))
    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=int(vocab_size),
                                                        eos_token=eos[0] if len(eos) == 1 else (eos or None))
            except ValueError as e:
                raise GrammarError(f"structured output needs a fast tokenizer ({e})") from e
        return per[key]


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar bound to one tokenizer; immutable, shared by the plain and the speculative path.

    Attributes:
        grammar: llguidance's grammar text (a JSON document naming the schema or Lark source).
        tokenizer: ``llguidance.LLTokenizer`` (:func:`grammar_tokenizer`).
        vocab_size: V, the width of the logits rows the mask applies to.
        description: what the constraint is, for messages ("JSON schema 'person'", "a tool call").
    """

    grammar: str
    tokenizer: object = field(repr=False, compare=False)
    vocab_size: int
    description: str = "grammar"

    @classmethod
    def compile(cls, grammar: str, tokenizer, vocab_size: int, description: str = "grammar") -> Constraint:
        """Check ``grammar`` (llguidance's format) against ``tokenizer`` (an LLTokenizer); GrammarError if invalid."""
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"{description}: {messages[0] if messages else 'invalid grammar'}")
        out = cls(grammar=grammar, tokenizer=tokenizer, vocab_size=int(vocab_size), description=description)
        m = out.matcher()  # a grammar can validate and still admit no first token (a schema that only refers to
        m.compute_bitmask()  # itself): the first mask puts its matcher in error, found here rather than mid-answer
        if m.is_error():
            raise GrammarError(f"{description}: no output satisfies it ({m.get_error()})")
        return out

    @classmethod
    def json_schema(cls, schema: dict, tokenizer, vocab_size: int, description: str = "JSON schema") -> Constraint:
        """Output = one JSON value valid under ``schema`` (a JSON Schema object; llguidance supports the subset
        OpenAI's strict mode allows and more). Raises GrammarError for a schema it cannot compile."""
        import llguidance

        if not isinstance(schema, dict):
            raise GrammarError(f"{description}: a JSON schema must be an object, got {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"{description}: {e}") from e
        return cls.compile(grammar, tokenizer, vocab_size, description)

    @classmethod
    def json_object(cls, tokenizer, vocab_size: int) -> Constraint:
        """Output = any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"}, tokenizer, vocab_size, "JSON object")

    @classmethod
    def lark(cls, source: str, tokenizer, vocab_size: int, description: str = "Lark grammar") -> Constraint:
        """Output = a sentence of the Lark grammar ``source`` (llguidance's dialect: ``%json {schema}`` embeds a
        JSON schema as a rule). Raises GrammarError for a grammar it cannot compile."""
        import llguidance

        return cls.compile(llguidance.LLMatcher.grammar_from_lark(source), tokenizer, vocab_size, description)

    def matcher(self):
        """A fresh ``llguidance.LLMatcher`` at the start of the output."""
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)

    def start(self, prompt_length: int):
        """The grammar state of one generation whose prompt has ``prompt_length`` tokens
        (:class:`~redraft.grammar.state.GrammarState`; the token chooser calls it in ``reset``)."""
        from redraft.grammar.state import GrammarState

        return GrammarState(self, prompt_length)


def json_rule(schema: dict) -> str:
    """The body of a Lark rule matching one JSON value valid under ``schema``, written with JSON_OPTIONS' fixed
    whitespace (llguidance's ``%json {...}`` with ``x-guidance`` options), e.g. ``obj: `` + json_rule(schema)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"), ensure_ascii=False)
