"""Statistics count only what was emitted: accepted <= emitted per forward and in total, for every kind of cut.

A verify forward can accept a deep draft of which only a head is emitted: the output ends at an EOS, a stop string
or the token / context limit (or exact mode stops at a near-tie). Draft nodes deeper than the tokens the forward
emitted were never part of the output, so they are neither accepted nor proposed: an oracle that drafts through an
EOS is 100% accepted, not "29/29" for 6 emitted tokens (issue 11, item 1).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MAX_POS, VOCAB, ConstantDrafter, SequenceDrafter, plain_greedy

from redraft.decoding.engine import Engine
from redraft.decoding.stopping import StopStrings

PROMPT = [4, 5, 6]
NGEN = 30


class AngleTokenizer:
    """Decodes id i as "<i>", so a stop string can name one token exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{int(i)}>" for i in ids)


@pytest.fixture(scope="module")
def full(tiny_llama):
    """Plain greedy output of PROMPT and the index j >= 5 of a token that does not occur before it."""
    out = plain_greedy(tiny_llama, PROMPT, NGEN)
    j = next(i for i in range(5, NGEN) if out[i] not in out[:i])
    return out, j


def assert_counts_consistent(res, drafter) -> None:
    """The invariants every generation keeps, whatever stopped it."""
    assert len(drafter.observed) == res.forwards == len(res.accepted_per_forward)
    assert sum(e for _, _, e in drafter.observed) == len(res.output_ids)
    for (p, a, e), apf in zip(drafter.observed, res.accepted_per_forward, strict=True):
        assert a <= e and a <= p and a == apf
    st = res.sources[drafter.name]
    assert st.accepted == sum(a for _, a, _ in drafter.observed) == sum(res.accepted_per_forward)
    assert st.proposed == sum(p for p, _, _ in drafter.observed)
    assert st.accepted <= len(res.output_ids)
    assert all(a <= d for a, d in zip(res.accepted_per_forward, res.draft_depth_per_forward, strict=True))


def test_eos_inside_a_deep_accepted_draft(tiny_llama, full):
    want, j = full
    oracle = SequenceDrafter(PROMPT + want)  # drafts 29 tokens straight through the EOS
    res = Engine(tiny_llama, [oracle], eos_token_ids=[want[j]]).generate(PROMPT, NGEN)
    assert res.output_ids == want[:j + 1] and res.stop_reason == "eos" and res.forwards == 1
    # j + 1 tokens emitted, all of them accepted draft tokens; the 29 - (j + 1) drafted after the EOS do not count
    assert oracle.observed == [(j + 1, j + 1, j + 1)]
    assert res.accepted_per_forward == [j + 1] and res.draft_depth_per_forward == [j + 1]
    st = res.sources["oracle"]
    assert (st.proposed, st.accepted, st.acceptance) == (j + 1, j + 1, 1.0)
    assert_counts_consistent(res, oracle)


def test_stop_string_inside_a_deep_accepted_draft(tiny_llama, full):
    want, j = full
    oracle = SequenceDrafter(PROMPT + want)
    stop = StopStrings(AngleTokenizer(), [f"<{want[j]}>"])
    res = Engine(tiny_llama, [oracle]).generate(PROMPT, NGEN, stop=stop, record_margins=True)
    assert res.output_ids == want[:j + 1] and res.stop_reason == "stop" and res.forwards == 1
    assert oracle.observed == [(j + 1, j + 1, j + 1)]
    assert res.accepted_per_forward == [j + 1] and res.draft_depth_per_forward == [j + 1]
    assert len(res.margins) == len(res.output_ids)  # one margin per emitted token, none for the cut ones
    assert_counts_consistent(res, oracle)


@pytest.mark.parametrize("limit", [2, 4])
def test_stop_after_several_forwards_counts_only_the_emitted_head(tiny_llama, full, limit):
    want, j = full
    oracle = SequenceDrafter(PROMPT + want, limit=limit)  # limit + 1 tokens per forward until the EOS
    res = Engine(tiny_llama, [oracle], eos_token_ids=[want[j]]).generate(PROMPT, NGEN)
    per = limit + 1
    assert res.output_ids == want[:j + 1] and res.forwards == -(-(j + 1) // per)
    last = (j + 1) - per * (res.forwards - 1)  # tokens the last forward emitted
    head = min(limit, last)
    assert oracle.observed == [(limit, limit, per)] * (res.forwards - 1) + [(head, head, last)]
    assert_counts_consistent(res, oracle)


def test_token_limit_inside_a_draft_that_ignores_max_depth(tiny_llama, full):
    want, _ = full
    oracle = SequenceDrafter(PROMPT + want, depth=40)  # proposes past the 7-token budget; the engine clamps
    res = Engine(tiny_llama, [oracle]).generate(PROMPT, 7)
    assert res.output_ids == want[:7] and res.stop_reason == "length" and res.forwards == 1
    assert oracle.observed == [(6, 6, 7)] and res.draft_depth_per_forward == [6]
    assert_counts_consistent(res, oracle)


def test_context_limit(tiny_llama):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, MAX_POS - 9).tolist()
    want = plain_greedy(tiny_llama, prompt, 50)
    assert len(want) == 9
    oracle = SequenceDrafter(prompt + want + [1] * 50, depth=48)
    res = Engine(tiny_llama, [oracle]).generate(prompt, 50)
    assert res.output_ids == want and res.stop_reason == "context"
    assert oracle.observed == [(8, 8, 9)]
    assert_counts_consistent(res, oracle)


def test_merged_tree_cut_by_eos_counts_nodes_up_to_the_emitted_depth(tiny_llama, full):
    want, j = full
    oracle = SequenceDrafter(PROMPT + want)
    other = [t for t in range(VOCAB) if t != want[0]][:3]
    garbage = ConstantDrafter(other)  # a 3-deep wrong branch next to the oracle's chain
    res = Engine(tiny_llama, [oracle, garbage], eos_token_ids=[want[j]], merge=True).generate(PROMPT, NGEN)
    assert res.output_ids == want[:j + 1] and res.forwards == 1
    assert oracle.observed[0][:2] == (j + 1, j + 1)
    assert garbage.observed == [(3, 0, j + 1)]  # depth 1..3 <= j + 1: judged, rejected
    assert res.source_per_forward == [("oracle", "garbage")]
    assert_counts_consistent(res, oracle)


@pytest.mark.parametrize("margin", [0.5, 3.0])
def test_exact_mode_near_tie_cut(tiny_llama, full, margin):
    want, _ = full
    oracle = SequenceDrafter(PROMPT + want)
    res = Engine(tiny_llama, [oracle], max_depth=6, exact_margin=margin).generate(PROMPT, NGEN)
    assert res.output_ids == want
    assert_counts_consistent(res, oracle)
    assert any(e <= a for _, a, e in oracle.observed)  # some forwards stopped at a near-tie inside the draft
    # the oracle's chain is right everywhere: a forward cut at a near-tie judged only the nodes it emitted
    assert all(p <= e for p, _, e in oracle.observed)


def test_plain_decoding_records_one_entry_per_forward(tiny_llama, full):
    want, j = full
    res = Engine(tiny_llama, [], eos_token_ids=[want[j]]).generate(PROMPT, NGEN)
    assert res.output_ids == want[:j + 1] and res.forwards == j + 1
    assert res.accepted_per_forward == res.draft_depth_per_forward == [0] * (j + 1)


def test_overlapping_stop_strings_inside_a_deep_draft_stop_where_plain_decoding_stops(tiny_llama, full):
    """Stop strings "<a><b><c>" and "<b>" with a, b, c emitted by one verify forward: one token at a time, "<b>"
    completes first (after b) and the output ends there, text "<a>"; the deep draft must stop at the same token
    (it used to cut before the earlier-starting "<a><b><c>", emitting c too and an empty text)."""
    want, j = full
    a, b, c = want[j - 1], want[j], want[j + 1]
    stops = [f"<{a}><{b}><{c}>", f"<{b}>"]
    plain_stop = StopStrings(AngleTokenizer(), stops)
    plain = Engine(tiny_llama, []).generate(PROMPT, NGEN, stop=plain_stop)
    deep_stop = StopStrings(AngleTokenizer(), stops)
    deep = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)]).generate(PROMPT, NGEN, stop=deep_stop)
    assert deep.output_ids == plain.output_ids and deep.stop_reason == plain.stop_reason == "stop"
    assert deep_stop.text == plain_stop.text and deep.forwards == 1
    assert plain_stop.n_tokens == len(plain.output_ids)
