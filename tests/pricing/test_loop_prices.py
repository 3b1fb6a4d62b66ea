"""Prices learned from the loop's own steps: :class:`redraft.pricing.loop.LoopPrices`, the policy's table it rescales,
and the draft planner's timing of each step (a fake clock)."""

from __future__ import annotations

import numpy as np
import pytest

from redraft.decoding.planner import DraftLimits, DraftPlanner
from redraft.policy import SpeculationPolicy
from redraft.pricing import CostCurve
from redraft.pricing.loop import MIN_PLAIN, MIN_SAMPLES, REFIT_EVERY, SCALE_BOUNDS, LoopPrices

CURVE = CostCurve((0, 1, 2, 4, 8, 16, 64), (1.0, 1.83, 1.93, 2.17, 2.94, 4.57, 14.0))
T1 = 0.005  # seconds of a plain step


def loop_steps(prices: LoopPrices, scale: float, extra: float, sizes=(2, 4, 4, 8, 4, 16), plain: int = 12) -> None:
    """Plain steps, then draft steps of ``sizes`` each followed by a plain step, timed as a loop whose draft part
    costs ``scale`` times the curve's, ``extra`` of it paid by the plain step after the draft."""
    for _ in range(plain):
        prices.observe(0, T1)
    for n in sizes:
        prices.observe(n, T1 * (1 + scale * (prices.table[n] - 1)) - extra)
        prices.observe(0, T1 + extra)


@pytest.mark.parametrize("scale,extra", [(1.5, 0.0), (1.5, 0.001), (1.25, 0.0005), (2.0, 0.002)])
def test_the_scale_is_what_the_steps_say(scale, extra):
    prices = LoopPrices(CURVE.table(64))
    loop_steps(prices, scale, extra)
    assert prices.scale == pytest.approx(scale, abs=1 / 16)
    table = prices.prices()
    assert table[0] == 1.0
    assert table[4] == pytest.approx(1 + prices.scale * (CURVE.table(64)[4] - 1))
    assert np.all(np.diff(table) >= 0)


@pytest.mark.parametrize("offset,scale", [(0.125, 1.25), (0.0, 1.5), (0.25, 1.0)])
def test_a_fixed_part_per_draft_step_and_a_scale_are_told_apart(offset, scale):
    """Steps that cost what the loop measured on llama.cpp (a fixed ~0.1 steps per draft step and the curve's part
    +25%): both come back, so a deep draft is not priced at a shallow one's ratio."""
    prices = LoopPrices(CURVE.table(64))
    for _ in range(MIN_PLAIN + 1):
        prices.observe(0, T1)
    for n in (2, 4, 4, 8, 16, 4, 2, 8, 16, 4):
        prices.observe(n, T1 * (1 + offset + scale * (prices.table[n] - 1)))
        prices.observe(0, T1)
    assert prices.offset == pytest.approx(offset, abs=1 / 32)
    assert prices.scale == pytest.approx(scale, abs=1 / 32)
    table = prices.prices()
    assert table[0] == 1.0 and table[16] == pytest.approx(1 + prices.offset + prices.scale * (CURVE.cost(16) - 1))


def test_nothing_moves_before_enough_steps():
    prices = LoopPrices(CURVE.table(64))
    for _ in range(MIN_PLAIN - 1):
        prices.observe(0, T1)
    for _ in range(MIN_SAMPLES + 2):
        assert not prices.observe(4, 10 * T1)
    assert prices.scale == 1.0  # no T1 yet
    prices = LoopPrices(CURVE.table(64))
    loop_steps(prices, 2.0, 0.0, sizes=(4,) * (MIN_SAMPLES - 1))
    assert prices.scale == 1.0  # too few draft steps


def test_steps_that_follow_no_timed_step_do_not_set_the_plain_price():
    prices = LoopPrices(CURVE.table(64))
    for _ in range(3 * MIN_PLAIN):
        prices.observe(0, T1, follows=False)  # e.g. the step after each prompt: llama.cpp builds its graph again
    for _ in range(3 * MIN_SAMPLES):
        prices.observe(4, 10 * T1)
    assert prices.scale == 1.0


def test_the_scale_stays_within_its_bounds_and_bad_times_are_ignored():
    prices = LoopPrices(CURVE.table(64))
    loop_steps(prices, 0.6, 0.0)  # steps faster than the bare forwards: noise, never a cheaper draft
    assert prices.scale == SCALE_BOUNDS[0] == 1.0 and prices.offset == 0.0
    prices = LoopPrices(CURVE.table(64))
    loop_steps(prices, 50.0, 0.0)
    assert prices.scale == SCALE_BOUNDS[1]
    before = prices.scale
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert not prices.observe(4, bad)
    assert not prices.observe(65, T1)  # past the table
    assert prices.scale == before


def test_the_policy_plans_on_the_learned_table():
    policy = SpeculationPolicy(CURVE, max_nodes=64, learn_prices=True)
    bare = policy.costs.copy()
    for _ in range(MIN_PLAIN + 1):  # the first has no step before it
        policy.observe_step(0, T1)
    for _ in range(MIN_SAMPLES):
        policy.observe_step(4, T1 * (1 + 2.0 * (bare[4] - 1)))
    assert policy.loop is not None and policy.loop.scale == 2.0
    assert policy.costs[4] == pytest.approx(1 + 2.0 * (bare[4] - 1))
    # a chain whose first tokens are right 70% of the time pays on the bare curve and not at twice its draft part
    parents, sources = list(range(-1, 7)), ["ngram"] * 8
    fixed = SpeculationPolicy(CURVE, max_nodes=64)
    for p in (policy, fixed):
        for _ in range(40):
            p.observe("ngram", 4, 3)
            p.observe("ngram", 4, 1)
    assert fixed.plan(parents, sources).nodes and not policy.plan(parents, sources).nodes
    # without learn_prices the steps change nothing
    for _ in range(MIN_PLAIN):
        fixed.observe_step(0, T1)
    for _ in range(MIN_SAMPLES):
        fixed.observe_step(4, 10 * T1)
    assert fixed.loop is None and np.array_equal(fixed.costs, bare)


class Recording(SpeculationPolicy):
    def __init__(self) -> None:
        super().__init__(CURVE, max_nodes=8, learn_prices=True)
        self.steps: list[tuple[int, float, bool]] = []

    def observe_step(self, draft: int, seconds: float, *, follows: bool = True) -> None:
        self.steps.append((draft, seconds, follows))


def test_the_planner_times_each_step_from_plan_to_plan():
    now = [0.0]
    policy = Recording()
    planner = DraftPlanner([], policy, clock=lambda: now[0])
    context = np.arange(10)

    def step(fed: int, seconds: float, forwards: int = 1, carried: int = 1) -> None:
        draft = planner.propose(context, DraftLimits(4, fed=fed, carried=carried))
        for _ in range(forwards):
            planner.observe(draft, [], 1)
        now[0] += seconds

    planner.begin()
    step(9, 0.050)  # the prompt's forward: not timed
    step(1, 0.007)  # the step after it: timed, following no timed step
    step(1, 0.005)
    step(1, 0.020, forwards=3)  # exact mode's settling forwards: not timed
    step(1, 0.005)
    step(1, 0.006, carried=3)  # shared with other sequences: not timed
    step(1, 0.005)
    planner.begin()  # a new sequence: the gap before it belongs to no step
    now[0] += 1.0
    step(5, 0.030)
    step(1, 0.005)
    planner.propose(context, DraftLimits(4))
    assert [(d, round(s, 6), f) for d, s, f in policy.steps] == [
        (0, 0.007, False), (0, 0.005, True), (0, 0.005, False), (0, 0.005, False)]


def test_once_priced_the_steps_are_fitted_every_few():
    """After the first prices, a fit comes every REFIT_EVERY draft steps and steps after one: the loop's draft
    steps now cost three times the curve's draft part, and the prices move only at the fit."""
    prices = LoopPrices(CURVE.table(64))
    loop_steps(prices, 1.5, 0.0, sizes=(4,) * MIN_SAMPLES)
    assert prices.scale == 1.5
    changed = [prices.observe(4, T1 * (1 + 3.0 * (prices.table[4] - 1))) for _ in range(4 * REFIT_EVERY)]
    assert changed.index(True) % REFIT_EVERY == REFIT_EVERY - 1  # on a fit, not before
    assert prices.scale > 1.5
