"""Pricing a packed step's rows: rows_within inverts row_cost, and StepCostFit learns the per-key weight from
step times that follow the cost model (and keeps the FLOP count's until the steps say enough)."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from redraft.pricing.stepcost import (
    FIT_BOUNDS,
    FIT_MIN_STEPS,
    StepCostFit,
    row_cost,
    rows_within,
)


@given(st.floats(0.0, 1e-2), st.integers(0, 20000), st.floats(0.0, 5000.0))
def test_rows_within_is_the_most_rows_the_cost_pays_for(w, depth, cost):
    r = rows_within(w, depth, cost)
    assert r >= 0
    assert r == 0 or row_cost(w, depth, r) <= cost * (1 + 1e-9)
    assert row_cost(w, depth, r + 1) > cost * (1 - 1e-9)


def _steps(w_true, n, rng, u=0.003, extra_rows=0.0):
    """(parts, seconds) of steps carrying a chunk at a random depth beside 0-4 decode rows; each participant beyond
    the first costs ``extra_rows`` rows more."""
    out = []
    for _ in range(n):
        depth, rows = rng.randrange(0, 4000), rng.randrange(64, 512)
        parts = [(depth, rows)] + [(rng.randrange(100, 900), 1) for _ in range(rng.randrange(0, 5))]
        keys = sum(r * (d + r / 2) for d, r in parts)
        out.append((parts, u * (sum(r for _, r in parts) + w_true * keys + extra_rows * (len(parts) - 1))))
    return out


def test_the_fit_learns_the_weight_the_steps_follow():
    prior, true = 3.3e-4, 4.2e-4
    fit = StepCostFit(prior)
    rng = random.Random(0)
    steps = _steps(true, 20, rng)
    for parts, secs in steps[:FIT_MIN_STEPS - 1]:
        fit.observe(parts, secs)
    assert not fit.fitted and fit.weight == prior  # too few steps: the FLOP count's
    for parts, secs in steps[FIT_MIN_STEPS - 1:]:
        fit.observe(parts, secs * rng.uniform(0.98, 1.02))  # 2% timing noise
    assert fit.fitted and fit.weight == pytest.approx(true, rel=0.1)


def test_the_fit_learns_what_a_participant_adds():
    fit = StepCostFit(3.3e-4)
    rng = random.Random(2)
    for parts, secs in _steps(4.2e-4, 40, rng, extra_rows=6.0):
        fit.observe(parts, secs * rng.uniform(0.995, 1.005))
    assert fit.participant_rows == pytest.approx(6.0, abs=2.0)
    alone = StepCostFit(3.3e-4)  # every step one participant: nothing to tell the overhead from
    for parts, secs in _steps(4.2e-4, 20, rng):
        alone.observe(parts[:1], secs)
    assert alone.fitted and alone.participant_rows == 0.0


def test_the_fit_ignores_decode_steps_and_stays_within_bounds():
    fit = StepCostFit(3.3e-4)
    for d in range(0, 4000, 100):
        fit.observe([(d, 1), (d + 5, 3)], 0.05)  # no chunk: not taken in
    assert not fit.fitted
    rng = random.Random(1)
    for parts, secs in _steps(1e-2, 12, rng):  # steps far dearer per key than any bound allows
        fit.observe(parts, secs)
    assert fit.fitted and fit.weight == pytest.approx(FIT_BOUNDS[1] * 3.3e-4)
    nothing = StepCostFit(0.0)  # no prior (a config without sizes): stays 0
    for parts, secs in _steps(4e-4, 12, rng):
        nothing.observe(parts, secs)
    assert nothing.weight == 0.0 and not nothing.fitted


def test_steps_all_at_one_depth_do_not_fit():
    fit = StepCostFit(3.3e-4)
    for _ in range(20):
        fit.observe([(1000, 256)], 1.0)
    assert not fit.fitted
