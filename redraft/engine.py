"""The decode loop: prefill, propose, verify, accept, emit, roll back.

Every step asks the drafters for a proposal, runs ONE verify forward over the uncommitted tokens plus every
drafted token, accepts the longest drafted path that equals the target's greedy choices, emits the accepted tokens
plus the bonus token and drops the rejected tokens' KV entries. Plain greedy decoding is the same loop with no
drafters (one token per forward), so the baseline and the speculative runs share every line of model code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from redraft.defaults import EXACT_MARGIN, MAX_DRAFT_DEPTH
from redraft.drafters.base import Drafter
from redraft.genconfig import LogitsShaping
from redraft.policy.apply import Candidates, cut, observe_outcomes
from redraft.policy.speculation import SpeculationPolicy
from redraft.runstats import SourceStats
from redraft.sampling import GREEDY, SamplingParams, TokenChooser
from redraft.stopping import StopStrings
from redraft.target import HFTarget
from redraft.tree import TokenTree
from redraft.verify import greedy_accept, tree_attention_mask, tree_positions



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

    @property
    def tokens_per_forward(self) -> float:
        return len(self.output_ids) / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else 0.0


class Engine:
    """Lossless greedy speculative decoding of one sequence at a time.

    Args:
        model: a transformers causal LM (or an :class:`HFTarget` wrapping one).
        drafters: draft sources (:class:`~redraft.drafters.base.Drafter`) in priority order; empty = plain greedy
            decoding. Each is bound to this engine's target before every generation.
        eos_token_ids: ids that end a generation (may be empty).
        max_depth: cap on the draft depth (tokens along one path), 1..48.
        tree_budget: most nodes per verify forward.
        merge: False = the first drafter with a proposal wins the step (the foundation's priority rule);
            True = all proposals are merged into one token tree, in priority order, within the budget.
        exact: settle near-tie verify rows the way plain decoding does (a draft-free forward for that token).
        On sliding-window models only chains are verified (tree proposals are cut to their first path).
        exact_margin: a row whose top-2 score gap is below this (logit units) is a near-tie; verify rows differ
            from single-token forwards by ~1e-4 here, so 1e-3 leaves a tenfold margin.
        generation_config: True = shape the logits with the model's ``generation_config`` (read at each generate:
            repetition penalty, no-repeat n-grams, minimum lengths, ... see :mod:`redraft.genconfig`), as HF
            ``generate(do_sample=False)`` does; False = ignore it; or a ``GenerationConfig`` to use instead.
            Its sampling settings are never applied (``sampling=`` asks for sampling).
        policy: a :class:`~redraft.policy.SpeculationPolicy` (e.g. :func:`redraft.policy.apply.policy_for`), or
            None for fixed depths. With a policy, drafters propose up to ``max_depth`` and the policy chooses each
            step how much of the proposal to verify (depth; for trees the nodes, at most ``tree_budget``) from the
            measured cost curve and the acceptance it learns; it keeps learning across generations. Priority mode
            verifies the first proposal the policy keeps any of; merge mode cuts the merged tree.
    """

    def __init__(self, model, drafters: Sequence[Drafter] = (), *, eos_token_ids: Sequence[int] = (),
                 max_depth: int = MAX_DRAFT_DEPTH, tree_budget: int = 64, merge: bool = False,
                 exact: bool = True, exact_margin: float = EXACT_MARGIN,
                 generation_config=True, policy: SpeculationPolicy | None = None) -> None:
        self.target = model if isinstance(model, HFTarget) else HFTarget(model)
        self.drafters = list(drafters)
        self.eos = set(int(e) for e in eos_token_ids)
        self.max_depth = max(1, min(int(max_depth), MAX_DRAFT_DEPTH))
        self.tree_budget = tree_budget
        self.merge = merge
        self.exact = exact
        self.exact_margin = exact_margin
        self.chain_only = self.target.sliding_window is not None
        self.generation_config = generation_config
        self.policy = policy
        self._keys: list[str] = []  # the policy's key per node of the step's verify tree

    def _draft(self, context: np.ndarray, max_depth: int) -> TokenTree:
        """The verify tree of one step: each drafter's proposal in priority order, cleaned and merged."""
        tree = TokenTree()
        self._keys = []
        if max_depth <= 0:
            return tree
        if self.policy is not None:
            return self._draft_planned(context, max_depth)
        for name, prop in self._proposals(context, max_depth):
            tree.merge(prop, name, budget=self.tree_budget, max_depth=max_depth)
            if not self.merge or self.chain_only or len(tree) >= self.tree_budget:
                break
        return tree

    def _proposals(self, context: np.ndarray, max_depth: int):
        """(drafter name, proposal) in priority order, cleaned for the verifier; lazily, so a drafter after the
        one that wins the step is never asked."""
        for d in self.drafters:
            prop = d.propose(context, max_depth)
            if prop is None or len(prop) == 0:
                continue
            if self.chain_only:
                prop = prop.first_path()
            yield d.name, prop.within_vocab(self.target.vocab_size)

    def _draft_planned(self, context: np.ndarray, max_depth: int) -> TokenTree:
        """The verify tree of one step under the policy: the proposals as candidates, cut by the policy.

        Candidates may hold up to the policy's ``max_nodes``; the verified part at most ``tree_budget`` nodes and
        ``max_depth`` levels, as without a policy. Priority mode tries the sources in order and
        verifies the first proposal the policy keeps any of (a source whose draft does not pay leaves the step to
        the next one).
        """
        merged = Candidates()
        for name, prop in self._proposals(context, max_depth):
            cand = merged if self.merge and not self.chain_only else Candidates()
            cand.add(prop, name, budget=self.policy.max_nodes, max_depth=max_depth)
            if cand is not merged:
                tree, self._keys = cut(self.policy, cand, max_depth=max_depth, budget=self.tree_budget)
                if len(tree):
                    return tree
            elif len(merged) >= self.policy.max_nodes:
                break
        tree, self._keys = cut(self.policy, merged, max_depth=max_depth, budget=self.tree_budget)
        return tree

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None, *,
                 sampling: SamplingParams | None = None, stop: StopStrings | None = None,
                 exact: bool | None = None, record_margins: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: exact cap on generated tokens, even when a step accepts several.
            on_tokens: called with each step's newly emitted ids (for streaming).
            sampling: greedy (default) or seeded sampling; see :mod:`redraft.sampling`.
            stop: stop strings; the output ends with the token that completes the first one.
            exact: settle near-tie rows the way plain decoding does (default: the engine's ``exact``).
            record_margins: keep each emitted token's top-2 score gap in ``result.margins``.
        Returns:
            :class:`GenerationResult`; ``output_ids`` equal plain decoding's with the same sampling settings.
        Raises:
            ValueError: empty prompt, or a prompt that already fills the model's context.
            GenerationConfigError: a generation_config field processors cannot take (a ValueError).
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        max_len = self.target.max_length or (len(prompt) + max_new_tokens + 1)
        if len(prompt) >= max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the model's context length ({max_len})")
        exact = self.exact if exact is None else exact
        gc = self.generation_config
        if gc is True:
            gc = getattr(getattr(self.target, "model", None), "generation_config", None)
        chooser = TokenChooser(sampling or GREEDY, self.target.vocab_size, LogitsShaping.of(gc or None),
                               eos_token_ids=self.eos, max_new_tokens=max_new_tokens)
        chooser.reset(prompt)

        res = GenerationResult(prompt_ids=prompt, sources={d.name: SourceStats() for d in self.drafters})
        buf = np.empty(len(prompt) + max(max_new_tokens, 0) + 1, dtype=np.int64)
        buf[:len(prompt)] = prompt
        n_ctx = len(prompt)
        pending = prompt  # tokens not yet in the KV cache; the last one is the root of the draft tree
        plain_next = False  # after a near-tie: compute the next token with a draft-free forward, like plain decoding
        for d in self.drafters:
            d.bind(self.target)
            d.begin(buf[:n_ctx])
        self.target.reset()
        t0 = time.perf_counter()

        while True:
            remaining = max_new_tokens - len(res.output_ids)
            if remaining <= 0:
                res.stop_reason = "length"
                break
            if n_ctx >= max_len:
                res.stop_reason = "context"
                break
            # accepted + bonus must fit both the token budget and the context window
            depth = 0 if plain_next else min(self.max_depth, remaining - 1, max_len - n_ctx - 1)
            tree = self._draft(buf[:n_ctx], depth)

            n_past, n_pend = self.target.length, len(pending)
            if tree.is_chain:
                positions, mask = None, None  # plain causal attention over consecutive positions
            else:
                positions = tree_positions(tree, n_past, n_pend)
                mask = tree_attention_mask(tree, n_past, n_pend, self.target.dtype)
            logits = self.target.forward(pending + tree.tokens, positions, mask, n_logits=len(tree) + 1)
            res.forwards += 1
            res.drafted_per_forward.append(len(tree))
            # row 0 (the root) chooses the token at position n_ctx; node i's row the one at n_ctx + depth(i)
            row_pos = [n_ctx] + [n_ctx + d for d in tree.depths]
            extra = [[]] + [[tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))] \
                if chooser.processors else None
            choices, margins = chooser.choose(logits, row_pos, extra)
            path, bonus = greedy_accept(tree, choices)
            new = [tree.tokens[i] for i in path] + [bonus]
            rows = [0] + [i + 1 for i in path]  # the verify row that chose each token of `new`
            plain_next = False
            if exact and len(tree) > 0:
                # A verify row and a single-token forward differ by ~1e-4 in logits, so a choice closer than
                # exact_margin is not trusted: keep only the tokens decided before it and recompute that one with
                # a draft-free forward next step, the way plain decoding computes every token.
                tied = [j for j, r in enumerate(rows) if margins[r] < self.exact_margin]
                if tied:
                    new, rows, plain_next = new[:tied[0]], rows[:tied[0]], True
            if plain_next and not new:
                # the root's own row was a near-tie: recompute it with a draft-free forward of the root alone
                self._record(res, tree, [], 0, judged=0)
                pending = self._replay_root(n_past, n_pend, pending)
                continue
            n_acc = len(new) - 1 if not plain_next else len(new)
            self.target.keep(n_past + n_pend, [n_past + n_pend + i for i in path[:n_acc]])
            if plain_next:
                # the last kept token's row was a near-tie: drop its KV entry and feed it again alone
                self.target.crop(self.target.length - 1)
            new, stop_reason = self._cut(new, remaining, res.output_ids, stop)
            # Statistics count only what was emitted: a forward whose tokens were cut short of accepted + bonus
            # (EOS, stop string, token limit, near-tie) judged the draft positions up to the tokens it emitted.
            judged = len(new) if len(new) < len(path) + 1 else None
            self._record(res, tree, path[:min(n_acc, len(new))], len(new), judged)
            if record_margins:
                res.margins.extend(float(margins[r]) for r in rows[:len(new)])
            buf[n_ctx:n_ctx + len(new)] = new
            n_ctx += len(new)
            res.output_ids.extend(new)
            chooser.commit(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if stop_reason:
                res.stop_reason = stop_reason
                break
            pending = [new[-1]]

        res.seconds = time.perf_counter() - t0
        return res

    def _replay_root(self, n_past: int, n_pend: int, pending: list[int]) -> list[int]:
        """Undo a forward whose root row was a near-tie; return the tokens to feed next (draft-free).

        At prefill plain decoding runs the whole prompt in one forward, so the prompt is fed again whole;
        later the root alone is fed on the cache of everything before it.
        """
        self.target.crop(n_past + n_pend - 1 if n_pend == 1 else n_past)
        return pending if n_pend > 1 else pending[-1:]

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

    def _record(self, res: GenerationResult, tree: TokenTree, path: list[int], emitted: int,
                judged: int | None) -> None:
        """Per-forward and per-source statistics of one verify forward, and each drafter's ``observe``.

        Args:
            path: accepted node indices whose tokens were emitted.
            emitted: tokens this forward emitted.
            judged: None, or the draft depth the output reached when it was cut short: deeper nodes were never
                part of the output, so they count neither as proposed nor for the draft depth.
        """
        if self.policy is not None:
            observe_outcomes(self.policy, tree, self._keys, path, judged)
        depths = tree.depths if judged is None else [min(d, judged) for d in tree.depths]
        res.accepted_per_forward.append(len(path))
        res.draft_depth_per_forward.append(max(depths, default=0))
        proposed: dict[str, int] = {}
        for s, depth in zip(tree.sources, tree.depths):
            if judged is None or depth <= judged:
                proposed[s] = proposed.get(s, 0) + 1
        res.source_per_forward.append(tuple(d.name for d in self.drafters if d.name in proposed))
        accepted: dict[str, int] = {}
        for i in path:
            accepted[tree.sources[i]] = accepted.get(tree.sources[i], 0) + 1
        for d in self.drafters:
            p, a = proposed.get(d.name, 0), accepted.get(d.name, 0)
            st = res.sources[d.name]
            st.proposed += p
            st.accepted += a
            st.steps += p > 0
            before = d.guard.pauses if d.guard is not None else 0
            d.observe(p, a, emitted)
            st.paused += d.guard is not None and d.guard.pauses > before
