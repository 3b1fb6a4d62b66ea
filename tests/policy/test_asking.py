"""Asking a drafter costs time: :class:`redraft.policy.asking.AskBudget` and the draft planner's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from redraft.decoding.planner import DraftLimits, DraftPlanner
from redraft.policy import SpeculationPolicy
from redraft.policy.asking import AskBudget
from redraft.pricing import CostCurve
from redraft.pricing.loop import MIN_PLAIN
from redraft.tree import TokenTree

STEEP = CostCurve((0, 1, 2, 4, 8, 16, 64), (1.0, 1.83, 1.93, 2.17, 2.94, 4.57, 14.0))


def test_a_fruitful_drafter_is_asked_every_step():
    asks = AskBudget(overhead=0.01, fruitless=3)
    asks.timed(0.0005, 0.005)  # asking costs 10% of a step
    for _ in range(20):
        assert asks.ask(0)
        asks.outcome(0, True)


@pytest.mark.parametrize("share,interval", [(0.10, 10), (0.03, 3), (0.005, 1)])
def test_a_fruitless_drafter_is_asked_within_the_budget(share, interval):
    asks = AskBudget(overhead=0.01, fruitless=3)
    asks.timed(share * 0.005, 0.005)
    assert asks.interval() == interval
    for _ in range(3):
        assert asks.ask(0)
        asks.outcome(0, False)
    pattern = []
    for _ in range(4 * interval):
        pattern.append(asks.ask(0))
        if pattern[-1]:
            asks.outcome(0, False)
    assert sum(pattern) == 4 and pattern[interval - 1]  # every interval-th step, so asking costs ~overhead
    asks.outcome(0, True)  # a kept draft: asked every step again
    assert all(asks.ask(0) for _ in range(5))


def test_the_share_is_unknown_until_a_plain_step_is():
    asks = AskBudget()
    asks.timed(0.001, None)
    assert asks.share is None and asks.interval() == 1
    with pytest.raises(ValueError, match="overhead"):
        AskBudget(overhead=0)


class Dropped:
    """A drafter whose chains the policy never keeps (its first token is never accepted)."""

    name = "ngram"
    guard = None

    def __init__(self, now: list[float]) -> None:
        self.asked, self.now = 0, now

    def propose(self, context, max_depth):
        self.asked += 1
        self.now[0] += 0.0005  # asking costs 0.5 ms: 10% of a 5 ms step
        tree = TokenTree.chain([1, 2, 3, 4], self.name)
        tree.match_length = 1
        return tree

    def observe(self, proposed, accepted, emitted):
        pass


def dropped_planner(own_budget: bool = False) -> tuple[DraftPlanner, Dropped, list[float]]:
    """A planner with loop prices over one drafter whose proposals the policy drops, on a fake clock."""
    now = [0.0]
    policy = SpeculationPolicy(STEEP, max_nodes=8, learn_prices=True)
    for _ in range(30):
        policy.observe("ngram/1", 4, 0)
    drafter = Dropped(now)
    drafter.own_budget = own_budget
    planner = DraftPlanner([drafter], policy, clock=lambda: now[0])
    planner.begin()
    return planner, drafter, now


def plain_steps(planner: DraftPlanner, now: list[float], n: int) -> None:
    """``n`` steps of 5 ms each (plus what asking costs), nothing drafted or accepted."""
    for _ in range(n):
        draft = planner.propose(np.arange(12), DraftLimits(4))
        planner.observe(draft, [], 1)
        now[0] += 0.005


def test_the_planner_asks_a_dropped_drafter_less_and_a_prompt_always():
    planner, drafter, now = dropped_planner()
    plain_steps(planner, now, MIN_PLAIN + 6)  # each asking for 0.5 ms (10%: asked every 10th step)
    assert planner.asks is not None and planner.asks.interval() >= 5
    before = drafter.asked
    plain_steps(planner, now, 50)
    assert drafter.asked - before <= 50 // 5 + 2  # within the budget, probes included
    before = drafter.asked
    planner.propose(np.arange(12), DraftLimits(4, fed=12))  # a prompt's forward asks whatever the budget says
    assert drafter.asked == before + 1


def test_a_drafter_with_a_budget_of_its_own_is_always_asked():
    """A draft model behind its PolicyGate times every ask with its own meter: the planner never skips it."""
    planner, drafter, now = dropped_planner(own_budget=True)
    plain_steps(planner, now, MIN_PLAIN + 56)
    assert drafter.asked == MIN_PLAIN + 56


def test_a_skipped_step_is_idle_for_the_key_of_the_drafters_last_proposal_only():
    """The policy learns an n-gram draft under its match length ("ngram/1", "ngram/4"); a step that leaves the
    drafter unasked counts towards the probe of the key it last proposed under, not of every key it ever had (each
    would then probe at the whole budget's rate)."""
    planner, drafter, now = dropped_planner()
    planner.policy.skip("ngram/4")  # a key the drafter had earlier: a longer match
    plain_steps(planner, now, MIN_PLAIN + 6)
    skips: list[str] = []
    real = planner.policy.skip
    planner.policy.skip = lambda key: skips.append(key) or real(key)  # type: ignore[method-assign]
    asked = drafter.asked
    plain_steps(planner, now, 20)
    skipped = 20 - (drafter.asked - asked)
    assert skipped >= 10 and skips == ["ngram/1"] * skipped
