"""The policy on the engine's token trees: a step's candidates with their priors, the cut, the outcomes fed back.

Per step the engine collects the drafters' proposals (each a :class:`~redraft.tree.TokenTree` from one source) into
:class:`Candidates`, which keeps each node's prior from what its source said about that proposal (corpus counts,
match length: :func:`proposal_priors`). :func:`cut` asks the :class:`SpeculationPolicy` which nodes to verify and
returns them as the verify tree; after the verify forward :func:`observe_outcomes` feeds the policy what each source
proposed and got accepted, counting only what the output reached. All of it is O(nodes) per step, numpy only.

Cutting is lossless by construction: the verify tree is a subtree of the candidates closed under ancestors, and
verification keeps exactly the drafted tokens the target would have produced (tests/decoding/test_engine_policy.py checks
every depth the policy can choose against plain greedy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from redraft.policy.priors import source_priors, succession_priors
from redraft.policy.select import source_outcomes
from redraft.policy.speculation import SpeculationPolicy
from redraft.tree import TokenTree


def policy_key(source: str, match_length: int) -> str:
    """The name the policy learns a proposal's acceptance under: its source, split by match length in powers of
    two ("corpus/8" for matches of 8..15 tokens), since how far a lookup matched says most about how far it will
    be right (SuffixDecoding, arXiv 2411.04975); sources without a match length keep their name."""
    if match_length <= 0:
        return source
    return f"{source}/{1 << (int(match_length).bit_length() - 1)}"


def proposal_priors(tree: TokenTree) -> np.ndarray | None:
    """float64 [N] per-node priors of one source's proposal (corpus counts and / or match length), or None.

    Counts that are all zero (a chain, or a source without occurrence counts) say nothing and are ignored.
    """
    counts = tree.counts if tree.counts is not None and any(tree.counts) else None
    return source_priors(tree.parents, counts=counts, match_length=tree.match_length or None,
                         root_count=(tree.root_count or None) if counts is not None else None, depths=tree.depths)


def first_prior(tree: TokenTree) -> float:
    """:func:`proposal_priors` of a proposal's first node (NaN where there is none), without the others': what
    telling a chance chain hopeless needs (:meth:`~redraft.policy.speculation.SpeculationPolicy.hopeless_chain`).
    Without occurrence counts that is the rule of succession after the match alone; with them, the whole
    proposal's priors are taken (a corpus draft)."""
    if not len(tree):
        return math.nan
    if tree.counts is not None and any(tree.counts):
        prior = proposal_priors(tree)
        return math.nan if prior is None else float(prior[0])
    if tree.match_length > 0:
        return float(succession_priors([-1], tree.match_length)[0])
    return math.nan


class Candidates:
    """One step's candidate tree, built proposal by proposal in priority order, with a prior per node.

    Attributes:
        tree: the merged :class:`~redraft.tree.TokenTree` (shared prefixes kept once, under their first source).
        priors: float per node, NaN where the node's source said nothing about it.
        keys: per node, the name the policy learns it under (:func:`policy_key`).
    """

    def __init__(self) -> None:
        self.tree = TokenTree()
        self.priors: list[float] = []
        self.keys: list[str] = []

    def add(self, proposal: TokenTree, source: str, *, budget: int | None = None,
            max_depth: int | None = None) -> int:
        """Merge ``proposal`` from ``source`` (see :meth:`TokenTree.merge`); returns the number of new nodes."""
        before = len(self.tree)
        added = self.tree.merge(proposal, source, budget=budget, max_depth=max_depth)
        self.priors.extend([math.nan] * (len(self.tree) - before))
        self.keys.extend([policy_key(source, proposal.match_length)] * (len(self.tree) - before))
        prior = proposal_priors(proposal) if added else None
        if prior is not None and before == 0 and added == len(proposal):
            self.priors = prior.tolist()  # the whole proposal became the tree, node for node (the usual step)
        elif prior is not None:
            mapped: list[int] = []  # proposal node -> candidate node (-1: dropped by the budget or depth)
            for i, (t, p) in enumerate(zip(proposal.tokens, proposal.parents, strict=True)):
                m = -1 if p >= 0 and mapped[p] < 0 else self.tree.child(-1 if p < 0 else mapped[p], t)
                mapped.append(m)
                if m >= before:
                    self.priors[m] = float(prior[i])
        return added

    def __len__(self) -> int:
        return len(self.tree)


def cut(policy: SpeculationPolicy, candidates: Candidates, *, max_depth: int | None = None,
        budget: int | None = None, fed: int = 1, awaited: bool = False) -> tuple[TokenTree, list[str]]:
    """The verify tree: the candidates' nodes the policy keeps this step (empty = a plain step), and their keys.

    ``fed``: tokens the verify forward carries before the draft (the whole prompt at the first step, else 1);
    ``awaited``: a streaming client waits for this forward's first token: see :meth:`SpeculationPolicy.plan`.

    Advances the policy's idle counts of the keys whose nodes were all dropped (see
    :meth:`SpeculationPolicy.plan`); call it once per candidate set.
    """
    tree = candidates.tree
    if len(tree) == 0:
        return tree, []
    priors = candidates.priors if any(not math.isnan(p) for p in candidates.priors) else None
    sel = policy.plan(tree.parents, candidates.keys, priors, max_depth=max_depth, budget=budget, fed=fed,
                      awaited=awaited)
    return tree.subtree(sel.nodes), [candidates.keys[i] for i in sel.nodes]


def observe_outcomes(policy: SpeculationPolicy, tree: TokenTree, keys: Sequence[str], path: Sequence[int],
                     judged: int | None) -> None:
    """Feed the policy one verify forward's outcome per key.

    Args:
        tree: the verified tree; ``keys`` its nodes' policy keys (from :func:`cut`).
        path: accepted node indices whose tokens were emitted.
        judged: None, or the tokens emitted when the output was cut short (EOS, stop string, limits, a near-tie):
            deeper draft levels were never judged, so the proposed depth counts only up to it.
    """
    if len(tree) == 0:
        return
    for source, (depth, accepted) in source_outcomes(tree.parents, keys, path).items():
        if judged is not None:
            depth = min(depth, judged)
        policy.observe(source, depth, min(accepted, depth))
