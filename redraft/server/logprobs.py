"""OpenAI's log-probability objects from :class:`redraft.decoding.logprobs.TokenLogprob` lists.

- ``/v1/completions`` (the legacy object): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one
  entry per token; with ``echo`` the prompt's tokens come first, the first of them with ``null`` log-probability
  and ``null`` alternatives (it has no context). ``top_logprobs`` entries map token text to log-probability:
  the ``logprobs`` most likely tokens plus the listed token itself when it is not among them (up to
  ``logprobs + 1`` entries, as OpenAI and vLLM answer; two ids with the same text keep the more likely one).
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.

Every output token is listed, an ending EOS included (vLLM does the same; lm-evaluation-harness' loglikelihood
requests rely on the one generated token being the last entry). Token text is each id decoded alone (a piece of a
multi-byte character decodes to U+FFFD); ``bytes`` are that text's UTF-8 bytes. ``text_offset`` is the character
offset of each token in the text of the tokens before it, decoded together.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.decoding.logprobs import TokenLogprob


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


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
    ids = [int(t) for t in ids]
    starts = [max(0, i - window) for i in range(len(ids))]
    before = tokenizer.batch_decode([ids[s:i] for i, s in enumerate(starts)], skip_special_tokens=False)
    upto = tokenizer.batch_decode([ids[s:i + 1] for i, s in enumerate(starts)], skip_special_tokens=False)
    out, pos = [], 0
    for b, u in zip(before, upto, strict=True):
        out.append(pos)
        pos += len(u) - len(b)
    return out


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``, one item per output token."""
    def item(token: int, lp: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)]}
                        for e in entries], "refusal": None}
