"""One request through the engine: the tenant's drafters, stop strings, text deltas, then learning the answer.

A request is a step function (:mod:`redraft.runtimes.sequence`) that the scheduler's one loop advances beside the
other running requests, one target forward per step. Each request gets a target of its own
(:meth:`Generator.new_target`: an :class:`~redraft.runtimes.transformers.target.HFTarget` whose forwards the server's step batcher
packs with the other running requests' into one forward per step, or runs alone without one) and an engine built per
request (a thin object) by :func:`redraft.compose.build_engine`; the model's weights exist once. A target of another
runtime that runs one sequence (:class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget`) is shared by every request,
which then run one at a time; it is emptied before a request of another tenant than the previous one's.
Requests draft with the same :class:`~redraft.compose.SpeculationConfig` as ``redraft run``: the cost-aware policy
by default, Colibri's fixed depth and guard with ``--no-policy``, ``--k`` or ``--minacc``. The cost curve is
measured once per server (cached on disk as the CLI caches it). What the policy learns (acceptance per draft
source) is kept per tenant, in memory only, in the tenant's :class:`~redraft.policy.SpeculationPolicy`; under the
step batcher each request drafts with its own :class:`~redraft.policy.load.LoadAwarePolicy` (the draft priced at
the rows the step carries for other requests, its own probe bookkeeping) that learns into the tenant's acceptance
tracker (:func:`redraft.compose.build.batched_policy`). One tenant's traffic never changes another tenant's draft
depths (timing would show them).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redraft.compose import SpeculationConfig, build_engine, build_policy, drafters_for
from redraft.compose.build import batched_policy, grammar_drafters
from redraft.corpus import CorpusError
from redraft.decoding.engine import GenerationResult
from redraft.decoding.logprobs import SCORE_CHUNK, TokenLogprob, prompt_scores
from redraft.decoding.runstats import SourceStats
from redraft.decoding.sampling import SamplingParams
from redraft.decoding.stopping import StopStrings
from redraft.decoding.textstream import TextStream
from redraft.runtimes.sequence import Steps
from redraft.runtimes.transformers.batching import SequenceCancelled
from redraft.runtimes.transformers.target import HFTarget, Target

from .admission import KVBudget
from .answer_cache import AnswerCache, answer_key, cap_in_key, replay
from .corpora import TenantCorpora
from .prefix_cache import PrefixCache, remember
from .scheduler import Cancelled, Job
from .shared_prefill import SharedPrefill
from .toolcalls import ContentFilter


@dataclass
class Work:
    """What a job asks for: prompt ids, the exact cap on new tokens (0: score the prompt only), sampling (with the
    output's grammar constraint, if any) and stop strings; ``tool_calls``: the tool-call format to parse the answer
    with (a :class:`~redraft.server.toolcalls.ToolCallFormat`), None when the answer cannot hold calls;
    ``logprobs`` (None or alternatives per token) and ``echo`` (also score the prompt); ``streaming``: the client
    reads tokens as they come (its first token is awaited: see ``Engine.steps(streaming=...)``).

    A scoring request (``echo`` with ``logprobs``) scores the prompt in one forward of its own (one per
    :data:`~redraft.decoding.logprobs.SCORE_CHUNK` tokens) and learns nothing.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    tool_calls: object | None = None
    single_call: bool = False  # parallel_tool_calls false: only the first call counts
    forced_calls: bool = False  # tool_choice required or named: the answer is calls only (content null)
    logprobs: int | None = None
    echo: bool = False
    streaming: bool = False

    @property
    def scoring(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def kv_tokens(self) -> int:
        """The KV tokens the job reserves while it runs: its prompt plus its cap on new tokens."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass
class Outcome:
    """A finished generation: the engine's result, the final text (cut before a stop string) and the OpenAI
    finish reason (``stop`` for EOS or a stop string, ``length`` for max_tokens or the context, ``tool_calls``
    when the answer holds tool calls). ``tool_calls`` holds the parsed calls in OpenAI's shape (None when there are
    none). When the answer may hold calls, ``content`` is the text outside them, a cut-off call left out (None when
    empty, and always None under a forced ``tool_choice``); otherwise ``content`` is ``text``.
    ``answer_cache_hit``: the answer came from the answer cache (no forward; ``result.forwards`` is 0)."""

    result: GenerationResult
    text: str
    finish_reason: str
    learned: bool
    tool_calls: list[dict] | None = None
    content: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    answer_cache_hit: bool = False


class Generator:
    """Generates jobs for the scheduler: calling it returns the job's step function.

    Args:
        loaded: a :class:`redraft.io.loading.LoadedModel` (model, tokenizer, EOS ids). A model that is already a
            :class:`~redraft.runtimes.transformers.target.Target` (the llama.cpp runtime's) is the one target every request
            uses, one request at a time (:attr:`one_at_a_time`), unless a ``batcher`` gives each request a sequence
            of its context (:class:`~redraft.runtimes.llamacpp.batching.LlamaStepBatcher`).
        corpora: the tenants' learned corpora and the shared corpus.
        config: how requests draft (:class:`~redraft.compose.SpeculationConfig`; default: the policy, n-gram
            drafts, exact mode, as ``redraft run``). Its ``corpus`` path is ignored: ``corpora`` are the corpora.
        on_learned: called with the tenant after its corpus grew (metrics).
        curve: the policy's :class:`~redraft.pricing.CostCurve`; None = this model's cached curve, measured at
            construction when missing (a few seconds on a CPU, once per model, dtype, thread count and machine).
        prefix_cache: a :class:`~redraft.server.prefix_cache.PrefixCache` (each request starts from its tenant's
            longest cached prompt prefix, and its prompt + answer are cached after it), or None for none.
        budget: the server's :class:`~redraft.server.admission.KVBudget` (the prefix cache keeps only what the
            running requests' reservations leave), or None.
        batcher: the step batcher the scheduler packs the running requests' forwards with
            (:class:`redraft.runtimes.transformers.batching.StepBatcher`; on llama.cpp
            :class:`redraft.runtimes.llamacpp.batching.LlamaStepBatcher`, a sequence of its context per request), or
            None: each request's forwards run alone (one request at a time).
        answers: an :class:`~redraft.server.answer_cache.AnswerCache` (a greedy request whose tenant was already
            answered for the identical prompt and settings is served from it without a forward), or None for none.
            Used only in exact mode (``config.exact``): the stored answers must be plain greedy decoding's.

    Attributes:
        model, tokenizer, eos: the loaded model's. policies: tenant -> the tenant's policy (what it learned).
        shared: the one target of a runtime that runs one sequence, else None (a target per request).
    """

    def __init__(self, loaded, corpora: TenantCorpora, config: SpeculationConfig | None = None,
                 on_learned: Callable[[str], None] | None = None, curve=None,
                 prefix_cache: PrefixCache | None = None, budget: KVBudget | None = None,
                 batcher=None, answers: AnswerCache | None = None) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos = sorted(loaded.eos_token_ids)
        runtime_target = loaded.model if isinstance(loaded.model, Target) else None
        self.shared: Target | None = runtime_target if batcher is None else None
        # vocabulary, context, dtype: never forwards (requests own targets, or share the one target)
        self.facts = runtime_target if runtime_target is not None else HFTarget(loaded.model)
        self._holder: str | None = None  # the tenant whose tokens the shared target holds
        self.corpora, self.config, self.on_learned = corpora, config or SpeculationConfig(), on_learned
        self.prefix_cache, self.budget, self.batcher = prefix_cache, budget, batcher
        # requests admitted together compute a prompt prefix they share once (needs a store to hand it over in)
        self.sharing = (SharedPrefill(prefix_cache) if isinstance(prefix_cache, PrefixCache)
                        and prefix_cache.max_tokens > 0 else None)
        self.answers = answers if self.config.exact else None
        self.cap_in_key = cap_in_key(loaded.model, self.config.generation_config)
        self.curve = None
        if self.config.policy_on:  # measured once per server, before the first request (not inside one)
            self.curve = curve if curve is not None else build_policy(loaded.model).curve
        self.policies: dict = {}  # tenant -> SpeculationPolicy: learned acceptance, never shared across tenants
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int | None:
        return self.facts.max_length

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def runtime(self) -> str:
        """Where the target runs: "transformers" or "llama.cpp"."""
        return self.facts.runtime

    @property
    def one_at_a_time(self) -> bool:
        """Whether requests must run one at a time (every request shares the one target)."""
        return self.shared is not None

    def new_target(self, tenant: str | None = None) -> Target:
        """A target for one request of ``tenant`` (priced at the step batcher's current load with one,
        :meth:`~redraft.runtimes.transformers.batching.StepBatcher.new_target`). Close it with :func:`close_target`.

        The shared target (:attr:`shared`) keeps the previous request's tokens for a request of the same tenant (its
        prefix reuse, :class:`~redraft.server.prefix_cache.HeldPrefix`) and is emptied for any other (or an unnamed
        one): one tenant's cached tokens never speed up another's request."""
        if self.batcher is not None:
            return self.batcher.new_target()
        if self.shared is not None:
            if tenant is None or tenant != self._holder:
                self.shared.reset()
            self._holder = tenant
            return self.shared
        return HFTarget(self.model)

    def warm_up(self, tenants: Sequence[str] = ()) -> None:
        """One short forward before the first request: a runtime's first call sets up its thread pool and kernels
        (~0.1 s on a CPU), which would otherwise land on the first request's time to first token. The shared target
        (llama.cpp's one sequence) is left empty; a llama.cpp context of several sequences is left alone. The longest
        vocabulary entry, which the first request's length check reads (~0.4 s for a 49k vocabulary), is found now
        too, and so are the policies of ``tenants`` (tenant names) with their load pricing (~10 ms)."""
        from .tokenize import max_token_chars

        max_token_chars(self.tokenizer)
        for tenant in tenants:
            self.request_policy(tenant)
        if self.runtime == "transformers":
            target: Target = HFTarget(self.model)
            target.reset()
            target.forward([int(self.eos[0]) if self.eos else 0] * 4)
            target.release()
        elif self.shared is not None:
            self.shared.reset()
            self.shared.forward([int(self.eos[0]) if self.eos else 0])
            self.shared.reset()

    def close(self) -> None:
        """Close the corpora, and write what the prefix cache's disk store has queued (then stop its thread)."""
        self.corpora.close()
        disk = getattr(self.prefix_cache, "disk", None)
        if disk is not None:
            disk.close()

    def drafters(self, tenant: str, constraint=None) -> list:
        """Draft sources in priority order: the request's output grammar (``constraint``, see
        :func:`redraft.compose.build.grammar_drafters`), the tenant's learned corpus, the shared corpus, n-gram
        lookup."""
        own = self.corpora.get(tenant)
        drafters = drafters_for(self.config, own)
        if self.corpora.shared is not None:
            # named apart from the tenant's learned corpus: its own statistics (and the policy's own estimates)
            shared = drafters_for(self.config, self.corpora.shared, corpus_name="shared", ngram=False)[0]
            drafters.insert(1 if own is not None else 0, shared)
        return grammar_drafters(self.config, constraint) + drafters

    def policy(self, tenant: str):
        """The tenant's :class:`~redraft.policy.SpeculationPolicy` (None without the policy): one per tenant, all
        on the server's one cost curve. Its prices are the curve's, not learned from step times
        (``learn_prices`` off): a server's step times carry every tenant's load, and what one tenant's traffic does
        to them must not change another tenant's drafts."""
        if self.curve is None:
            return None
        with self._lock:
            if tenant not in self.policies:
                self.policies[tenant] = build_policy(curve=self.curve, max_nodes=self.config.policy_nodes,
                                                     learn_prices=False)
            return self.policies[tenant]

    def request_policy(self, tenant: str):
        """The policy one request of ``tenant`` drafts with: under the step batcher a load-aware policy of its own
        learning into the tenant's tracker (:func:`redraft.compose.build.batched_policy`); without it (requests
        one at a time) the tenant's policy itself. None without the policy."""
        policy = self.policy(tenant)
        if policy is None or self.batcher is None:
            return policy
        return batched_policy(policy)

    def engine(self, tenant: str, target: Target, constraint=None):
        """The engine for one request of ``tenant`` on ``target``: its drafters and its policy."""
        return build_engine(target, self.config, eos_token_ids=self.eos,
                            drafters=self.drafters(tenant, constraint), policy=self.request_policy(tenant))

    def answer_key(self, job: Job) -> tuple | None:
        """The job's answer-cache key (:func:`redraft.server.answer_cache.answer_key`), None when the cache is off
        or the job's answer may not come from it."""
        work: Work = job.payload
        if self.answers is None or work.max_tokens < 1 or work.scoring:
            return None
        return answer_key(job.tenant, work.prompt_ids, work.sampling, work.logprobs,
                          work.max_tokens if self.cap_in_key else None)

    def __call__(self, job: Job, emit: Callable[[str], None]) -> Steps[Outcome]:
        """The job's step function: it yields each target forward it needs and returns its :class:`Outcome`.
        Raises :class:`~redraft.server.scheduler.Cancelled` (with the tokens generated so far) when the client left.
        Made before it runs, the job's prompt is announced to the requests starting with it
        (:mod:`redraft.server.shared_prefill`)."""
        work: Work = job.payload
        seen = None
        if self.sharing is not None and work.max_tokens > 0 and not work.scoring:
            seen = self.sharing.announce(job.tenant, work.prompt_ids)
        return self._steps(job, emit, seen)

    def _steps(self, job: Job, emit: Callable[[str], None], seen: int | None) -> Steps[Outcome]:
        if seen is not None:
            self.sharing.withdraw(seen)
        work: Work = job.payload
        key = self.answer_key(job)
        stop = StopStrings(self.tokenizer, work.stop)
        replayed = None if key is None else replay(self.answers.get(key), work.prompt_ids, work.max_tokens, stop,
                                                   self.eos)
        target = None if replayed is not None else self.new_target(job.tenant)
        emitted = [0]  # tokens generated so far (the count an aborted request reports)
        try:
            return (yield from self._generate(job, emit, target, emitted, stop, key, replayed))
        except SequenceCancelled as e:  # the scheduler took the sequence out of its batch: the client left
            raise Cancelled(emitted[0]) from e
        finally:
            if target is not None:  # frees the sequence's KV entries at once (a prefix entry keeps its own view)
                close_target(target, shared=target is self.shared)

    def _generate(self, job: Job, emit: Callable[[str], None], target: Target | None, emitted: list[int],
                  stop: StopStrings, key: tuple | None = None, replayed: GenerationResult | None = None
                  ) -> Steps[Outcome]:
        work: Work = job.payload
        scored = (yield from prompt_scores(target, work.prompt_ids, work.logprobs)) if work.scoring else None
        if work.max_tokens == 0:
            forwards = -(-len(work.prompt_ids) // SCORE_CHUNK) if scored else 0
            res = GenerationResult(prompt_ids=list(work.prompt_ids), forwards=forwards,
                                   logprobs=None if work.logprobs is None else [])
            return Outcome(result=res, text="", finish_reason="length", learned=False, content="",
                           prompt_logprobs=scored)
        stream = TextStream(self.tokenizer, stop)
        content = ContentFilter(work.tool_calls) if work.tool_calls is not None else None
        if content is not None:
            emit_text = emit

            def emit(delta: str) -> None:
                shown = content.feed(delta)
                if shown and not work.forced_calls:
                    emit_text(shown)

        def on_tokens(new: list[int]) -> None:
            emitted[0] = job.generated = len(stream.ids) + len(new)
            if job.cancel.is_set():
                raise Cancelled(emitted[0])
            delta = stream.feed(new)
            if delta:
                emit(delta)

        def on_logprobs(entries: list[TokenLogprob]) -> None:  # streamed before the step's text
            job.post("logprobs", list(entries))

        if replayed is not None:  # the stored answer, cut as this request asks: no forward, nothing to cache
            res = replayed
            res.sources = {d.name: SourceStats() for d in self.drafters(job.tenant)}  # as a decoded answer's: zeros
            if res.logprobs:
                on_logprobs(res.logprobs)
            on_tokens(list(res.output_ids))
        else:
            res = yield from self._decode(job, target, stop, on_tokens,
                                          on_logprobs if work.logprobs is not None else None)
            if key is not None:
                self.answers.store(key, res)
        text = stop.text if res.stop_reason == "stop" else self.tokenizer.decode(res.output_ids,
                                                                                skip_special_tokens=True)
        calls, answer = None, text
        if content is not None:
            answer, calls = work.tool_calls.parse(text)
            if work.single_call:
                calls = calls[:1]
            if work.forced_calls:
                answer = None
            rest = content.finish(answer)
            if rest:
                emit_text(rest)
            calls = calls or None
        else:
            rest = stream.finish(text)
            if rest:
                emit(rest)
        # learn before the response completes: the journal record is synced when the client sees the end
        learned = False
        own = self.corpora.get(job.tenant)
        try:
            if own is not None and res.output_ids and not work.scoring and replayed is None:
                learned = self.corpora.learn_span(job.tenant, work.prompt_ids + res.output_ids)
        except (OSError, CorpusError) as e:  # the answer is still right; only the learning failed
            print(f"redraft serve: warning: tenant {job.tenant}: span not learned ({type(e).__name__}: {e})",
                  file=sys.stderr)
        if learned and self.on_learned is not None:
            self.on_learned(job.tenant)
        reason = "length" if res.stop_reason in ("length", "context") else "stop"
        if calls and reason == "stop":  # a cut-off answer stays "length", its complete calls still returned
            reason = "tool_calls"
        return Outcome(result=res, text=text, finish_reason=reason, learned=learned, tool_calls=calls, content=answer,
                       prompt_logprobs=scored, answer_cache_hit=replayed is not None)

    def _decode(self, job: Job, target: Target, stop: StopStrings, on_tokens, on_logprobs=None
                ) -> Steps[GenerationResult]:
        """Run the engine on ``target`` from the tenant's longest cached prompt prefix, then cache the prompt +
        answer's KV entries."""
        work: Work = job.payload
        engine = self.engine(job.tenant, target, work.sampling.constraint)
        cache = self.prefix_cache
        hit = cache.lookup(job.tenant, work.prompt_ids) if cache is not None else None
        own = 0  # tokens of the prefix this request computed itself (a lead): not served from the cache
        if self.sharing is not None:
            hit, own = yield from self.sharing.prefill(job.tenant, target, work.prompt_ids, hit, self._room(job))
        res = yield from engine.steps(work.prompt_ids, work.max_tokens, on_tokens, sampling=work.sampling,
                                      stop=stop if stop else None, prefix=hit, logprobs=work.logprobs,
                                      on_logprobs=on_logprobs, streaming=work.streaming)
        res.prefix_hit_tokens -= own
        if cache is not None:
            remember(cache, job.tenant, target, res, self._room(job))
        return res

    def _room(self, job: Job) -> int | None:
        """What the KV budget leaves the prefix cache now, ``job``'s own reservation counted as its (None: no
        budget)."""
        return self.budget.prefix_room(own=job.kv_tokens) if self.budget is not None else None



def close_target(target: Target, shared: bool = False) -> None:
    """Free a request's KV entries at once (a prefix-cache entry keeps its own views). A ``shared`` target (one
    sequence every request runs on, :attr:`Generator.shared`) keeps its cache: the next request of the same tenant
    starts from it, and :meth:`Generator.new_target` empties it for another tenant."""
    if not shared:
        target.release()

