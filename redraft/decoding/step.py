"""One decode step's data: the draft a step verifies and what its verify forward chose.

:class:`Draft` is everything the drafting half of a step hands on (the token tree, and the policy's key per node so
the policy can learn from the outcome); :func:`verify_step` asks for the one verify forward over the pending tokens
plus the tree (a step function, :mod:`redraft.runtimes.sequence`) and returns a :class:`Step`: the rows' choices and top-2 gaps, the accepted path and the tokens it emits.
Nothing about a step is kept on the engine between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.decoding.planner import Draft
from redraft.decoding.sampling import TokenChooser
from redraft.decoding.verify import greedy_accept, tree_attention_mask, tree_positions
from redraft.runtimes.sequence import Steps, forward
from redraft.runtimes.transformers.target import HFTarget


@dataclass
class Step:
    """One verify forward and its greedy acceptance (the speculative step of SpecInfer / gpt-fast's ``generate.py``).

    Attributes:
        draft: the verified :class:`Draft`.
        pending: token ids fed before the tree (not yet in the KV cache; the last one is the tree's root).
        n_past: tokens in the KV cache before the forward.
        logits: FloatTensor [1 + N, V] in the model dtype: row 0 chooses the token after the root, row i + 1 the
            token after tree node i.
        row_pos: absolute position of the token each row chooses.
        extra: per row, the tree tokens between the committed context and that row (the root's row: none), for
            logits processors that read the context; None when there are none.
        choices: the token each row chose (argmax, or seeded sampling); margins: FloatTensor [1 + N], its top-2 gap
            (None when the chooser was told no one reads them, ``TokenChooser.margins``; read them with
            :meth:`margin`).
        path: accepted node indices, root to leaf; new: their tokens plus the bonus token; rows: the row that
            chose each token of ``new``.
    """

    draft: Draft
    pending: list[int]
    n_past: int
    logits: torch.Tensor
    row_pos: list[int]
    extra: list[list[int]] | None
    choices: list[int]
    margins: torch.Tensor | None
    path: list[int]
    new: list[int]
    rows: list[int]

    def margin(self, row: int) -> float:
        """Row ``row``'s top-2 gap (logit units).

        Raises:
            ValueError: the step was chosen without gaps (``TokenChooser.margins`` False).
        """
        if self.margins is None:
            raise ValueError("Step.margin: this step's chooser skipped the top-2 gaps (TokenChooser.margins False)")
        return float(self.margins[row])

    @property
    def n_fed(self) -> int:
        """Tokens the forward appended to the KV cache before the tree (the pending ones)."""
        return len(self.pending)


def verify_step(target: HFTarget, chooser: TokenChooser, pending: list[int], draft: Draft, n_ctx: int
                ) -> Steps[Step]:
    """A step function (``step = yield from verify_step(...)``; :func:`redraft.runtimes.sequence.drive` runs it alone):
    one verify forward over ``pending + draft.tree.tokens`` and accept the longest path the target agrees with.

    A chain runs with plain causal attention; a tree gets :func:`tree_positions` (committed length + depth) and
    :func:`tree_attention_mask` (each node sees the prefix, its ancestors and itself).

    Args:
        target: the target model; its KV cache holds the committed context but ``pending``.
        chooser: this generation's token choice (logits processors, sampling).
        pending: at least one token id; the last is the tree's root.
        draft: the step's :class:`Draft`.
        n_ctx: committed context length (prompt + output), i.e. the position of the token row 0 chooses.
    Returns:
        the :class:`Step`; the KV cache then holds every fed token (the engine keeps the accepted ones). Its
        ``logits`` may be the target's own output buffer: valid until the target's next forward.
    """
    tree, n_past, n_pend = draft.tree, target.length, len(pending)
    if tree.is_chain:
        positions, mask = None, None  # plain causal attention over consecutive positions
    else:
        positions = tree_positions(tree, n_past, n_pend)
        mask = tree_attention_mask(tree, n_past, n_pend, target.dtype)
    # borrowed: the step's logits are read before the engine's next forward (a llama.cpp target lends its buffer)
    logits = yield from forward(target, pending + tree.tokens, positions, mask, n_logits=len(tree) + 1, borrow=True)
    row_pos = [n_ctx] + [n_ctx + d for d in tree.depths]
    extra = [[]] + [[tree.tokens[j] for j in tree.path_to(i)] for i in range(len(tree))] \
        if chooser.processors else None
    choices, margins = chooser.choose(logits, row_pos, extra)
    path, bonus = greedy_accept(tree, choices)
    return Step(draft, list(pending), n_past, logits, row_pos, extra, choices, margins, path,
                [tree.tokens[i] for i in path] + [bonus], [0] + [i + 1 for i in path])
