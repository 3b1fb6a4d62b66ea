"""Which draft nodes to verify: the subtree that maximises expected tokens per unit of verify time.

Given a candidate token tree (a chain is the special case parents[i] = i - 1) and, per node, the probability that
it is accepted given that its parent is, the probability that node i ends up on the accepted path is the product
P(i) of those conditionals from the root down to i. A verify forward over a kept subtree K yields
E(K) = 1 + sum_{i in K} P(i) tokens (the bonus token plus each accepted node) and costs c(|K|) plain steps. For a
fixed size n the best K is the n nodes of largest P (P never grows along a path, so those n nodes always form a
subtree); the kept size is the n maximising E / c(n), and nothing is kept unless that beats a plain step
(1 token for c(0) = 1). The same greedy order is SpecInfer/Sequoia's tree budget rule and, for a chain, picks the
depth. numpy only; O(N log N) for N candidate nodes (O(N) for a chain, whose P is already sorted).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from redraft.policy.priors import node_depths


@dataclass
class Selection:
    """The nodes to verify this step.

    Attributes:
        nodes: kept node indices, ascending; every kept node's parent is kept (empty = a plain step).
        expected_tokens: 1 + sum of P(node on the accepted path) over the kept nodes.
        cost: c(len(nodes)), in plain 1-token steps.
        probes: sources whose nodes were kept as an exploration probe rather than on their expected gain.
    """

    nodes: list[int]
    expected_tokens: float
    cost: float
    probes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Expected tokens per plain-step of verify time (1.0 for a plain step)."""
        return self.expected_tokens / self.cost

    def __len__(self) -> int:
        return len(self.nodes)


def path_probabilities(parents: Sequence[int], cond: Sequence[float] | np.ndarray) -> np.ndarray:
    """float64 [N]: P(node accepted) = product of ``cond`` from the root's child down to the node."""
    prob = np.empty(len(parents))
    for i, p in enumerate(parents):
        prob[i] = cond[i] * (1.0 if p < 0 else prob[p])
    return prob


def with_ancestors(parents: Sequence[int], nodes: Iterable[int]) -> list[int]:
    """``nodes`` plus all their ancestors, ascending."""
    keep: set[int] = set()
    for n in nodes:
        while n >= 0 and n not in keep:
            keep.add(n)
            n = parents[n]
    return sorted(keep)


def select_nodes(parents: Sequence[int], cond: Sequence[float] | np.ndarray, costs: np.ndarray, *,
                 forced: Iterable[int] = (), budget: int | None = None, min_gain: float = 0.0) -> Selection:
    """The subtree of ``parents`` to verify, maximising expected tokens / c(size).

    Args:
        parents: parent index per node (-1 = child of the root), parents before children.
        cond: per node, P(accepted | parent accepted), in [0, 1].
        costs: float [K + 1], c(0..K) (c(0) = 1); at most K nodes are kept.
        forced: nodes kept whatever their gain (with their ancestors): an exploration probe.
        budget: most nodes kept (default K).
        min_gain: keep a draft only when its rate exceeds a plain step's by more than this fraction.
    Returns:
        :class:`Selection` (``probes`` left empty).
    """
    prob = path_probabilities(parents, cond)
    limit = len(costs) - 1 if budget is None else min(int(budget), len(costs) - 1)
    must = with_ancestors(parents, forced)[:limit]
    must_set = set(must)
    # stable sort by -P: a node ties its parent only when cond = 1, and the parent has the lower index
    rest = sorted((i for i in range(len(parents)) if i not in must_set), key=lambda i: (-prob[i], i))
    order = (must + rest)[:limit]
    expected = 1.0 + np.concatenate(([0.0], np.cumsum(prob[order])))  # E for n = 0..len(order)
    rate = expected / costs[:len(expected)]
    n0 = len(must)
    n = n0 + int(np.argmax(rate[n0:]))  # ties: the fewest nodes
    if n0 == 0 and rate[n] <= 1.0 + min_gain:
        n = 0
    return Selection(sorted(order[:n]), float(expected[n]), float(costs[n]))


def source_outcomes(parents: Sequence[int], sources: Sequence[str], path: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Per source in a verified tree: (levels it proposed, levels of it accepted), for the policy's ``observe``.

    A source proposed down to the depth of its deepest node. Its accepted levels reach the depth of its deepest
    node on the accepted ``path``; when none of its nodes is on the path, the path levels above its shallowest
    node count as accepted (in a merged tree a shared prefix is attributed to the source that proposed it first).
    For a single-source tree this is (tree depth, accepted draft tokens).

    Args:
        parents, sources: the verified tree's nodes (parents first).
        path: accepted node indices, root's child first.
    """
    depths = node_depths(parents)
    out: dict[str, tuple[int, int]] = {}
    for s in dict.fromkeys(sources):
        mine = [i for i, src in enumerate(sources) if src == s]
        on_path = [int(depths[i]) for i in path if sources[i] == s]
        accepted = max(on_path) if on_path else min(len(path), int(min(depths[mine])) - 1)
        out[s] = (int(max(depths[mine])), accepted)
    return out


def subtree_parents(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """Parent indices of the kept ``nodes`` (ascending, closed under ancestors), renumbered among themselves."""
    index = {n: j for j, n in enumerate(nodes)}
    return [-1 if parents[n] < 0 else index[parents[n]] for n in nodes]
