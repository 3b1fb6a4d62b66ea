"""Log-probabilities of tokens under the target model: of emitted tokens (from the verify rows in hand) and of a
prompt (one forward).

Values are the target's **raw** log-probabilities: ``log_softmax`` of the row's logits in float32, taken before
any sampling processor (temperature, top-k/top-p, repetition penalty, the model's ``generation_config``) shapes
them. This is vLLM's default (``logprobs_mode="raw_logprobs"``: "logprobs ... are computed from the raw model
output before any processing") and what a harness scoring text (lm-evaluation-harness' loglikelihood) needs.

A verify row's logits differ from the row plain decoding computes for the same token by float rounding (about
1e-4 in float32 on CPU, see docs/architecture.md), so a drafted token's log-probability equals plain decoding's
within that tolerance, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from redraft.runtimes.sequence import Steps, drive, forward

MAX_TOP_LOGPROBS = 20  # the most alternatives OpenAI's chat API returns per token


@dataclass
class TokenLogprob:
    """One token's log-probability and the most likely tokens of the row that produced it.

    Attributes:
        token: the token id. logprob: its natural-log probability (float, <= 0).
        top_ids, top_logprobs: the row's ``k`` most likely ids and their log-probabilities, most likely first
            (empty when ``k`` is 0).
    """

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def row_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens[i]`` under ``logits[rows[i]]``, with each row's top ``k``.

    Args:
        logits: FloatTensor [R, V] (any float dtype) of raw target logits.
        rows: for each token, the index of the row that chose it (len T).
        tokens: the T token ids.
        k: alternatives per token, 0..:data:`MAX_TOP_LOGPROBS`.
    Returns:
        T :class:`TokenLogprob`.
    Raises:
        ValueError: ``rows`` and ``tokens`` of different lengths, or ``k`` out of range.
    """
    if len(rows) != len(tokens):
        raise ValueError(f"row_logprobs: {len(rows)} rows for {len(tokens)} tokens")
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"row_logprobs: k must be 0..{MAX_TOP_LOGPROBS}, got {k}")
    if not tokens:
        return []
    lp = torch.log_softmax(logits[list(rows)].float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    if k:
        top = torch.topk(lp, k, dim=-1)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_vals = [[] for _ in tokens]
    return [TokenLogprob(int(t), float(c), i, v) for t, c, i, v in zip(tokens, chosen, top_ids, top_vals, strict=True)]


SCORE_CHUNK = 512  # prompt tokens per scoring forward: bounds the logits held at once (512 x vocab floats)


def score_prompt(target, ids: Sequence[int], k: int, chunk: int = SCORE_CHUNK) -> list[TokenLogprob | None]:
    """:func:`prompt_scores` run alone on ``target`` (:func:`redraft.runtimes.sequence.drive`)."""
    return drive(prompt_scores(target, ids, k, chunk))


def prompt_scores(target, ids: Sequence[int], k: int, chunk: int = SCORE_CHUNK) -> Steps[list[TokenLogprob | None]]:
    """A step function (:mod:`redraft.runtimes.sequence`): log-probabilities of every token of ``ids`` given the tokens before it, from the target's own forward.

    A prompt of up to ``chunk`` tokens takes one forward; a longer one is fed in consecutive chunks over the
    growing KV cache (chunked prefill: the same rows up to float rounding), so at most ``chunk`` x vocab logits
    exist at once. The first token has no preceding context: its entry is None (OpenAI's ``token_logprobs[0]`` is
    null). The target's KV cache is reset and left holding ``ids`` (the next generation resets it again).

    Args:
        target: a :class:`redraft.runtimes.transformers.target.HFTarget` (``reset`` and ``forward(..., n_logits=)`` are used).
        ids: S >= 1 token ids.
        k: alternatives per token, 0..:data:`MAX_TOP_LOGPROBS`.
        chunk: most tokens per forward (>= 1).
    Returns:
        S entries: None, then a :class:`TokenLogprob` for ids[1:] (the row of ids[i - 1] scores ids[i]).
    Raises:
        ValueError: empty ``ids``, ``k`` out of range or ``chunk`` < 1.
    """
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("score_prompt: no token ids")
    if chunk < 1:
        raise ValueError(f"score_prompt: chunk must be at least 1, got {chunk}")
    target.reset()
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        logits = yield from forward(target, part, n_logits=len(part))  # [len(part), V]; row j: ids[start + j + 1]
        nxt = ids[start + 1:start + 1 + len(part)]
        out += row_logprobs(logits, range(len(nxt)), nxt, k)
    return out
