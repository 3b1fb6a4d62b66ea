"""One request through the engine: the tenant's drafters, stop strings, text deltas, then learning the answer.

Runs on the scheduler's generation thread. The engine is built per request (it is a thin object) around one
shared :class:`~redraft.decoding.target.HFTarget`, so the model and its KV cache buffers exist once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from redraft.corpus import CorpusError
from redraft.decoding.engine import Engine, GenerationResult
from redraft.decoding.logprobs import SCORE_CHUNK, TokenLogprob, score_prompt
from redraft.decoding.sampling import SamplingParams
from redraft.decoding.stopping import StopStrings
from redraft.decoding.target import HFTarget
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, SERVE_CORPUS_K_MAX
from redraft.drafters import build_drafters

from .corpora import TenantCorpora
from .scheduler import Cancelled, Job


@dataclass
class DraftSettings:
    """How requests draft: corpus depth ``k`` (adaptive up to ``k_max``), guard threshold ``minacc`` (fraction),
    n-gram drafts from the live context on or off."""

    k: int = CORPUS_K_DEFAULT
    k_max: int | None = SERVE_CORPUS_K_MAX
    minacc: float = CORPUS_MINACC
    ngram: bool = True


@dataclass
class Work:
    """What a job asks for: prompt ids, the exact cap on new tokens (0: score the prompt only), sampling and stop
    strings; ``logprobs`` (None or alternatives per token) and ``echo`` (also score the prompt).

    A scoring request (``echo`` with ``logprobs``) scores the prompt in one forward of its own (one per
    :data:`~redraft.decoding.logprobs.SCORE_CHUNK` tokens) and learns nothing.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    echo: bool = False

    @property
    def scoring(self) -> bool:
        return self.echo and self.logprobs is not None


@dataclass
class Outcome:
    """A finished generation: the engine's result, the final text (cut before a stop string) and the OpenAI
    finish reason (``stop`` for EOS or a stop string, ``length`` for max_tokens or the context)."""

    result: GenerationResult
    text: str
    finish_reason: str
    learned: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TextStream:
    """Turns a growing list of output ids into text deltas that never need to be taken back.

    A trailing U+FFFD is held back (the next token may complete a multi-byte character), and so are the last
    ``len(longest stop string) - 1`` characters (they may begin a stop string); once the engine finds a stop string
    the text is cut before it. The deltas therefore concatenate to exactly the non-streamed text.
    """

    def __init__(self, tokenizer, stop: StopStrings) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop.stops), default=1) - 1
        self.ids: list[int] = []
        self.shown = 0

    def feed(self, new: list[int]) -> str:
        """Delta for newly emitted ids ('' when everything new must still be held back)."""
        self.ids.extend(new)
        if self.stop.text is not None:
            text, safe = self.stop.text, len(self.stop.text)
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            safe = len(text.rstrip("\ufffd")) - self.hold
        if safe <= self.shown:
            return ""
        delta, self.shown = text[self.shown:safe], safe
        return delta

    def finish(self, final: str) -> str:
        """What remains of ``final`` (the whole output text) after the deltas already given."""
        return final[self.shown:]


class Generator:
    """Generates jobs for the scheduler.

    Args:
        loaded: a :class:`redraft.io.loading.LoadedModel` (model, tokenizer, EOS ids).
        corpora: the tenants' learned corpora and the shared corpus.
        draft: :class:`DraftSettings`.
        on_learned: called with the tenant after its corpus grew (metrics).
    """

    def __init__(self, loaded, corpora: TenantCorpora, draft: DraftSettings,
                 on_learned: Callable[[str], None] | None = None) -> None:
        self.tokenizer = loaded.tokenizer
        self.eos = sorted(loaded.eos_token_ids)
        self.target = HFTarget(loaded.model)
        self.corpora, self.draft, self.on_learned = corpora, draft, on_learned

    @property
    def context_length(self) -> int | None:
        return self.target.max_length

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def drafters(self, tenant: str) -> list:
        """Draft sources in priority order: the tenant's learned corpus, the shared corpus, n-gram lookup."""
        d = self.draft
        own = self.corpora.get(tenant)
        drafters = build_drafters(own, k=d.k, minacc=d.minacc, ngram=d.ngram, k_max=d.k_max)
        if self.corpora.shared is not None:
            # named apart from the tenant's learned corpus: its own statistics
            shared = build_drafters(self.corpora.shared, k=d.k, minacc=d.minacc, ngram=False, k_max=d.k_max,
                                    corpus_name="shared")[0]
            drafters.insert(1 if own is not None else 0, shared)
        return drafters

    def __call__(self, job: Job, emit: Callable[[str], None]) -> Outcome:
        work: Work = job.payload
        scored = score_prompt(self.target, work.prompt_ids, work.logprobs) if work.scoring else None
        if work.max_tokens == 0:
            res = GenerationResult(prompt_ids=list(work.prompt_ids), forwards=-(-len(work.prompt_ids) // SCORE_CHUNK) if scored else 0,
                                   logprobs=None if work.logprobs is None else [])
            return Outcome(result=res, text="", finish_reason="length", learned=False, prompt_logprobs=scored)
        engine = Engine(self.target, self.drafters(job.tenant), eos_token_ids=self.eos,
                        max_depth=max(self.draft.k, self.draft.k_max or 0))
        stop = StopStrings(self.tokenizer, work.stop)
        stream = TextStream(self.tokenizer, stop)

        def on_tokens(new: list[int]) -> None:
            if job.cancel.is_set():
                raise Cancelled(len(stream.ids) + len(new))
            delta = stream.feed(new)
            if delta:
                emit(delta)

        res = engine.generate(work.prompt_ids, work.max_tokens, on_tokens, sampling=work.sampling,
                              stop=stop if stop else None, logprobs=work.logprobs)
        text = stop.text if res.stop_reason == "stop" else self.tokenizer.decode(res.output_ids,
                                                                                skip_special_tokens=True)
        rest = stream.finish(text)
        if rest:
            emit(rest)
        # learn before the response completes: the journal record is synced when the client sees the end
        learned = False
        own = self.corpora.get(job.tenant)
        try:
            if own is not None and res.output_ids and not work.scoring and not reproduces(own, work.prompt_ids, res.output_ids):
                learned = self.corpora.learn_span(job.tenant, work.prompt_ids + res.output_ids)
        except (OSError, CorpusError) as e:  # the answer is still right; only the learning failed
            print(f"redraft serve: warning: tenant {job.tenant}: span not learned ({type(e).__name__}: {e})",
                  file=sys.stderr)
        if learned and self.on_learned is not None:
            self.on_learned(job.tenant)
        reason = "length" if res.stop_reason in ("length", "context") else "stop"
        return Outcome(result=res, text=text, finish_reason=reason, learned=learned, prompt_logprobs=scored)


def reproduces(corpus, prompt: list[int], output: list[int], k: int = 48) -> bool:
    """Whether ``corpus`` already drafts all of ``output`` after ``prompt``: following its proposals from the prompt
    gives exactly the output. A replayed answer is then not learned again, so repeating requests costs no memory
    and leaves the cap to new answers. Costs one lookup per k output tokens."""
    context, i = list(prompt), 0
    while i < len(output):
        n, ids = corpus.propose(context, k)
        want = output[i:i + len(ids)]
        if n == 0 or ids[:len(want)].tolist() != want:
            return False
        context += want
        i += len(want)
    return True
