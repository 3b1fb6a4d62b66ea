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

Logits processors follow Hugging Face's definitions (``RepetitionPenaltyLogitsProcessor`` after CTRL, Keskar et
al. 2019; ``TopKLogitsWarper``; ``TopPLogitsWarper``), applied per row with that row's own context: a tree node's
repetition penalty sees the committed tokens plus the node's ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How each token is chosen.

    Attributes:
        temperature: 0 = greedy (argmax); > 0 = sample from softmax(logits / temperature).
        top_k: keep only the k most likely tokens (0 = off). Sampling only.
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off). Sampling only.
        repetition_penalty: HF/CTRL penalty on tokens already in the context (1.0 = off); also applies to greedy.
        seed: key of the per-position noise; the same seed gives the same output at any draft depth.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def gumbel_noise(seed: int, positions: list[int], vocab: int) -> torch.Tensor:
    """Standard Gumbel noise for each absolute position, independent of how positions are batched.

    Returns:
        FloatTensor [len(positions), vocab] (float32), row i a pure function of (seed, positions[i]).
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
    return torch.from_numpy(out).to(torch.float32)


def _repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    # HF convention: positive logits are divided by the penalty, negative ones multiplied.
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


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
    """

    def __init__(self, params: SamplingParams, vocab: int) -> None:
        self.params = params
        self.vocab = vocab
        self.seen = torch.zeros(vocab, dtype=torch.bool)  # tokens of the committed context (repetition penalty)

    def reset(self, prompt: list[int]) -> None:
        self.seen.zero_()
        self.commit(prompt)

    def commit(self, tokens: list[int]) -> None:
        """Add newly committed tokens to the context the repetition penalty sees."""
        if self.params.repetition_penalty != 1.0 and tokens:
            self.seen[torch.tensor(tokens, dtype=torch.long)] = True

    def choose(self, logits: torch.Tensor, positions: list[int],
               row_extra: list[list[int]] | None = None) -> tuple[list[int], torch.Tensor]:
        """Pick one token per row.

        Args:
            logits: FloatTensor [R, V], the target's logits of R rows.
            positions: absolute position (0-based index in prompt + output) of the token each row chooses, [R].
            row_extra: per row, tokens beyond the committed context that the row sees (a tree node's ancestors and
                itself); only used by the repetition penalty.
        Returns:
            (choices, margins): R token ids, and FloatTensor [R] the gap between the best and second-best final
            score of each row (in logit units; a tiny gap means numerical noise could flip the choice).
        """
        p = self.params
        scores = logits.float()
        if p.repetition_penalty != 1.0:
            seen = self.seen.expand(scores.shape[0], -1).clone()
            for r, extra in enumerate(row_extra or []):
                if extra:
                    seen[r, torch.tensor(extra, dtype=torch.long)] = True
            scores = _repetition_penalty(scores, seen, p.repetition_penalty)
        if not p.greedy:
            scores = _top_p(_top_k(scores / p.temperature, p.top_k), p.top_p)
            scores = scores + gumbel_noise(p.seed, positions, scores.shape[-1])
        top2 = torch.topk(scores, 2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        if not p.greedy:
            margins = margins * p.temperature  # back to logit units, comparable with the verify noise
        return scores.argmax(-1).tolist(), margins
