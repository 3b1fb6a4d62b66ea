"""Pricing a packed step's rows: rows_within inverts row_cost, and KeyWeightFit learns the per-key weight from
step times that follow the cost model (and keeps the FLOP count's until the steps say enough)."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from redraft.decoding.stepcost import (
    FIT_BOUNDS,
    FIT_MIN_STEPS,
    KeyWeightFit,
    row_cost,
    rows_within,
)


@given(st.floats(0.0, 1e-2), st.integers(0, 20000), st.floats(0.0, 5000.0))
def test_rows_within_is_the_most_rows_the_cost_pays_for(w, depth, cost):
    r = rows_within(w, depth, cost)
    assert r >= 0
    assert r == 0 or row_cost(w, depth, r) <= cost * (1 + 1e-9)
    assert row_cost(w, depth, r + 1) > cost * (1 - 1e-9)


def _steps(w_true, n, rng, a=0.04, u=0.003):
    """(parts, seconds) of steps carrying a chunk at a random depth beside a few decode rows."""
    out = []
    for _ in range(n):
        depth, rows = rng.randrange(0, 4000), rng.randrange(64, 512)
        parts = [(depth, rows)] + [(rng.randrange(100, 900), 1) for _ in range(4)]
        keys = sum(r * (d + r / 2) for d, r in parts)
        out.append((parts, a + u * sum(r for _, r in parts) + u * w_true * keys))
    return out


def test_the_fit_learns_the_weight_the_steps_follow():
    prior, true = 3.3e-4, 4.2e-4
    fit = KeyWeightFit(prior)
    rng = random.Random(0)
    steps = _steps(true, 20, rng)
    for parts, secs in steps[:FIT_MIN_STEPS - 1]:
        fit.observe(parts, secs)
    assert not fit.fitted and fit.weight == prior  # too few steps: the FLOP count's
    for parts, secs in steps[FIT_MIN_STEPS - 1:]:
        fit.observe(parts, secs * rng.uniform(0.98, 1.02))  # 2% timing noise
    assert fit.fitted and fit.weight == pytest.approx(true, rel=0.1)


def test_the_fit_ignores_decode_steps_and_stays_within_bounds():
    fit = KeyWeightFit(3.3e-4)
    for d in range(0, 4000, 100):
        fit.observe([(d, 1), (d + 5, 3)], 0.05)  # no chunk: not taken in
    assert not fit.fitted
    rng = random.Random(1)
    for parts, secs in _steps(1e-2, 12, rng):  # steps far dearer per key than any bound allows
        fit.observe(parts, secs)
    assert fit.fitted and fit.weight == pytest.approx(FIT_BOUNDS[1] * 3.3e-4)
    nothing = KeyWeightFit(0.0)  # no prior (a config without sizes): stays 0
    for parts, secs in _steps(4e-4, 12, rng):
        nothing.observe(parts, secs)
    assert nothing.weight == 0.0 and not nothing.fitted


def test_steps_all_at_one_depth_do_not_fit():
    fit = KeyWeightFit(3.3e-4)
    for _ in range(20):
        fit.observe([(1000, 256)], 1.0)
    assert not fit.fitted
