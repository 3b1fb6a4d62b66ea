"""The cost curve on a runtime that rebuilds its compute graph when a forward's shape changes (llama.cpp).

A fake target advances a fake clock: a forward of S rows takes 1 + 0.5 (S - 1) units, plus ``rebuild`` when S differs
from the previous forward's (llama.cpp reuses the graph of its last forward). In a decode loop a verify forward of
1 + n rows follows one-row steps and is followed by one, so it adds 1 + 0.5 n + 2 rebuild units to a stream of plain
steps that cost 1 each: that is what c(n) must say.
"""

from __future__ import annotations

import pytest

from redraft.pricing import measure


class ShapeTarget:
    """Duck-typed target (the :func:`redraft.pricing.measure.time_forwards` protocol) on a fake clock."""

    chain_only = True
    max_length = 1024
    vocab_size = 100

    def __init__(self, clock: list[float], runtime: str, rebuild: float) -> None:
        self.clock, self.runtime, self.rebuild = clock, runtime, rebuild
        self.length, self.last = 0, 0

    def reset(self) -> None:
        self.length = 0

    def crop(self, n: int) -> None:
        self.length = n

    def forward(self, ids, pos=None, mask=None, n_logits: int = 1):
        s = len(ids)
        self.clock[0] += 1.0 + 0.5 * (s - 1) + (self.rebuild if s != self.last else 0.0)
        self.last, self.length = s, self.length + s


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    return now


def test_a_llama_cpp_forward_is_priced_with_both_graph_builds_it_causes(clock):
    curve = measure.measure_cost_curve(ShapeTarget(clock, "llama.cpp", rebuild=0.25), sizes=(0, 1, 2, 4, 8),
                                       prefix=16, repeats=3)
    for n in (1, 2, 4, 8):
        assert curve.cost(n) == pytest.approx(1.0 + 0.5 * n + 2 * 0.25)
    assert curve.cost(0) == 1.0


def test_without_a_graph_to_rebuild_the_price_is_the_forward_alone(clock):
    curve = measure.measure_cost_curve(ShapeTarget(clock, "llama.cpp", rebuild=0.0), sizes=(0, 1, 2, 4, 8),
                                       prefix=16, repeats=3)
    for n in (1, 2, 4, 8):
        assert curve.cost(n) == pytest.approx(1.0 + 0.5 * n)


class JitteryTarget(ShapeTarget):
    """A :class:`ShapeTarget` on a busy machine: every ``every``-th one-row step takes ``slow`` units more."""

    def __init__(self, clock, rebuild: float, every: int, slow: float) -> None:
        super().__init__(clock, "llama.cpp", rebuild)
        self.every, self.slow, self.steps = every, slow, 0

    def forward(self, ids, pos=None, mask=None, n_logits: int = 1):
        if len(ids) == 1:
            self.steps += 1
            if self.steps % self.every == 0:
                self.clock[0] += self.slow
        super().forward(ids, pos, mask, n_logits)


def test_a_one_row_step_slowed_by_the_machine_neither_breaks_the_curve_nor_moves_it(clock):
    # one one-row step in five takes six times as long: the reference and the next step's extra would go negative
    # or double if either were a single step
    curve = measure.measure_cost_curve(JitteryTarget(clock, rebuild=0.25, every=5, slow=5.0), sizes=(0, 1, 2, 4, 8),
                                       prefix=16, repeats=5)
    for n in (1, 2, 4, 8):
        assert curve.cost(n) == pytest.approx(1.0 + 0.5 * n + 2 * 0.25, rel=0.2)
