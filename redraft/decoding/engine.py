"""The decode loop: prefill, propose, verify, accept, emit, roll back.

Every step asks the drafters for a proposal, runs ONE verify forward over the uncommitted tokens plus every
drafted token, accepts the longest drafted path that equals the target's greedy choices, emits the accepted tokens
plus the bonus token and drops the rejected tokens' KV entries. Plain greedy decoding is the same loop with no
drafters (one token per forward), so the baseline and the speculative runs share every line of model code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from redraft.decoding.exactness import near_tie_threshold
from redraft.decoding.genconfig import LogitsShaping
from redraft.decoding.logprobs import TokenLogprob, row_logprobs
from redraft.decoding.runstats import SourceStats
from redraft.decoding.sampling import GREEDY, SamplingParams, TokenChooser
from redraft.decoding.stopping import StopStrings
from redraft.decoding.target import HFTarget
from redraft.decoding.verify import greedy_accept, tree_attention_mask, tree_positions
from redraft.defaults import EXACT_PAY_PAUSE, EXACT_PAY_WINDOW, EXACT_SAFETY, EXACT_SETTLE_SAFETY, MAX_DRAFT_DEPTH
from redraft.drafters.base import AcceptanceGuard, Drafter
from redraft.policy.apply import Candidates, cut, observe_outcomes
from redraft.policy.speculation import SpeculationPolicy
from redraft.tree import TokenTree


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
        exact: trust a row computed otherwise than plain decoding computes it only when its top-2 gap clears the
            near-tie threshold; recompute the others the way plain decoding does (see :meth:`generate`).
        exact_margin: None = the near-tie threshold follows the model's dtype and each row's logit size
            (:func:`redraft.decoding.exactness.near_tie_threshold`, EXACT_SAFETY for verify rows, EXACT_SETTLE_SAFETY for
            draft-free rows on a cache drafting wrote); a number = that fixed threshold in logit units for every row.
        On sliding-window models only chains are verified (tree proposals are cut to their first path).
        generation_config: True = shape the logits with the model's ``generation_config`` (read at each generate:
            repetition penalty, no-repeat n-grams, minimum lengths, ... see :mod:`redraft.decoding.genconfig`), as HF
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
                 exact: bool = True, exact_margin: float | None = None,
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
                 exact: bool | None = None, record_margins: bool = False,
                 logprobs: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens.

        Args:
            prompt_ids: at least one token id.
            max_new_tokens: exact cap on generated tokens, even when a step accepts several.
            on_tokens: called with each step's newly emitted ids (for streaming).
            sampling: greedy (default) or seeded sampling; see :mod:`redraft.decoding.sampling`.
            stop: stop strings; the output ends with the token that completes the first one.
            exact: settle near-tie rows the way plain decoding does (default: the engine's ``exact``).
                Plain decoding feeds the prompt in one forward, then one token per forward; a forward shaped like
                that on a cache built like that computes plain decoding's row bit for bit, so its choice is
                trusted as is (ties included). Any other row (a verify row, or one token on a cache verify forwards
                wrote) is trusted only above the near-tie threshold; the first row below it is recomputed: first
                by a draft-free forward, and when that row is still a near-tie on a cache drafting wrote, by
                rebuilding the cache the way plain decoding built it (one token per forward from the last point
                where the two caches agree) before recomputing it. Where such recomputing costs more forwards than
                the accepted drafts save (16-bit dtypes: most rows are near-ties), drafting pauses for
                EXACT_PAY_PAUSE tokens, so exact mode costs about what plain decoding costs.
            record_margins: keep each emitted token's top-2 score gap in ``result.margins``.
            logprobs: None, or 0..20: keep each emitted token's raw log-probability and the row's top ``logprobs``
                alternatives in ``result.logprobs`` (:mod:`redraft.decoding.logprobs`).
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

        res = GenerationResult(prompt_ids=prompt, sources={d.name: SourceStats() for d in self.drafters},
                               logprobs=None if logprobs is None else [])
        buf = np.empty(len(prompt) + max(max_new_tokens, 0) + 1, dtype=np.int64)
        buf[:len(prompt)] = prompt
        n_ctx = len(prompt)
        pending = prompt  # tokens not yet in the KV cache; the last one is the root of the draft tree
        settle = False  # after a near-tie: compute the next token with a draft-free forward, like plain decoding
        plain_len = 0  # the cached prefix whose KV entries plain decoding computed the same way (exact mode)
        # exact mode's payoff: "accepted" = forwards the accepted drafts saved, the rest = forwards settling wasted
        payoff = AcceptanceGuard(0.5, window=EXACT_PAY_WINDOW, pause=EXACT_PAY_PAUSE) if exact else None
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
            drafting = not settle and (payoff is None or payoff.active)
            depth = min(self.max_depth, remaining - 1, max_len - n_ctx - 1) if drafting else 0
            tree = self._draft(buf[:n_ctx], depth)

            n_past, n_pend = self.target.length, len(pending)
            # fed as plain decoding feeds (the prompt, or one token) on a cache plain decoding would hold
            plain_row = len(tree) == 0 and n_past == plain_len and (n_past == 0 or n_pend == 1)
            res.settle_forwards += settle
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
            settle = False
            if plain_row:
                plain_len = n_past + n_pend
            elif exact:
                # Rows computed otherwise than plain decoding computes them differ from its rows by rounding: keep
                # only the tokens decided before the first near-tie and recompute that one (see the docstring).
                tied = [j for j, bad in enumerate(self._untrusted(chooser, logits, rows, choices, margins, row_pos,
                                                                  extra, bool(tree))) if bad]
                if tied:
                    new, rows, settle = new[:tied[0]], rows[:tied[0]], True
                    res.near_ties += 1
            if settle and not new:
                # The first row was a near-tie. After a verify forward: recompute it with a draft-free forward. After
                # a draft-free row on a cache drafting wrote: first rebuild that cache the way plain decoding built it.
                self._record(res, tree, [], 0, judged=0)
                self.target.crop(n_past)
                replayed = 0
                if not tree:
                    pending, replayed = self._replay_plain(res, buf, n_ctx, prompt, plain_len)
                    plain_len = self.target.length
                payoff.record(1 + replayed, 0, 0)
                continue
            n_acc = len(new) - 1 if not settle else len(new)
            self.target.keep(n_past + n_pend, [n_past + n_pend + i for i in path[:n_acc]])
            if settle:
                # the last kept token's row was a near-tie: drop its KV entry and feed it again alone
                self.target.crop(self.target.length - 1)
            new, stop_reason = self._cut(new, remaining, res.output_ids, stop)
            # Statistics count only what was emitted: a forward whose tokens were cut short of accepted + bonus
            # (EOS, stop string, token limit, near-tie) judged the draft positions up to the tokens it emitted.
            judged = len(new) if len(new) < len(path) + 1 else None
            self._record(res, tree, path[:min(n_acc, len(new))], len(new), judged)
            if payoff is not None:
                payoff.record(max(len(new) - 1, 0), max(len(new) - 1, 0), len(new))
            if record_margins:
                res.margins.extend(float(margins[r]) for r in rows[:len(new)])
            if res.logprobs is not None:
                res.logprobs.extend(row_logprobs(logits, rows[:len(new)], new, logprobs))
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

    def _untrusted(self, chooser: TokenChooser, logits, rows: list[int], choices: list[int], margins,
                   row_pos: list[int], extra, drafted: bool) -> list[bool]:
        """Per emitted token's row (``rows`` index ``logits`` [R, V]): True where exact mode does not trust its
        choice, i.e. the row's top-2 gap is under the near-tie threshold (``exact_margin`` when set)."""
        if self.exact_margin is not None:
            return [float(margins[r]) < self.exact_margin for r in rows]
        need = near_tie_threshold(logits[rows], self.target.dtype, EXACT_SAFETY if drafted else EXACT_SETTLE_SAFETY)
        if not chooser.processors:
            return [float(margins[r]) < float(m) for r, m in zip(rows, need)]
        # Logits processors (penalties, biases, masks) reshape each logit monotonically, so a choice holds for every
        # row within the noise iff it holds for the worst one: its logit lowered by half the threshold, the others
        # raised by it (a penalty's factor then scales the noise of exactly the logits it scales).
        chosen = [choices[r] for r in rows]
        worst = logits[rows].double() + (need.double() / 2).unsqueeze(-1)
        worst[range(len(rows)), chosen] -= need.double()
        got, gaps = chooser.choose(worst, [row_pos[r] for r in rows], [extra[r] for r in rows] if extra else None)
        return [g != c or float(m) <= 0.0 for g, c, m in zip(got, chosen, gaps)]

    def _replay_plain(self, res: GenerationResult, buf: np.ndarray, n_ctx: int, prompt: list[int],
                      plain_len: int) -> tuple[list[int], int]:
        """Rebuild the KV cache the way plain decoding built it; return the tokens the next forward feeds and the
        number of forwards it ran.

        Keeps the first ``plain_len`` cached positions (computed as plain decoding computes them), feeds the prompt
        in one forward if it is not among them, then each committed token in a forward of its own, up to the last
        one: the next forward, that token alone, then computes plain decoding's row bit for bit. Each forward is
        counted (``forwards``, ``settle_forwards``) and recorded like a draft-free step that emitted nothing.
        """
        self.target.crop(plain_len)
        feed = [] if plain_len or n_ctx == len(prompt) else [prompt]
        feed += [[int(t)] for t in buf[max(plain_len, len(prompt)):n_ctx - 1]]
        for ids in feed:
            self.target.forward(ids)
            res.forwards += 1
            res.settle_forwards += 1
            res.drafted_per_forward.append(0)
            self._record(res, TokenTree(), [], 0, judged=0)
        return (prompt if n_ctx == len(prompt) else [int(buf[n_ctx - 1])]), len(feed)

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
