"""Exact-request answer cache: a greedy request whose prompt its tenant already sent is answered without a forward.

Agent loops and harnesses replay identical requests (the same conversation, the same settings). The learned corpus
drafts such a replay in one verify forward, but that forward over a ~1,000-token cached prompt is all a replay
costs. :class:`AnswerCache` removes it: when a greedy request's tenant has already been answered for the *identical*
prompt ids under the same decoding settings, the stored answer is served, cut as the new request asks.

Why this is exact: the server runs exact mode, so a greedy answer's ids are a prefix of plain greedy decoding's
continuation of that prompt (the whole continuation when it ended on EOS). Plain greedy decoding of the same prompt
with the same logits shaping emits the same ids, token by token, whatever ``max_tokens`` or stop strings a request
gives; those only decide where it stops. :func:`replay` applies the new request's cut (``max_tokens``, EOS, stop
strings, as :class:`redraft.decoding.engine.Engine` cuts) to the stored ids, and serves them only when the cut falls
inside them or at the stored EOS; otherwise the request is decoded as usual (the learned corpus still drafts it).

What qualifies (:func:`answer_key`): temperature 0 (greedy) and no output grammar (``response_format`` and ``tools``
attach one that shapes the logits per request). The key holds the tenant, the prompt ids (their length and SHA-256),
the number of log-probability alternatives asked for (an answer with log-probabilities keeps the entries its
decoding computed and a hit serves them: the same values, not a second forward's rounding of them), and the
request's logits shaping that greedy decoding depends on
(``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``); the server's ``generation_config`` is the same
for every request of one server. When it forces EOS at the ``max_tokens`` boundary (``forced_eos_token_id``), the
answer depends on ``max_tokens`` too and the key includes it.

Per tenant: one tenant's stored answers never serve another's requests (a hit answers faster, so a shared store
would leak prompts through timing, as a shared prefix cache does: PromptPeek). Bounded: at most ``max_tokens``
stored answer ids over all tenants, least recently used evicted first (4 bytes an id: the default holds 262,144
ids, 1 MB, plus ~200 bytes of key and bookkeeping per answer).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from redraft.decoding.engine import GenerationResult
from redraft.decoding.genconfig import LogitsShaping
from redraft.decoding.logprobs import TokenLogprob
from redraft.decoding.sampling import SamplingParams
from redraft.decoding.stopping import StopStrings

DEFAULT_ANSWER_CACHE_TOKENS = 262_144  # stored answer ids over all tenants


@dataclass(frozen=True, eq=False)
class Answer:
    """A stored greedy answer: ``ids`` (token ids, a prefix of plain greedy decoding's continuation, ending with
    the EOS id when ``eos``; any int sequence, kept as an int32 numpy array: 4 bytes an id), ``eos``: it ended on EOS
    (nothing follows), ``context``: it ended at the model's context length (nothing can follow), ``logprobs``: one
    entry per id when the request asked for log-probabilities (None otherwise)."""

    ids: np.ndarray
    eos: bool = False
    context: bool = False
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def cost(self) -> int:
        """What the answer holds, in ids: one per token, plus each entry's alternatives."""
        extra = sum(1 + len(e.top_ids) for e in self.logprobs) if self.logprobs is not None else 0
        return len(self.ids) + extra

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", np.asarray(self.ids, dtype=np.int32).reshape(-1))


def answer_key(tenant: str, prompt_ids: Sequence[int], sampling: SamplingParams, logprobs: int | None = None,
               max_tokens: int | None = None) -> tuple | None:
    """The cache key of a request, or None when its answer must not come from (or go into) the cache: sampling
    (temperature > 0) or an output grammar (``sampling.constraint``).

    Args:
        prompt_ids: the prompt's token ids. logprobs: the alternatives asked for per token (None: no
            log-probabilities). max_tokens: include the request's cap in the key (only when the server's
            generation_config forces EOS at it); None = the cap is no part of the key.
    """
    if sampling.temperature != 0 or sampling.constraint is not None:
        return None
    raw = np.asarray(prompt_ids, dtype=np.int64).tobytes()
    return (tenant, len(prompt_ids), hashlib.sha256(raw).digest(), sampling.repetition_penalty,
            sampling.no_repeat_ngram_size, sampling.min_new_tokens, max_tokens, logprobs)


class AnswerCache:
    """Stored greedy answers per (tenant, prompt, settings) key, least recently used evicted beyond ``max_tokens``.

    Thread-safe (each method takes a lock).

    Args:
        max_tokens: most stored answer ids over all keys (> 0; each log-probability alternative counts as one).

    Attributes:
        tokens: answer ids (and alternatives) held now.

    Raises:
        ValueError: ``max_tokens`` < 1.
    """

    def __init__(self, max_tokens: int = DEFAULT_ANSWER_CACHE_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.entries: OrderedDict[tuple, Answer] = OrderedDict()  # oldest first
        self.tokens = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple | None) -> Answer | None:
        """The stored answer for ``key`` (None when there is none or ``key`` is None); it becomes the most
        recently used."""
        if key is None:
            return None
        with self.lock:
            answer = self.entries.get(key)
            if answer is not None:
                self.entries.move_to_end(key)
            return answer

    def store(self, key: tuple | None, result: GenerationResult) -> bool:
        """Keep ``result``'s output as the answer for ``key``, unless the stored one already covers it (it is
        longer, or ended on EOS or at the context). Returns whether it was stored.

        Only exact greedy results belong here (the caller's duty: exact mode on, ``key`` from :func:`answer_key`);
        an answer with no ids, or longer than the whole budget, is not kept."""
        n = len(result.output_ids)
        if key is None or not n or n > self.max_tokens:
            return False
        lps = tuple(result.logprobs) if result.logprobs is not None else None
        new = Answer(result.output_ids, eos=result.stop_reason == "eos", context=result.stop_reason == "context",
                     logprobs=lps)
        if new.cost > self.max_tokens or (lps is not None and len(lps) != n):
            return False
        with self.lock:
            old = self.entries.get(key)
            if old is not None and (old.eos or old.context or len(old.ids) >= n):
                self.entries.move_to_end(key)
                return False
            if old is not None:
                self.tokens -= old.cost
            self.entries[key] = new
            self.entries.move_to_end(key)
            self.tokens += new.cost
            while self.tokens > self.max_tokens and self.entries:
                _, dropped = self.entries.popitem(last=False)
                self.tokens -= dropped.cost
            return True


def replay(answer: Answer | None, prompt_ids: Sequence[int], max_tokens: int, stop: StopStrings,
           eos_token_ids: Collection[int]) -> GenerationResult | None:
    """The stored answer cut as plain greedy decoding with this request's settings would stop (a
    :class:`GenerationResult` with ``forwards`` 0), or None when that cut is not inside the stored ids (decode the
    request instead).

    The cut is :class:`~redraft.decoding.engine.Engine`'s, applied token by token as plain decoding emits: at
    ``max_tokens`` ids, after the first EOS id, or at the token completing the first stop string
    (:meth:`~redraft.decoding.stopping.StopStrings.check`, the engine's own). It falls inside the stored ids when it
    is at most their length and, at exactly their length, the stored answer ended there (EOS or the context) or the
    request stops there anyway (``max_tokens`` or a stop string).

    Args:
        answer: the stored answer (None: no answer, returns None).
        prompt_ids: the request's prompt ids. max_tokens: its cap on new tokens (>= 1).
        stop: its stop strings (an empty :class:`~redraft.decoding.stopping.StopStrings` when none); set as the
            engine sets it when a stop string ends the answer.
        eos_token_ids: the ids that end a generation.
    """
    if answer is None or max_tokens < 1:
        return None
    t0 = time.perf_counter()
    ids = answer.ids[:max_tokens].tolist()
    reason = "length" if len(ids) == max_tokens else None
    for j, t in enumerate(ids):
        if t in eos_token_ids:
            ids, reason = ids[:j + 1], "eos"
            break
    keep = stop.check(ids) if stop else None  # the engine's cut: where one token at a time would stop
    if keep is not None:
        ids, reason = ids[:keep], "stop"
    if reason is None:  # the request goes on past the stored ids unless they ended at the context
        if not answer.context:  # (a stored EOS was found above: the ids are all stored ones here)
            return None
        reason = "context"
    lps = None if answer.logprobs is None else list(answer.logprobs[:len(ids)])
    return GenerationResult(prompt_ids=[int(t) for t in prompt_ids], output_ids=ids, forwards=0,
                            stop_reason=reason, seconds=time.perf_counter() - t0, logprobs=lps)


def cap_in_key(model, generation_config: bool = True) -> bool:
    """Whether answers depend on ``max_tokens`` beyond where they stop: the model's generation_config (when the
    server applies it) forces an EOS id as the last token ``max_tokens`` allows (``forced_eos_token_id``). A
    generation_config the logits shaping cannot read counts as yes (the requests themselves will say why)."""
    if not generation_config:
        return False
    try:
        return bool(LogitsShaping.of(getattr(model, "generation_config", None)).forced_eos_token_id)
    except ValueError:
        return True
