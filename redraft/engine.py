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
import torch

from redraft.drafters.base import Drafter
from redraft.target import HFTarget
from redraft.tree import TokenTree
from redraft.verify import greedy_accept, tree_attention_mask, tree_positions

MAX_DRAFT_DEPTH = 48


@dataclass
class SourceStats:
    """Per-drafter counts over one generation: draft tokens proposed and accepted, and steps it drafted."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class GenerationResult:
    """One generation.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated ids (an EOS that ended the generation is included, as in HF ``generate``).
        forwards: target forwards, prefill included.
        seconds: wall-clock seconds for the whole generation (prefill included).
        stop_reason: "eos", "length" (max_new_tokens) or "context" (the model's context length).
        sources: per-drafter :class:`SourceStats`.
        accepted_per_forward: accepted draft tokens in each forward (0 where nothing was drafted or accepted).
    """

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    forwards: int = 0
    seconds: float = 0.0
    stop_reason: str = "length"
    sources: dict[str, SourceStats] = field(default_factory=dict)
    accepted_per_forward: list[int] = field(default_factory=list)

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
        drafters: draft sources in priority order; empty = plain greedy decoding.
        eos_token_ids: ids that end a generation (may be empty).
        max_depth: cap on the draft depth (tokens along one path), 1..48.
        tree_budget: most nodes per verify forward.
        merge: False = the first drafter with a proposal wins the step (the foundation's priority rule);
            True = all proposals are merged into one token tree, in priority order, within the budget.
    """

    def __init__(self, model, drafters: Sequence[Drafter] = (), *, eos_token_ids: Sequence[int] = (),
                 max_depth: int = MAX_DRAFT_DEPTH, tree_budget: int = 64, merge: bool = False) -> None:
        self.target = model if isinstance(model, HFTarget) else HFTarget(model)
        self.drafters = list(drafters)
        self.eos = set(int(e) for e in eos_token_ids)
        self.max_depth = max(1, min(int(max_depth), MAX_DRAFT_DEPTH))
        self.tree_budget = tree_budget
        self.merge = merge

    def _draft(self, context: np.ndarray, max_depth: int) -> TokenTree:
        tree = TokenTree()
        if max_depth <= 0:
            return tree
        for d in self.drafters:
            prop = d.propose(context, max_depth)
            if prop is None or len(prop) == 0:
                continue
            if prop.parents is None:
                tree.add_chain(prop.tokens, d.name, budget=self.tree_budget, max_depth=max_depth)
            else:
                tree.add_subtree(prop.tokens, prop.parents, d.name, budget=self.tree_budget, max_depth=max_depth)
            if not self.merge or len(tree) >= self.tree_budget:
                break
        return tree

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens greedily.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: exact cap on generated tokens, even when a step accepts several.
            on_tokens: called with each step's newly emitted ids (for streaming).
        Returns:
            :class:`GenerationResult`; ``output_ids`` equal plain greedy decoding's.
        Raises:
            ValueError: empty prompt, or a prompt that already fills the model's context.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        max_len = self.target.max_length or (len(prompt) + max_new_tokens + 1)
        if len(prompt) >= max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens fills the model's context length ({max_len})")

        res = GenerationResult(prompt_ids=prompt, sources={d.name: SourceStats() for d in self.drafters})
        buf = np.empty(len(prompt) + max(max_new_tokens, 0) + 1, dtype=np.int64)
        buf[:len(prompt)] = prompt
        n_ctx = len(prompt)
        pending = prompt  # tokens not yet in the KV cache; the last one is the root of the draft tree
        for d in self.drafters:
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
            depth = min(self.max_depth, remaining - 1, max_len - n_ctx - 1)
            tree = self._draft(buf[:n_ctx], depth)

            n_past, n_pend = self.target.length, len(pending)
            if tree.is_chain:
                positions, mask = None, None  # plain causal attention over consecutive positions
            else:
                positions = tree_positions(tree, n_past, n_pend)
                mask = tree_attention_mask(tree, n_past, n_pend, self.target.dtype)
            logits = self.target.forward(pending + tree.tokens, positions, mask, n_logits=len(tree) + 1)
            choices = logits.argmax(-1).tolist()
            path, bonus = greedy_accept(tree, choices)
            res.forwards += 1
            self.target.keep(n_past + n_pend, [n_past + n_pend + i for i in path])

            new = [tree.tokens[i] for i in path] + [bonus]
            res.accepted_per_forward.append(len(path))
            self._account(res, tree, path, len(new))

            stop = None
            for j, t in enumerate(new):
                if t in self.eos:
                    new, stop = new[:j + 1], "eos"
                    break
            new = new[:remaining]
            buf[n_ctx:n_ctx + len(new)] = new
            n_ctx += len(new)
            res.output_ids.extend(new)
            if on_tokens is not None:
                on_tokens(new)
            if stop:
                res.stop_reason = stop
                break
            pending = [new[-1]]

        res.seconds = time.perf_counter() - t0
        return res

    def _account(self, res: GenerationResult, tree: TokenTree, path: list[int], emitted: int) -> None:
        if not self.drafters:
            return
        proposed: dict[str, int] = {}
        for s in tree.sources:
            proposed[s] = proposed.get(s, 0) + 1
        accepted: dict[str, int] = {}
        for i in path:
            accepted[tree.sources[i]] = accepted.get(tree.sources[i], 0) + 1
        for d in self.drafters:
            p, a = proposed.get(d.name, 0), accepted.get(d.name, 0)
            st = res.sources[d.name]
            st.proposed += p
            st.accepted += a
            st.steps += p > 0
            d.observe(p, a, emitted)
