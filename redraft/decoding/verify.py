"""Verification: token tree -> attention mask and positions; acceptance of drafted tokens.

One verify forward runs the uncommitted ("pending") tokens plus every tree node. Pending tokens attend causally;
a tree node attends to everything committed, all pending tokens, its ancestors and itself (SpecInfer, Miao et
al. 2023, section 4; Medusa tree attention). Positions are committed length + depth, so siblings share a position.
"""

from __future__ import annotations

import torch

from redraft.tree import TokenTree


def tree_positions(tree: TokenTree, n_past: int, n_pending: int) -> torch.Tensor:
    """Position ids for one verify forward.

    Args:
        tree: the drafted nodes (N of them).
        n_past: tokens already in the KV cache.
        n_pending: tokens not yet in the cache (the prompt at prefill, else 1: the last emitted token = root).
    Returns:
        LongTensor [1, n_pending + N]: n_past .. n_past+n_pending-1 for pending tokens, then for each node
        (n_past + n_pending - 1) + depth.
    """
    root = n_past + n_pending - 1
    pos = list(range(n_past, n_past + n_pending)) + [root + d for d in tree.depths]
    return torch.tensor([pos], dtype=torch.long)


def tree_attention_mask(tree: TokenTree, n_past: int, n_pending: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D attention mask for a verify forward over pending tokens + tree nodes.

    transformers accepts a prepared 4D mask as is (0 = attend, -inf = blocked); a float mask in the model dtype
    works for both sdpa and eager attention (a bool mask fails with eager).

    Returns:
        FloatTensor [1, 1, Q, K] with Q = n_pending + N and K = n_past + Q, dtype ``dtype``.
    """
    n = len(tree)
    q, k = n_pending + n, n_past + n_pending + n
    allowed = torch.zeros(q, k, dtype=torch.bool)
    allowed[:, :n_past] = True
    allowed[:n_pending, n_past:n_past + n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool).tril()
    allowed[n_pending:, n_past:n_past + n_pending] = True
    base = n_past + n_pending
    for i, p in enumerate(tree.parents):
        row = n_pending + i
        allowed[row, base + i] = True
        if p >= 0:
            # ancestors of i are exactly the ancestors of its parent plus the parent (parents precede children)
            allowed[row, base:base + n] |= allowed[n_pending + p, base:base + n]
    mask = torch.zeros(q, k, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def chain_inputs(dtype: torch.dtype):
    """The tree verifier's inputs for a chain draft, as :func:`redraft.pricing.measure.time_forwards` takes them
    (``tree_inputs``): ``inputs(draft ids after the root, prefix length) -> (position ids, 4D mask)``, the draft as
    a one-path :class:`~redraft.tree.TokenTree` after the root as the one pending token."""

    def inputs(draft, n_prefix: int):
        tree = TokenTree()
        tree.add_chain(draft, "bench")
        return tree_positions(tree, n_prefix, 1), tree_attention_mask(tree, n_prefix, 1, dtype)

    return inputs


def greedy_accept(tree: TokenTree, choices: list[int]) -> tuple[list[int], int]:
    """Longest root-to-leaf path whose tokens equal the target's greedy choices.

    Args:
        tree: the verified tree (N nodes).
        choices: the target's argmax token for the root row followed by one per node, length N + 1.
    Returns:
        (path, bonus): node indices of the accepted path in root-to-leaf order, and the bonus token (the target's
        choice after the last accepted node). One verify forward thus yields len(path) + 1 tokens.
    """
    path: list[int] = []
    want = choices[0]
    node = tree.child(-1, want)
    while node >= 0:
        path.append(node)
        want = choices[node + 1]
        node = tree.child(node, want)
    return path, want
