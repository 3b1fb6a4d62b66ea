"""What a packed step's rows cost, for sizing prefill chunks: a row's matrix products plus its attention over the
keys it sees, with the per-key weight first taken from the model's sizes and then learned from the steps' times.

A row after L cached keys costs ~ 1 + w L units of a row's matrix products (w: :func:`key_weight`), so a chunk of r
rows after L cached tokens costs r (1 + w (L + r / 2)) (:func:`row_cost`: each row also attends, causally, to half
the chunk's rows). The step batcher gives a step the cost of ``max_batch_tokens`` rows at depth 0 and sizes the chunk
of a waiting prompt to what is left of it (:func:`rows_within`), so a long prompt's chunks shrink as its cache grows
and every step over it costs about what the first one did: running streams wait at most one chunk's forward.

The FLOP count behind :func:`key_weight` undercounts attention on a CPU, whose attention kernels run below the
matrix products' FLOP rate, so :class:`StepCostFit` learns the weight from the batcher's own steps:
seconds = u R + v K + p (P - 1) over the steps that carried a chunk (R rows, K = sum of r (L + r / 2), P
participants), w = v / u, within ``FIT_BOUNDS`` of the count's value; p / u is what each participant beyond the
first adds in rows (its attention calls and cache appends), which the batcher takes off a chunk's budget. The step's
fixed cost (reading the weights once) is left out of the fit: beside a chunk's time it would only add a third
unknown to fit from a handful of noisy steps.

Measurements: docs/measurements.md#redraft-pricing-stepcost
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

FIT_MIN_ROWS = 32  # a step enters the fit when one participant brings at least this many rows (a chunk)
FIT_WINDOW = 64  # the most recent such steps kept
FIT_MIN_STEPS = 6  # fitted only from this many steps on
FIT_MIN_SPREAD = 256.0  # ... whose mean depths (K / R) span at least this many tokens
FIT_BOUNDS = (0.5, 4.0)  # the learned weight stays within these multiples of the FLOP count's
FIT_MAX_PARTICIPANT_ROWS = 32.0  # the most a participant's overhead is taken to cost, in rows


def key_weight(model) -> float:
    """What attending to one cached key costs a row, in units of the row's matrix products: 2 x layers x heads x
    head dim / the non-embedding parameters (a row's matrix products take ~2 FLOPs per parameter, its attention
    4 x heads x head dim FLOPs per key and layer, for the scores and the weighted values: the per-token forward FLOP
    count of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1, which counts the scores only,
    plus the values). 3.3e-4 for SmolLM2-135M. 0 when the config lacks the sizes."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    layers, heads = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not (layers and heads and hidden):
        return 0.0
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings()
    params -= embed.weight.numel() if embed is not None else 0
    return 2.0 * layers * heads * head_dim / params if params > 0 else 0.0


def row_cost(weight: float, depth: int, rows: int) -> float:
    """r (1 + w (L + r / 2)): a forward of ``rows`` rows after ``depth`` cached tokens, in units of one row's matrix
    products at depth 0.

    Args:
        weight: w, a cached key's cost per row (:func:`key_weight`, or learned by :class:`StepCostFit`).
        depth: L, tokens cached before the rows.
        rows: r, rows in the forward (each attends causally to the ones before it).
    Returns:
        the cost in rows' matrix products (float, >= rows).
    """
    return rows * (1.0 + weight * (depth + rows / 2.0))


def rows_within(weight: float, depth: int, cost: float) -> int:
    """The most rows r >= 0 whose :func:`row_cost` after ``depth`` cached tokens stays within ``cost`` units.

    Args:
        weight: w, a cached key's cost per row (>= 0).
        depth: L, tokens cached before the rows.
        cost: the units to spend (<= 0: nothing fits).
    Returns:
        r (int >= 0).
    """
    if cost <= 0:
        return 0
    a, b = weight / 2, 1.0 + weight * depth  # solve a r^2 + b r = cost for r
    r = int(cost / b) if a * cost < 1e-9 * b else int((-b + (b * b + 4 * a * cost) ** 0.5) / (2 * a))
    while row_cost(weight, depth, r + 1) <= cost * (1 + 1e-12):
        r += 1
    while r > 0 and row_cost(weight, depth, r) > cost * (1 + 1e-12):
        r -= 1
    return r


class StepCostFit:
    """The per-key weight w, and what each participant beyond the first adds to a step, learned from timed steps
    (module docstring), starting from ``prior`` and nothing.

    Args:
        prior: w from the FLOP count (:func:`key_weight`); 0 keeps w at 0 (nothing is learned).
    Attributes:
        weight: the weight to price rows with now: ``prior`` until enough chunk-carrying steps were seen, then the
            fitted value, clipped to ``FIT_BOUNDS`` times ``prior``.
        participant_rows: what one more sequence in a step costs beyond its rows' own price, in rows at depth 0
            (its attention calls, its cache appends, its logits): 0 until steps with one and with several
            participants were seen, then fitted, within 0..``FIT_MAX_PARTICIPANT_ROWS``.
        fitted: whether ``weight`` comes from the fit.
    """

    def __init__(self, prior: float) -> None:
        self.prior = float(prior)
        self.weight = self.prior
        self.participant_rows = 0.0
        self.fitted = False
        self._steps: deque[tuple[float, float, float, float]] = deque(maxlen=FIT_WINDOW)

    def observe(self, parts: Sequence[tuple[int, int]], seconds: float) -> None:
        """Take one step's time into the fit.

        Args:
            parts: per participant, (tokens cached before the step, rows it brought).
            seconds: the step's forward, wall seconds.
        """
        if self.prior <= 0 or not parts or max(r for _, r in parts) < FIT_MIN_ROWS or seconds <= 0:
            return
        rows = float(sum(r for _, r in parts))
        keys = float(sum(r * (d + r / 2.0) for d, r in parts))
        self._steps.append((rows, keys, float(len(parts) - 1), float(seconds)))
        self._refit()

    def _refit(self) -> None:
        if len(self._steps) < FIT_MIN_STEPS:
            return
        obs = np.array(self._steps, dtype=np.float64)
        depth = obs[:, 1] / obs[:, 0]
        if depth.max() - depth.min() < FIT_MIN_SPREAD:
            return
        scale = 1e-3  # K is ~1e3 x R: scaled for the least squares' conditioning
        others = obs[:, 2].max() > obs[:, 2].min()  # participants vary: their overhead can be told apart
        cols = [obs[:, 0], obs[:, 1] * scale] + ([obs[:, 2]] if others else [])
        coef, *_ = np.linalg.lstsq(np.column_stack(cols), obs[:, 3], rcond=None)
        u, v = coef[0], coef[1]
        if not (u > 0 and np.all(np.isfinite(coef))):
            return
        lo, hi = FIT_BOUNDS
        self.weight = float(np.clip(v * scale / u, lo * self.prior, hi * self.prior))
        self.participant_rows = float(np.clip(coef[2] / u, 0.0, FIT_MAX_PARTICIPANT_ROWS)) if others else 0.0
        self.fitted = True
