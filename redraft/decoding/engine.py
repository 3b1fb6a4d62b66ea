"""The decode loop: draft -> verify -> accept -> emit (the shape of gpt-fast's ``generate.py`` speculative step).

Every step asks the drafters for a proposal (:class:`~redraft.decoding.step.Draft`), runs ONE verify forward over the
uncommitted tokens plus every drafted token (:func:`~redraft.decoding.step.verify_step`), accepts the longest drafted
path that equals the target's choices, emits the accepted tokens plus the bonus token and drops the rejected tokens'
KV entries. Exact mode's near-tie handling is :class:`~redraft.decoding.exact_mode.ExactMode`. Plain greedy decoding is the same loop with no
drafters (one token per forward), so the baseline and the speculative runs share every line of model code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from redraft.decoding.exact_mode import ExactMode
from redraft.decoding.genconfig import LogitsShaping
from redraft.decoding.logprobs import TokenLogprob, row_logprobs
from redraft.decoding.planner import Draft, DraftLimits, DraftPlanner
from redraft.decoding.runstats import SourceStats
from redraft.decoding.sampling import GREEDY, SamplingParams, TokenChooser
from redraft.decoding.step import Step, verify_step
from redraft.decoding.stopping import StopStrings
from redraft.defaults import MAX_DRAFT_DEPTH, POLICY_MAX_DEPTH, check_depth
from redraft.drafters.base import Drafter
from redraft.policy.speculation import SpeculationPolicy
from redraft.runtimes.sequence import Steps, drive
from redraft.runtimes.transformers.target import PrefixKV, as_target


@dataclass
class GenerationResult:
    """One generation.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated ids (an EOS that ended the generation is included, as in HF ``generate``).
        forwards: target forwards, prefill included.
        seconds: wall-clock seconds for the whole generation (prefill included).
        stop_reason: "eos", "length" (max_new_tokens), "context" (the model's context length) or "stop".
        sources: per-drafter :class:`SourceStats`.
        accepted_per_forward: accepted draft tokens emitted by each forward (0 where nothing was drafted or
            accepted); a forward emits accepted + 1 tokens, or fewer when the output ends inside its draft.
        drafted_per_forward: draft tokens (tree nodes) verified in each forward, all of them (the forward's width:
            with a cost curve c(S) it gives the model-time cost of the run).
        draft_depth_per_forward: the verify tree's depth in each forward (tokens along its longest path, 0 = no
            draft), capped at the tokens emitted when the output ended inside the draft; with
            ``accepted_per_forward`` it gives acceptance by draft position.
        source_per_forward: names of the drafters with counted nodes (see :class:`SourceStats`) in each forward,
            in priority order (empty tuple = no draft).
        margins: with ``record_margins``, the top-2 score gap of the row that chose each output token.
        logprobs: with ``logprobs=k``, one :class:`redraft.decoding.logprobs.TokenLogprob` per output token (its raw
            log-probability and the top k of the row that chose it, verify rows included); else None.
        near_ties: rows exact mode did not trust (top-2 gap under the near-tie threshold).
        settle_forwards: forwards exact mode ran to recompute such rows the way plain decoding does (draft-free
            recomputes and replays of the cache); included in ``forwards``.
        prefix_hit_tokens: prompt tokens whose KV entries came from ``generate(prefix=...)`` (not computed here).
        prefix_disk_tokens: those of them read from disk (the prefix's ``origin`` is "disk"), else 0.
    """

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    forwards: int = 0
    seconds: float = 0.0
    stop_reason: str = "length"
    sources: dict[str, SourceStats] = field(default_factory=dict)
    accepted_per_forward: list[int] = field(default_factory=list)
    drafted_per_forward: list[int] = field(default_factory=list)
    draft_depth_per_forward: list[int] = field(default_factory=list)
    source_per_forward: list[tuple[str, ...]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    near_ties: int = 0
    settle_forwards: int = 0
    prefix_hit_tokens: int = 0
    prefix_disk_tokens: int = 0

    @property
    def tokens_per_forward(self) -> float:
        return len(self.output_ids) / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0


class Engine:
    """Lossless greedy speculative decoding of one sequence at a time.

    Args:
        model: a transformers causal LM, or a :class:`~redraft.runtimes.transformers.target.Target` (an :class:`HFTarget`
            wrapping one, a :class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget`).
        drafters: draft sources (:class:`~redraft.drafters.base.Drafter`) in priority order; empty = plain greedy
            decoding. Each is bound to this engine's target before every generation.
        eos_token_ids: ids that end a generation (may be empty).
        max_depth: cap on the draft depth (tokens along one path), 1..48 (Colibri's cap); with a ``policy``
            1..POLICY_MAX_DEPTH (512): the policy verifies deep drafts only where its cost curve says they pay.
        tree_budget: most nodes per verify forward.
        merge: False = the first drafter with a proposal wins the step (the foundation's priority rule);
            True = all proposals are merged into one token tree, in priority order, within the budget.
        exact: trust a row computed otherwise than plain decoding computes it only when its top-2 gap clears the
            near-tie threshold; recompute the others the way plain decoding does
            (:class:`redraft.decoding.exact_mode.ExactMode`).
        exact_margin: None = the near-tie threshold follows the model's dtype and each row's logit size
            (:func:`redraft.decoding.exactness.near_tie_threshold`, EXACT_SAFETY for verify rows, EXACT_SETTLE_SAFETY for
            draft-free rows on a cache drafting wrote); a number = that fixed threshold in logit units for every row.
        On sliding-window models only chains are verified (tree proposals are cut to their first path).
        generation_config: True = shape the logits with the model's ``generation_config`` (read at each generate:
            repetition penalty, no-repeat n-grams, minimum lengths, ... see :mod:`redraft.decoding.genconfig`), as HF
            ``generate(do_sample=False)`` does; False = ignore it; or a ``GenerationConfig`` to use instead.
            Its sampling settings are never applied (``sampling=`` asks for sampling).
        policy: a :class:`~redraft.policy.SpeculationPolicy` (built by :func:`redraft.compose.build_policy`), or
            None for fixed depths. With a policy, drafters propose up to ``max_depth`` and the policy chooses each
            step how much of the proposal to verify (depth; for trees the nodes, at most ``tree_budget``) from the
            measured cost curve and the acceptance it learns; it keeps learning across generations. Priority mode
            verifies the first proposal the policy keeps any of; merge mode cuts the merged tree.
    """

    def __init__(self, model, drafters: Sequence[Drafter] = (), *, eos_token_ids: Sequence[int] = (),
                 max_depth: int = MAX_DRAFT_DEPTH, tree_budget: int = 64, merge: bool = False,
                 exact: bool = True, exact_margin: float | None = None,
                 generation_config=True, policy: SpeculationPolicy | None = None) -> None:
        self.target = as_target(model)
        self.drafters = list(drafters)
        self.eos = set(int(e) for e in eos_token_ids)
        # a cap, clamped (not refused) into the depth rule's range: 1..48, or 1..512 under a policy
        self.max_depth = check_depth(None, int(max_depth), out_of_range="clamp",
                                     hi=POLICY_MAX_DEPTH if policy is not None else MAX_DRAFT_DEPTH)
        self.tree_budget = tree_budget
        self.merge = merge
        self.exact = exact
        self.exact_margin = exact_margin
        self.chain_only = self.target.chain_only
        self.generation_config = generation_config
        self.policy = policy
        self.planner = DraftPlanner(self.drafters, policy, merge=merge, chain_only=self.chain_only,
                                    tree_budget=tree_budget, vocab_size=self.target.vocab_size)

    def _draft(self, context: np.ndarray, max_depth: int, fed: int = 1, awaited: bool = False) -> Draft:
        """The step's :class:`Draft` from this engine's :class:`~redraft.decoding.planner.DraftPlanner`, priced at
        the rows the step carries for other sequences (``target.carried_rows``) on top of the ``fed`` pending
        tokens (``awaited``: a streaming client waits for this forward's first token); an empty tree when
        ``max_depth`` is 0."""
        return self.planner.propose(context, DraftLimits(max_depth, fed=fed, carried=self.target.carried_rows,
                                                         first_token_awaited=awaited))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None, *,
                 sampling: SamplingParams | None = None, stop: StopStrings | None = None,
                 exact: bool | None = None, record_margins: bool = False,
                 prefix: PrefixKV | None = None, logprobs: int | None = None,
                 streaming: bool = False) -> GenerationResult:
        """:meth:`steps` run to its end on this engine's target alone (:func:`redraft.runtimes.sequence.drive`):
        every forward is :meth:`HFTarget.forward` on its own cache. Same arguments, result and errors."""
        return drive(self.steps(prompt_ids, max_new_tokens, on_tokens, sampling=sampling, stop=stop, exact=exact,
                                record_margins=record_margins, prefix=prefix, logprobs=logprobs,
                                streaming=streaming))

    def steps(self, prompt_ids: Sequence[int], max_new_tokens: int,
              on_tokens: Callable[[list[int]], None] | None = None, *,
              sampling: SamplingParams | None = None, stop: StopStrings | None = None,
              exact: bool | None = None, record_margins: bool = False,
              prefix: PrefixKV | None = None, logprobs: int | None = None,
              on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
              streaming: bool = False) -> Steps[GenerationResult]:
        """One generation as a step function (:mod:`redraft.runtimes.sequence`): it yields each target forward it
        needs and is resumed with its logits, so a step loop can advance many generations one forward at a time
        (:class:`redraft.runtimes.transformers.batching.StepBatcher`). Generate up to ``max_new_tokens`` tokens (an exact cap): draft -> verify -> accept -> emit, one verify
        forward a step. ``on_tokens`` gets each step's new ids (streaming); ``sampling``: greedy (default) or seeded
        (:mod:`redraft.decoding.sampling`); ``stop``: stop strings (the output ends with the token completing one);
        ``exact``: settle near-tie rows as plain decoding computes them (:class:`redraft.decoding.exact_mode.ExactMode`;
        default the engine's); ``record_margins``: each token's top-2 gap in ``result.margins``; ``prefix``: KV entries
        of the prompt's first tokens from an earlier sequence (prefix caching, as vLLM's; exact mode judges rows on
        them like verify rows); ``logprobs`` (0..20): raw log-probabilities per token (:mod:`redraft.decoding.logprobs`);
        ``on_logprobs`` gets each step's new entries of them, just before ``on_tokens`` gets the step's ids (streamed
        log-probabilities: together they are ``result.logprobs``); ``streaming``: the caller shows tokens as they
        come, so until the first one a draft must be likely right to ride on the forward that carries the prompt
        (the policy's ``prompt_chance``: its rows would delay the first token; a whole answer is awaited otherwise).

        Returns :class:`GenerationResult` whose ``output_ids`` equal plain decoding's with the same sampling settings.
        Raises ValueError for an empty prompt, one that fills the context, or a ``prefix`` that is not a proper prefix
        of the prompt; GenerationConfigError (a ValueError) for a generation_config field processors cannot take.
        """
        prompt, max_len = self._check_prompt(prompt_ids, max_new_tokens, prefix)  # raised at the first next()
        chooser = self._chooser(prompt, sampling, max_new_tokens)
        exactness = ExactMode(self.target, self.exact_margin) if (self.exact if exact is None else exact) else None
        # the top-2 gaps cost a second pass over each row's logits: taken only where something reads them
        chooser.margins = record_margins or (exactness is not None and not exactness.invariant)
        res = GenerationResult(prompt_ids=prompt, sources={d.name: SourceStats() for d in self.drafters},
                               logprobs=None if logprobs is None else [])
        context = np.empty(len(prompt) + max(max_new_tokens, 0) + 1, dtype=np.int64)  # prompt + output
        context[:len(prompt)] = prompt
        n_ctx = len(prompt)
        res.prefix_hit_tokens = self._begin(context[:n_ctx], prefix)
        res.prefix_disk_tokens = res.prefix_hit_tokens if prefix is not None and prefix.origin == "disk" else 0
        pending = prompt[res.prefix_hit_tokens:]  # tokens not yet in the KV cache; the last is the tree's root
        t0 = time.perf_counter()
        while (remaining := max_new_tokens - len(res.output_ids)) > 0 and n_ctx < max_len:
            # draft (accepted + bonus must fit both the token budget and the context window)
            depth = min(self.max_depth, remaining - 1, max_len - n_ctx - 1)
            draft = self._draft(context[:n_ctx], depth if exactness is None or exactness.may_draft else 0,
                                len(pending), streaming and not res.output_ids)
            # verify: one forward over the pending tokens and the tree; the longest path the target agrees with
            with exactness.scope() if exactness is not None else nullcontext():
                step = yield from verify_step(self.target, chooser, pending, draft, n_ctx)
            keep = exactness.judge(step, chooser) if exactness else len(step.new)
            # accept: keep the KV entries of the kept nodes; end the output at the budget, EOS or a stop string
            self._keep_kv(step, keep)
            new, stop_reason = self._cut(step.new[:keep], remaining, res.output_ids, stop)
            self._record(res, draft, step.path[:len(new)], len(new),
                         judged=len(new) if len(new) < len(step.path) + 1 else None)
            # emit
            context[n_ctx:n_ctx + len(new)] = new
            n_ctx += len(new)
            res.output_ids.extend(new)
            chooser.commit(new)
            self._annotate(res, step, new, record_margins, logprobs)
            if on_logprobs is not None and res.logprobs is not None and new:
                on_logprobs(res.logprobs[-len(new):])
            if on_tokens is not None and new:
                on_tokens(new)
            if stop_reason:
                res.stop_reason = stop_reason
                break
            pending = [new[-1]] if new else pending
            if exactness is not None:
                exactness.emitted(len(new))
                if exactness.settling and remaining > len(new) and n_ctx < max_len:  # recompute the near-tie row
                    pending, rebuilt = yield from exactness.settle(step, len(new), context[:n_ctx], len(prompt))
                    for _ in range(rebuilt):
                        self._record(res, Draft(), [], 0, judged=0)
        else:
            res.stop_reason = "length" if remaining <= 0 else "context"
        if exactness is not None:
            res.near_ties, res.settle_forwards = exactness.near_ties, exactness.settle_forwards
        res.seconds = time.perf_counter() - t0
        return res

    @staticmethod
    def _annotate(res: GenerationResult, step: Step, new: list[int], margins: bool, logprobs: int | None) -> None:
        """Per emitted token, from the row that chose it: its top-2 gap (``margins``) and log-probabilities."""
        if margins:
            res.margins.extend(step.margin(r) for r in step.rows[:len(new)])
        if res.logprobs is not None:
            res.logprobs.extend(row_logprobs(step.logits, step.rows[:len(new)], new, logprobs or 0))

    def _begin(self, prompt: np.ndarray, prefix: PrefixKV | None = None) -> int:
        """A new sequence: bind and begin every drafter; empty the target's KV cache, or seed it with ``prefix``
        (exact mode never takes rows computed on reused entries for plain decoding's). Returns the prompt tokens
        whose KV entries came from ``prefix``."""
        for d in self.drafters:
            d.bind(self.target)
            d.begin(prompt)
        self.planner.begin()
        if prefix is None or not prefix.length:
            self.target.reset()
            return 0
        self.target.seed(prefix)
        return prefix.length

    def _check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int,
                      prefix: PrefixKV | None = None) -> tuple[list[int], int]:
        """The prompt as a list of ints and the context length it must stay under (ValueError when it does not, or
        when ``prefix`` is not a proper prefix of the prompt)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        max_len = self.target.max_length or (len(prompt) + max_new_tokens + 1)
        if len(prompt) >= max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the model's context length ({max_len})")
        if prefix is not None and (prefix.length >= len(prompt) or list(prefix.ids) != prompt[:prefix.length]):
            raise ValueError(f"prefix: its {prefix.length} ids are not a proper prefix of the {len(prompt)}-token "
                             "prompt")
        return prompt, max_len

    def _chooser(self, prompt: list[int], sampling: SamplingParams | None, max_new_tokens: int) -> TokenChooser:
        """This generation's token choice: sampling settings and the generation_config's logits processors."""
        gc = self.generation_config
        if gc is True:
            gc = getattr(getattr(self.target, "model", None), "generation_config", None)
        chooser = TokenChooser(sampling or GREEDY, self.target.vocab_size, LogitsShaping.of(gc or None),
                               eos_token_ids=self.eos, max_new_tokens=max_new_tokens)
        chooser.reset(prompt)
        return chooser

    def _keep_kv(self, step: Step, keep: int) -> None:
        """Keep the KV entries of the pending tokens and the first ``keep`` tokens' accepted nodes, drop the rest.

        When exact mode cut the step before a near-tie (``keep`` <= accepted nodes), the last kept token's entry is
        dropped too (it is fed again, alone, to recompute the near-tie row); with nothing kept the pending tokens go.
        """
        base = step.n_past + step.n_fed
        if keep == 0:
            self.target.crop(step.n_past)
            return
        self.target.keep(base, [base + i for i in step.path[:min(keep, len(step.path))]])
        if keep <= len(step.path):
            self.target.crop(self.target.length - 1)

    def _cut(self, new: list[int], remaining: int, output: list[int], stop: StopStrings | None
             ) -> tuple[list[int], str | None]:
        """The head of ``new`` to emit and why the generation stops there (None: it goes on).

        Cuts at the token budget, after the first EOS id, then at the token completing a stop string.
        """
        new, reason = new[:remaining], None
        for j, t in enumerate(new):
            if t in self.eos:
                new, reason = new[:j + 1], "eos"
                break
        cut = stop.check(output + new) if stop else None
        if cut is not None:
            new, reason = new[:max(0, cut - len(output))], "stop"
        return new, reason

    def _record(self, res: GenerationResult, draft: Draft, path: list[int], emitted: int,
                judged: int | None) -> None:
        """Per-forward and per-source statistics of one forward, and each drafter's ``observe``.

        Args:
            draft: the forward's :class:`Draft` (empty for a draft-free forward).
            path: accepted node indices whose tokens were emitted.
            emitted: tokens this forward emitted.
            judged: None, or the draft depth the output reached when it was cut short: deeper nodes were never
                part of the output, so they count neither as proposed nor for the draft depth.
        """
        tree = draft.tree
        res.forwards += 1
        res.drafted_per_forward.append(len(tree))
        depths = tree.depths if judged is None else [min(d, judged) for d in tree.depths]
        res.accepted_per_forward.append(len(path))
        res.draft_depth_per_forward.append(max(depths, default=0))
        outcomes = self.planner.observe(draft, path, emitted, judged)
        res.source_per_forward.append(tuple(n for n, o in outcomes.items() if o.proposed))
        for name, o in outcomes.items():
            st = res.sources[name]
            st.proposed += o.proposed
            st.accepted += o.accepted
            st.steps += o.proposed > 0
            st.paused += o.paused
