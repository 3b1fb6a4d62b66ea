"""Token choice for verify rows: greedy or seeded sampling, with logits processors, as one comparison.

Sampling uses the Gumbel-max trick with noise drawn from a counter-based generator (numpy's Philox, Salmon et
al. 2011) whose key is the seed and the *absolute position* of the token being chosen. The token at position t is
``argmax(processed_logits / T + G(seed, t))``, which is an exact sample from the processed distribution, and it is
the same number whether position t is computed by plain decoding or inside a verify forward. Verifying a drafted
token is therefore a comparison, exactly as in greedy decoding, and a seeded speculative run reproduces the seeded
plain run token for token, for any draft source and depth.

Every redraft drafter proposes point masses (a token, not a distribution). For a point-mass draft x, accepting
iff the sampled token equals x accepts with probability p(x) and otherwise yields a sample of p conditioned on
"not x": exactly the distribution of the speculative-sampling rule of Leviathan et al. 2023 (accept with
min(1, p/q), resample from norm(max(0, p - q))) when q is one-hot, with a coupling that also keeps the seed.

Logits processors are transformers' own classes, built by :class:`redraft.decoding.genconfig.LogitsShaping` from the model's
generation_config and the explicit settings here (repetition penalty after CTRL, Keskar et al. 2019; no-repeat
n-grams; minimum new tokens; ...), applied per row with that row's own context: a tree node's row sees the
committed tokens plus the node's ancestors and itself. top-k and top-p follow HF's ``TopKLogitsWarper`` and
``TopPLogitsWarper``.

Extreme values stay valid distributions: scores are float64 and shifted so that each row's best is 0 before the
division by the temperature, so ``(l - max) / T`` lies in [-inf, 0] for every T > 0 (a vanishing temperature
leaves the best tokens at 0 and the rest at -inf: greedy; a huge one flattens towards uniform), and the repetition
penalty is held within ``genconfig.PENALTY_MIN .. PENALTY_MAX``, where float32 logits stay finite in float64.
Non-finite logits from the model raise NonFiniteLogitsError instead of turning into token 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from redraft.decoding.genconfig import LogitsShaping


class NonFiniteLogitsError(RuntimeError):
    """The target model returned NaN or +inf logits, or a row whose logits are all -inf: no token can be chosen."""


@dataclass(frozen=True)
class SamplingParams:
    """How each token is chosen. Every accepted value gives a valid distribution; others raise ValueError.

    Attributes:
        temperature: 0 = greedy (argmax); > 0 (finite) = sample from softmax(logits / temperature). Any positive
            value works: a vanishing one (1e-300, a subnormal) chooses the argmax, a huge one is near uniform.
        top_k: keep only the k most likely tokens (integer >= 0; 0 = off, >= vocabulary = off). Sampling only.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1] (1.0 = off); a tiny
            value keeps the most likely token. Sampling only.
        seed: integer key of the per-position noise; the same seed gives the same output at any draft depth.
        repetition_penalty: HF/CTRL penalty on tokens already in the context (finite > 0; 1.0 = off); also applies
            to greedy. Values beyond [1e-250, 1e250] act as those bounds: seen tokens already rank first (or last)
            there, and the bounds keep every penalised float32 logit finite.
        no_repeat_ngram_size: n > 0 forbids repeating any n-gram of the context (0 = off); also applies to greedy.
        min_new_tokens: the EOS ids are forbidden before this many new tokens (0 = off); also applies to greedy.
        constraint: a grammar the output must follow (:class:`redraft.grammar.Constraint`: JSON schema, tool call),
            or None. Anything with ``start(prompt_length)`` returning a logits processor that also has
            ``commit(tokens)`` works; every verify row is masked with its own tree node's grammar state.

    The last three shape the logits the way the model's generation_config does (see :mod:`redraft.decoding.genconfig`):
    None (the default) takes the model's value, off when it has none; a value, even the "off" one, replaces it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float | None = None
    seed: int = 0
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    constraint: object | None = None

    def __post_init__(self):
        if not _number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if self.repetition_penalty is not None and not (
                _number(self.repetition_penalty)
                and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        if not _integer(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            v = getattr(self, name)
            if v is not None and (not _integer(v) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 (0 = off), got {v!r}")
        if self.constraint is not None and not callable(getattr(self.constraint, "start", None)):
            raise ValueError(f"constraint must have a start(prompt_length) method (e.g. redraft.grammar.Constraint), "
                             f"got {type(self.constraint).__name__}")

    def shaping(self, base: LogitsShaping | None = None) -> LogitsShaping:
        """``base`` (the model's generation_config settings; None = none) with the values set here replacing it."""
        return (base or LogitsShaping()).overridden(repetition_penalty=self.repetition_penalty,
                                                    no_repeat_ngram_size=self.no_repeat_ngram_size,
                                                    min_new_tokens=self.min_new_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


GREEDY = SamplingParams()


def gumbel_noise(seed: int, positions: list[int], vocab: int) -> torch.Tensor:
    """Standard Gumbel noise for each absolute position, independent of how positions are batched.

    Returns:
        DoubleTensor [len(positions), vocab] (float64, finite), row i a pure function of (seed, positions[i]).
    """
    out = np.empty((len(positions), vocab), dtype=np.float64)
    for i, pos in enumerate(positions):
        # (seed, position) is the Philox *key*: consecutive counters would give overlapping, shifted streams
        key = np.array([int(seed) & (2**64 - 1), int(pos)], dtype=np.uint64)
        gen = np.random.Generator(np.random.Philox(key=key))
        u = gen.random(vocab)
        np.log(np.maximum(u, 1e-300), out=out[i])
        np.negative(out[i], out=out[i])
        np.log(out[i], out=out[i])
        np.negative(out[i], out=out[i])
    return torch.from_numpy(out)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cum = sorted_scores.softmax(-1).cumsum(-1)
    drop_sorted = cum <= (1 - p)
    drop_sorted[..., -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


class TokenChooser:
    """Chooses the next token for a batch of verify rows and reports how close each choice was.

    Args:
        params: :class:`SamplingParams`.
        vocab: vocabulary size V.
        shaping: the model's logits-shaping settings (:meth:`LogitsShaping.of` its generation_config; None = none);
            ``params``' own values replace them.
        eos_token_ids: ids that end the generation (minimum lengths forbid them; HF's EOS-based processors).
        max_new_tokens: the token budget (a forced EOS goes on its last token); None = no forced EOS.
    """

    def __init__(self, params: SamplingParams, vocab: int, shaping: LogitsShaping | None = None, *,
                 eos_token_ids=(), max_new_tokens: int | None = None) -> None:
        self.params = params
        self.vocab = vocab
        self.shaping = params.shaping(shaping)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.processors: list = []  # transformers LogitsProcessorList of this generation; empty = none (cheap path)
        self.context: list[int] = []  # committed ids (prompt + output), kept only when processors need them
        self.grammar = None  # the generation's grammar state (params.constraint), one of the processors
        # False: greedy rows without processors skip the runner-up pass and :meth:`choose` returns margins None
        # (plain greedy on a batch-invariant runtime reads no gaps: one pass over each row's logits, not two)
        self.margins = True

    def reset(self, prompt: list[int]) -> None:
        """Start a generation: build its processors (they depend on the prompt length) and its context."""
        self.processors = self.shaping.processors(len(prompt), self.max_new_tokens, self.eos_token_ids)
        self.grammar = None
        if self.params.constraint is not None:
            # last: its -inf mask survives every other processor, and top-k / top-p then see only allowed tokens
            self.grammar = self.params.constraint.start(len(prompt))
            self.processors.append(self.grammar)
        self.context = []
        self.commit(prompt, prompt=True)

    def commit(self, tokens: list[int], *, prompt: bool = False) -> None:
        """Add newly committed tokens to the context the logits processors see (and advance the grammar state
        past output tokens; ``prompt``: these are the prompt's, which the grammar does not constrain)."""
        if self.processors:
            self.context.extend(int(t) for t in tokens)
        if self.grammar is not None and not prompt:
            self.grammar.commit(tokens)

    def choose(self, logits: torch.Tensor, positions: list[int],
               row_extra: list[list[int]] | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Pick one token per row.

        Args:
            logits: FloatTensor [R, V], the target's logits of R rows.
            positions: absolute position (0-based index in prompt + output) of the token each row chooses, [R].
            row_extra: per row, tokens beyond the committed context that the row sees (a tree node's ancestors and
                itself); only read when there are logits processors (``self.processors``), None = none for any row.
        Returns:
            (choices, margins): R token ids, and DoubleTensor [R] the gap between the best and second-best final
            score of each row (in logit units, inf when only one token is possible; a tiny gap means numerical
            noise could flip the choice); margins is None for greedy rows without processors when ``margins`` is
            False.
        Raises:
            NonFiniteLogitsError: a row holds NaN or +inf, or only -inf (see check_finite).
        """
        p = self.params
        if p.greedy and not self.processors:
            return _greedy_choices(logits, positions, self.margins)
        # float64 where the penalty or 1 / temperature could overflow float32; plain greedy keeps the model's values
        scores = logits.double() if self.processors or not p.greedy else logits.float()
        if self.processors:
            scores = self._shape(scores, row_extra)
        if not p.greedy:
            best = scores.max(-1, keepdim=True).values  # NaN if a row has one, +inf if it has one (cheap check)
            if not bool(torch.isfinite(best).all()):
                check_finite(logits, positions)
            # Shifted so each row's best is 0: (l - max) / T is in [-inf, 0] for any T > 0, never NaN or +inf.
            # top-k ranks before the division, where a huge T cannot round distinct scores to the same value.
            scores = _top_k(scores - best, p.top_k) / p.temperature
            scores = _top_p(scores, p.top_p)
            scores = scores + gumbel_noise(p.seed, positions, scores.shape[-1])
        top = torch.topk(scores, 2, dim=-1)  # topk ranks NaN first: a non-finite row shows in top2[:, 0]
        top2 = top.values
        if p.greedy and not bool(torch.isfinite(top2[:, 0]).all()):
            check_finite(logits, positions)
        margins = top2[:, 0] - top2[:, 1]
        # a row with a unique best holds it first in topk; a tie takes argmax's first best index (one more pass
        # over those rows only)
        choices = top.indices[:, 0].clone()
        tied = ~(margins > 0)
        if bool(tied.any()):
            choices[tied] = scores[tied].argmax(-1)
        if not p.greedy:
            margins = margins * p.temperature  # back to logit units, comparable with the verify noise
        return choices.tolist(), margins

    def _shape(self, scores: torch.Tensor, row_extra: list[list[int]] | None) -> torch.Tensor:
        """Apply the processors to each row with its own context. HF's processors take one context length per call
        (input_ids [R, L]), so rows are grouped by how many tokens they see beyond the committed context (a tree
        node's depth): one call per depth."""
        extra = row_extra if row_extra is not None else [[]] * scores.shape[0]
        committed = torch.tensor(self.context, dtype=torch.long)
        groups: dict[int, list[int]] = {}
        for r, e in enumerate(extra):
            groups.setdefault(len(e), []).append(r)
        if len(groups) == 1 and not extra[0]:
            return self.processors(committed.unsqueeze(0).expand(scores.shape[0], -1), scores)
        out = torch.empty_like(scores)
        for depth, rows in groups.items():
            ids = committed.unsqueeze(0).expand(len(rows), -1)
            if depth:
                ids = torch.cat([ids, torch.tensor([extra[r] for r in rows], dtype=torch.long)], dim=1)
            out[rows] = self.processors(ids, scores[rows])
        return out


def _greedy_choices(logits: torch.Tensor, positions: list[int], margins: bool = True
                    ) -> tuple[list[int], torch.Tensor | None]:
    """Plain greedy choice without logits processors: each row's first best index and its gap to the runner-up,
    in numpy (two max passes per row; torch's topk costs several times more per step on a CPU, where a llama.cpp
    step is ~10 ms). Same results as the general path: a tie picks the first best index with margin 0.

    Args:
        logits: FloatTensor [R, V]; positions: [R], for the error message; margins: False skips the runner-up pass.
    Returns:
        (choices, margins FloatTensor [R] float32, or None without ``margins``).
    Raises:
        NonFiniteLogitsError: a row holds NaN or +inf, or only -inf (see check_finite).
    """
    # shares float32 logits' memory: the one write below is undone
    a = logits.numpy() if logits.dtype == torch.float32 and not logits.requires_grad else logits.detach().float().numpy()
    if a.shape[0] == 1 and not margins:  # plain decoding's step: Python scalars, fewest calls right after a forward
        k = int(a[0].argmax())
        if not math.isfinite(float(a[0, k])):
            check_finite(logits, positions)
        return [k], None
    rows = np.arange(a.shape[0])
    choices = a.argmax(-1)  # numpy's argmax returns a NaN's index first: the finite check below sees it
    best = a[rows, choices]
    if not bool(np.isfinite(best).all()):
        check_finite(logits, positions)
    if not margins:
        return choices.tolist(), None
    held = best.copy()
    a[rows, choices] = -np.inf  # the runner-up: the max with the best masked, then the row restored
    second = a.max(-1)
    a[rows, choices] = held
    return choices.tolist(), torch.from_numpy(best - second)


def check_finite(logits: torch.Tensor, positions: list[int]) -> None:
    """Raise NonFiniteLogitsError unless every row of logits [R, V] holds only finite values and -inf (a masked
    token), with at least one finite value. positions [R]: absolute position each row chooses, for the message.
    One full pass over the logits; TokenChooser.choose calls it only when a row's best value is not finite."""
    if bool(torch.isfinite(logits).all()):
        return
    nan = torch.isnan(logits).any(-1)
    pos_inf = torch.isposinf(logits).any(-1)
    empty = ~(logits > float("-inf")).any(-1)
    bad = nan | pos_inf | empty
    if not bool(bad.any()):
        return  # only some -inf entries: masked tokens, a valid distribution
    r = int(bad.nonzero()[0])
    what = "NaN" if nan[r] else "+inf" if pos_inf[r] else "only -inf"
    raise NonFiniteLogitsError(
        f"the target model returned {what} logits for the token at position {positions[r]} (verify row {r} of "
        f"{logits.shape[0]}): no token can be chosen; the model's weights or dtype overflowed")
