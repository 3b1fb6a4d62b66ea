"""Exact mode's near-tie object (redraft.decoding.settling.ExactMode): which rows it trusts, what a near-tie costs,
and when drafting pauses. The end-to-end cases (planted ties, replays, every dtype) are in test_exact_dtypes.py."""

from __future__ import annotations

import torch
from conftest import VOCAB, SequenceDrafter, build_tiny

from redraft.decoding.engine import Engine
from redraft.decoding.sampling import GREEDY, TokenChooser
from redraft.decoding.settling import ExactMode
from redraft.decoding.step import Draft, Step
from redraft.decoding.target import HFTarget
from redraft.tree import TokenTree

PROMPT = [7, 21, 3, 88, 40, 12, 7, 21, 3]


def _step(margins: list[float], n_past: int, pending: list[int], drafted: int) -> Step:
    """A chain step whose rows have these top-2 gaps and whose drafts were all accepted."""
    tree = TokenTree.chain(list(range(1, drafted + 1)), "d")
    logits = torch.zeros(len(margins), VOCAB)
    logits[:, 0] = 10.0
    logits[:, 1] = 10.0 - torch.tensor(margins)
    path = list(range(drafted))
    return Step(Draft(tree), pending, n_past, logits, list(range(len(margins))), None, [0] * len(margins),
                torch.tensor(margins), path, [1] * (drafted + 1), [0] + [i + 1 for i in path])


class _NoTarget:
    dtype = torch.float32


def test_plain_rows_are_trusted_ties_included():
    """The prompt on an empty cache, then one token on the cache built that way: plain decoding's own rows."""
    ex = ExactMode(_NoTarget(), margin=1.0)
    chooser = TokenChooser(GREEDY, VOCAB)
    assert ex.judge(_step([0.0], 0, PROMPT, 0), chooser) == 1
    assert ex.plain_len == len(PROMPT) and not ex.settling
    assert ex.judge(_step([0.0], len(PROMPT), [5], 0), chooser) == 1
    assert ex.near_ties == 0


def test_verify_rows_cut_before_the_first_near_tie():
    ex = ExactMode(_NoTarget(), margin=1.0)
    chooser = TokenChooser(GREEDY, VOCAB)
    assert ex.judge(_step([2.0, 2.0, 0.5, 2.0, 0.1], 0, PROMPT, 4), chooser) == 2
    assert ex.settling and ex.near_ties == 1 and not ex.may_draft
    ex2 = ExactMode(_NoTarget(), margin=1.0)
    assert ex2.judge(_step([2.0] * 5, 0, PROMPT, 4), chooser) == 5 and not ex2.settling


def test_a_near_tie_rebuilds_only_where_a_draft_free_row_would_still_be_one():
    """Per-dtype thresholds: a verify row's gap between the draft-free (settling) threshold and the verify threshold
    is recomputed on the cache as it is; under the settling threshold the cache is rebuilt the plain way."""
    ex = ExactMode(_NoTarget())
    chooser = TokenChooser(GREEDY, VOCAB)
    # row threshold = safety x 2 x 4e-6 x 10 (the largest |logit|): verify 3.2e-4, settling 1.6e-4
    ex.judge(_step([1.0, 2.5e-4], 0, PROMPT, 1), chooser)
    assert ex.settling and not ex.rebuild
    ex.judge(_step([1.0, 1.0e-4], 0, PROMPT, 1), chooser)
    assert ex.settling and ex.rebuild


def test_drafting_pauses_only_while_settling_cost_more_than_drafting_saved():
    ex = ExactMode(_NoTarget(), pause_cap=100)
    ex.emitted(9)  # a verify forward emitted 9 tokens: 8 forwards saved
    ex.spend(5)
    assert ex.may_draft and ex.paused_for == 0  # 5 spent <= 8 saved: drafting goes on
    ex.spend(6)  # 11 spent > 8 saved: pause for the 3-forward deficit, counted in emitted tokens
    assert ex.paused_for == 3 and not ex.may_draft
    ex.emitted(1)
    ex.emitted(1)
    assert not ex.may_draft
    ex.emitted(1)
    assert ex.may_draft
    capped = ExactMode(_NoTarget(), pause_cap=2)
    capped.spend(10)
    assert capped.paused_for == 2
    never = ExactMode(_NoTarget(), pause_cap=0)
    never.spend(10)
    assert never.may_draft


def test_one_early_near_tie_costs_its_settling_and_drafting_goes_on():
    """A fixed margin that only the closest row's gap (an early one in this tiny model) is under: that row is
    settled, the tokens before it fed again one per forward since a draft-free row would still be under the margin,
    and every other token is drafted; the output is plain decoding's."""
    model = build_tiny("llama", "eager")
    target = HFTarget(model)
    n = 40
    plain = Engine(target, []).generate(PROMPT, n, record_margins=True)
    gaps = plain.margins
    before = min(range(n), key=lambda i: gaps[i])
    margin = gaps[before] + 1e-6
    assert before < 8 and sum(g < margin for g in gaps) == 1, "the planted near-tie must be one early row"
    res = Engine(target, [SequenceDrafter(PROMPT + plain.output_ids, vocab=VOCAB)], max_depth=8,
                 exact_margin=margin).generate(PROMPT, n)
    assert res.output_ids == plain.output_ids
    assert res.near_ties == 1
    assert res.forwards == len(res.drafted_per_forward)
    assert res.settle_forwards == before + 1  # the prompt again, the tokens before the tied one's root, its root
    assert res.forwards <= -(-n // 9) + before + 2
