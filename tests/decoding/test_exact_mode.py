"""Exact mode's near-tie object (redraft.decoding.exact_mode.ExactMode): which rows it trusts, what a near-tie costs,
and when drafting pauses. The end-to-end cases (planted ties, replays, every dtype) are in test_exact_dtypes.py."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, SequenceDrafter, build_tiny

from redraft.decoding.engine import Engine
from redraft.decoding.exact_mode import ExactMode
from redraft.decoding.exactness import near_tie_threshold
from redraft.decoding.sampling import GREEDY, SamplingParams, TokenChooser
from redraft.decoding.step import Draft, Step
from redraft.defaults import EXACT_SAFETY, EXACT_SETTLE_SAFETY
from redraft.runtimes.transformers.target import HFTarget
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
    numerics = "float32"


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
    alone, verify = _relative_thresholds()  # x 10, the largest |logit| of _step's rows
    ex.judge(_step([1.0, 10 * (alone + verify) / 2], 0, PROMPT, 1), chooser)
    assert ex.settling and not ex.rebuild
    ex.judge(_step([1.0, 10 * alone / 2], 0, PROMPT, 1), chooser)
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


class GapTarget(HFTarget):
    """HFTarget whose rows choosing the positions in ``gaps`` hold their top token ``gap * max |logit|`` above the
    second (the same in every row, however computed): a planted near-tie of a known relative size. ``log`` records
    (ids fed, cached length before) per forward."""

    def __init__(self, model, gaps: dict[int, float]) -> None:
        super().__init__(model)
        self.gaps = gaps
        self.log: list[tuple[int, int]] = []

    def forward(self, ids, positions=None, mask=None, n_logits=1):
        before = self.length
        logits = super().forward(ids, positions, mask, n_logits).float().clone()
        self.log.append((len(ids), before))
        pos = positions[0].tolist() if positions is not None else list(range(before, before + len(ids)))
        for r, p in enumerate(pos[len(ids) - n_logits:]):
            if p + 1 in self.gaps:
                a, b = sorted(logits[r].topk(2).indices.tolist())
                top = logits[r].abs().max()
                logits[r, a], logits[r, b] = top, top * (1 - self.gaps[p + 1])
        return logits


def _relative_thresholds() -> tuple[float, float]:
    """(draft-free, verify) thresholds of float32 rows as fractions of the row's largest |logit|: one token alone on
    a drafted cache is judged with EXACT_SETTLE_SAFETY x the gap-noise bound, a verify row with EXACT_SAFETY x it."""
    row = torch.tensor([[1.0]])
    return (float(near_tie_threshold(row, torch.float32, EXACT_SETTLE_SAFETY)[0]),
            float(near_tie_threshold(row, torch.float32, EXACT_SAFETY)[0]))


def test_recompute_between_the_thresholds_is_trusted_under_them_rebuilds():
    """ExactMode alone: a verify row whose gap lies between the draft-free and the verify threshold is recomputed
    on the cache as it is, and the recomputed row (one token alone, same gap) is trusted; a gap under the draft-free
    threshold goes straight to the rebuild, and so does a recomputed row under it."""
    alone, verify = _relative_thresholds()
    chooser = TokenChooser(GREEDY, VOCAB)
    between, under = 10.0 * (alone + verify) / 2, 10.0 * alone / 2  # _step's rows have |logit| 10
    ex = ExactMode(_NoTarget())
    assert ex.judge(_step([1.0, between], 0, PROMPT, 1), chooser) == 1 and ex.settling and not ex.rebuild
    assert ex.judge(_step([between], len(PROMPT) + 1, [5], 0), chooser) == 1  # one token alone on the drafted cache
    assert not ex.settling and ex.near_ties == 1 and ex.settle_forwards == 1
    ex.judge(_step([1.0, under], 0, PROMPT, 1), chooser)
    assert ex.settling and ex.rebuild
    ex2 = ExactMode(_NoTarget())
    ex2.judge(_step([1.0, between], 0, PROMPT, 1), chooser)
    assert ex2.judge(_step([under], len(PROMPT) + 1, [5], 0), chooser) == 0 and ex2.rebuild


def test_rows_under_logits_processors_are_judged_by_each_logits_bound():
    """Without logits processors a row is judged by the bound on its gaps' change (gap_noise); a repetition penalty
    scales positive and negative logits apart, so there the bound each logit's own change implies (2 x row_noise,
    wider in float32) is used: a gap between the two thresholds is trusted only without processors."""
    alone, verify = _relative_thresholds()
    per_logit = float(near_tie_threshold(torch.tensor([[1.0]]), torch.float32, EXACT_SAFETY, gaps=False)[0])
    assert verify < per_logit
    between = 10.0 * (verify + per_logit) / 2  # _step's rows have |logit| 10
    plain_chooser = TokenChooser(GREEDY, VOCAB)
    ex = ExactMode(_NoTarget())
    assert ex.judge(_step([1.0, between], 0, PROMPT, 1), plain_chooser) == 2 and not ex.settling
    penalised = TokenChooser(SamplingParams(repetition_penalty=1.3), VOCAB)
    penalised.reset(PROMPT)
    assert penalised.processors
    ex = ExactMode(_NoTarget())
    assert ex.judge(_step([1.0, between], 0, PROMPT, 1), penalised) == 1 and ex.settling and ex.near_ties == 1


@pytest.mark.parametrize("where", ["between", "under", "just under"])
def test_planted_near_tie_between_the_thresholds_costs_one_recompute(where):
    """End to end (float32 tiny model, always-right drafts): a near-tie early in the answer whose gap clears the
    draft-free rows' threshold but not the verify rows' costs one draft-free forward and no rebuild; one under the
    draft-free threshold (however close to it) still rebuilds the cache the plain way (the prompt fed again). Output
    ids equal plain greedy's."""
    alone, verify = _relative_thresholds()
    gap = {"between": (alone + verify) / 2, "under": alone / 2, "just under": 0.95 * alone}[where]
    model = build_tiny("llama", "eager")
    n, tied = 40, len(PROMPT) + 5
    target = GapTarget(model, {tied: gap})
    plain = Engine(target, []).generate(PROMPT, n).output_ids
    target.log.clear()
    res = Engine(target, [SequenceDrafter(PROMPT + plain, vocab=VOCAB)], max_depth=16).generate(PROMPT, n)
    assert res.output_ids == plain
    assert res.near_ties == 1
    if where == "between":
        assert res.settle_forwards == 1
        assert (len(PROMPT), 0) not in target.log[1:]  # the prompt was never fed again
        assert res.forwards == 1 + 1 + -(-(n - 6) // 17)  # first forward, the recompute, 16-deep drafts after it
    else:
        assert res.settle_forwards == 6  # the prompt again, 4 tokens one per forward, the tied row's root alone
        assert (len(PROMPT), 0) in target.log[1:]
