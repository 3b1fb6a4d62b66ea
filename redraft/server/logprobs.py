"""OpenAI's log-probability objects from :class:`redraft.decoding.logprobs.TokenLogprob` lists.

- ``/v1/completions`` (the legacy object): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one
  entry per token; with ``echo`` the prompt's tokens come first, the first of them with ``null`` log-probability
  and ``null`` alternatives (it has no context). ``top_logprobs`` entries map token text to log-probability:
  the ``logprobs`` most likely tokens plus the listed token itself when it is not among them (up to
  ``logprobs + 1`` entries, as OpenAI and vLLM answer; two ids with the same text keep the more likely one).
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.

Streamed (``stream: true``), each chunk carries the entries of the tokens accepted since the previous chunk (several
under speculation), the rest with the finishing chunk, so the chunks' entries put end to end are the whole answer's.

Every output token is listed, an ending EOS included (vLLM does the same; lm-evaluation-harness' loglikelihood
requests rely on the one generated token being the last entry). Token text is each id decoded alone (a piece of a
multi-byte character decodes to U+FFFD, as vLLM shows it); ``bytes`` are the token's own bytes (:func:`token_bytes`),
so a client joins the bytes of consecutive tokens into the characters they split, as OpenAI's field is meant for.
``text_offset`` is the character offset of each token in the text of the tokens before it, decoded together.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from redraft.decoding.logprobs import TokenLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for (transformers' own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int) -> list[int]:
    """The bytes one token stands for (OpenAI's ``bytes`` field).

    A token whose text decodes alone is that text's UTF-8 bytes. A piece of a multi-byte character (its text alone
    is U+FFFD) is read from the vocabulary entry instead: a byte-fallback token ``<0xNN>`` (SentencePiece) is that
    byte, a byte-level BPE token (GPT-2's alphabet) the bytes its characters stand for; any other keeps the UTF-8
    bytes of its text.
    """
    text = _piece(tokenizer, token)
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    entry = tokenizer.convert_ids_to_tokens(int(token))
    if isinstance(entry, str):
        if m := _BYTE_FALLBACK.fullmatch(entry):
            return [int(m.group(1), 16)]
        table = _byte_level_table()
        if entry and all(c in table for c in entry):
            return [table[c] for c in entry]
    return list(text.encode("utf-8"))


def _top(tokenizer, e: TokenLogprob) -> dict[str, float]:
    """The row's ``k`` most likely tokens and the listed token itself (``k + 1`` entries at most, as OpenAI and
    vLLM answer), most likely first; two ids with the same text keep the more likely one."""
    pairs = sorted([*zip(e.top_ids, e.top_logprobs, strict=True), (e.token, e.logprob)], key=lambda p: -p[1])
    out: dict[str, float] = {}
    for t, lp in pairs:
        out.setdefault(_piece(tokenizer, t), lp)
    return out


def completion_logprobs(tokenizer, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
    """The legacy completions ``logprobs`` object.

    Args:
        tokenizer: a transformers tokenizer (``decode``, ``batch_decode``).
        ids: the listed tokens (the prompt's with ``echo``, then the output's).
        entries: one per id; None for a token without context (the first prompt token).
    Returns:
        ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [dict | None],
        "text_offset": [int]}``.
    """
    ids = [int(t) for t in ids]
    return {"tokens": [_piece(tokenizer, t) for t in ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _top(tokenizer, e) for e in entries],
            "text_offset": text_offsets(tokenizer, ids)}


def text_offsets(tokenizer, ids: Sequence[int], window: int = 8) -> list[int]:
    """Character offset of each token in ``decode(ids)``: ``len(decode(ids[:i]))``, computed from the growth of
    the text over a sliding window of ``window`` tokens before each one (a character split over several byte
    tokens, or a tokenizer's leading-space rule, is settled within it), so the cost is linear in the length."""
    return _offsets(tokenizer, [int(t) for t in ids], 0, 0, window)[0]


def _offsets(tokenizer, ids: list[int], start: int, base: int, window: int = 8) -> tuple[list[int], int]:
    """:func:`text_offsets` of ``ids[start:]`` when ``ids[start]`` begins at offset ``base``; also the offset
    after the last id."""
    starts = [max(0, i - window) for i in range(start, len(ids))]
    if not starts:
        return [], base
    before = tokenizer.batch_decode([ids[s:i] for i, s in zip(range(start, len(ids)), starts, strict=True)],
                                    skip_special_tokens=False)
    upto = tokenizer.batch_decode([ids[s:i + 1] for i, s in zip(range(start, len(ids)), starts, strict=True)],
                                  skip_special_tokens=False)
    out, pos = [], base
    for b, u in zip(before, upto, strict=True):
        out.append(pos)
        pos += len(u) - len(b)
    return out, pos


class StreamedCompletionLogprobs:
    """The legacy completions ``logprobs`` object of a streamed answer, one part per chunk: the parts' lists, put
    end to end, equal :func:`completion_logprobs` of the whole output (``text_offset`` counts from the start of
    the output, as in the whole object).

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.pos = tokenizer, [], 0

    def part(self, entries: Sequence[TokenLogprob]) -> dict:
        """The object for the next ``entries`` (one per output token, in order)."""
        start = len(self.ids)
        self.ids.extend(int(e.token) for e in entries)
        offsets, self.pos = _offsets(self.tokenizer, self.ids, start, self.pos)
        return {"tokens": [_piece(self.tokenizer, e.token) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [_top(self.tokenizer, e) for e in entries], "text_offset": offsets}


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``, one item per output token."""
    def item(token: int, lp: float) -> dict:
        return {"token": _piece(tokenizer, token), "logprob": lp, "bytes": token_bytes(tokenizer, token)}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)]}
                        for e in entries], "refusal": None}


class ChunkLogprobs:
    """One streamed choice's log-probabilities: the entries accepted since the last chunk go with the next one
    (:meth:`take`), and the finishing chunk carries the rest of the answer's (:meth:`finish`: tokens whose text was
    held back, an ending EOS). Each returns the chat object (``chat``) or the legacy completions one, None when
    there are no new entries.

    Attributes:
        pending: entries (:class:`~redraft.decoding.logprobs.TokenLogprob`) not yet sent; the caller extends it.
    """

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.sent = tokenizer, 0
        self.pending: list = []
        self.legacy = None if chat else StreamedCompletionLogprobs(tokenizer)

    def take(self) -> dict | None:
        entries, self.pending = self.pending, []
        if not entries:
            return None
        self.sent += len(entries)
        return chat_logprobs(self.tokenizer, entries) if self.legacy is None else self.legacy.part(entries)

    def finish(self, answer: list | None) -> dict | None:
        self.pending = list(answer[self.sent:]) if answer is not None else self.pending
        return self.take()
