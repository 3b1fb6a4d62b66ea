"""One draft planner for every front end: the engine's decode loop and the vLLM proposer both draft through
:class:`redraft.decoding.planner.DraftPlanner`, so a change to how drafts are planned reaches both.

If either front end built its drafts its own way again, the spy tests below fail: the planner's answer would no
longer be what the engine verifies or what the proposer hands vLLM.
"""

from __future__ import annotations

import numpy as np
from conftest import plain_greedy
from test_vllm_proposer import FakeBatch, make_proposer, rng_ids, step

from redraft.compose.build import build_drafters
from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.decoding.planner import Draft, DraftLimits, DraftPlanner
from redraft.integrations.planned import RequestDrafts
from redraft.tree import TokenTree

SPY_IDS = [11, 12, 13]


def spy_planner(monkeypatch) -> list[tuple[int, DraftLimits]]:
    """Replace DraftPlanner.propose by a stand-in that records (context length, limits) and drafts SPY_IDS."""
    calls: list[tuple[int, DraftLimits]] = []

    def propose(self, context, limits):
        calls.append((len(context), limits))
        return Draft(TokenTree.chain(SPY_IDS[:limits.depth], "spy"), ["spy"] * min(len(SPY_IDS), limits.depth))

    monkeypatch.setattr(DraftPlanner, "propose", propose)
    return calls


def test_the_engine_verifies_what_the_planner_proposes(tiny_llama, monkeypatch):
    prompt = [31, 32, 33, 34, 35]
    want = plain_greedy(tiny_llama, prompt, 8)
    calls = spy_planner(monkeypatch)
    res = Engine(tiny_llama, build_drafters(Corpus.from_spans([prompt + want]), ngram=False),
                 max_depth=4).generate(prompt, 8)
    assert res.output_ids == want  # the spy's drafts are wrong guesses: still lossless
    assert calls and res.drafted_per_forward[:len(calls)] == [min(3, limits.depth) for _, limits in calls]
    assert calls[0] == (len(prompt), DraftLimits(4, fed=len(prompt), carried=1))


def test_the_vllm_proposer_hands_vllm_what_the_planner_proposes(tmp_path, monkeypatch):
    for policy in ("0", "1"):
        prompt, out = rng_ids(1, 20), rng_ids(2, 60)
        prop = make_proposer(tmp_path, [prompt + out], redraft_policy=policy)
        batch = FakeBatch()
        batch.add(0, prompt, out)
        calls = spy_planner(monkeypatch)
        sampled, drafts = step(prop, batch, None)
        assert drafts == [SPY_IDS] and len(calls) == 1, (policy, drafts, calls)
        assert calls[0][1].depth == calls[0][1].budget == 8  # num_speculative_tokens, chains
        monkeypatch.undo()


def test_engine_and_proposer_plan_the_same_chain(tiny_llama):
    """The same drafters, context and depth give the engine's planner and a vLLM request the same chain."""
    rng = np.random.default_rng(3)
    prompt, out = rng.integers(10, 90, 20).tolist(), rng.integers(10, 90, 40).tolist()  # within the tiny vocab
    corpus = Corpus.from_spans([prompt + out])
    engine = Engine(tiny_llama, build_drafters(corpus, ngram=False, k=8), max_depth=8)
    request = RequestDrafts(DraftPlanner(build_drafters(corpus, ngram=False, k=8), chain_only=True))
    context = np.array(prompt + out[:5], dtype=np.int64)
    for d in engine.drafters:
        d.begin(context[:len(prompt)])
    for d in request.planner.drafters:
        d.begin(context[:len(prompt)])
    chain = engine._draft(context, 8).tree.tokens
    assert list(chain) == out[5:13] == request.propose(context, 8)


def test_priority_merge_and_no_draft():
    class Fixed:
        guard = None

        def __init__(self, name, ids):
            self.name, self.ids, self.asked = name, ids, 0

        def propose(self, context, max_depth):
            self.asked += 1
            return TokenTree.chain(self.ids, self.name) if self.ids else None

        def observe(self, p, a, e):
            pass

    a, b, c = Fixed("a", []), Fixed("b", [1, 2, 3]), Fixed("c", [1, 4])
    ctx = np.zeros(2, dtype=np.int64)
    first = DraftPlanner([a, b, c]).propose(ctx, DraftLimits(2))
    assert list(first.tree.tokens) == [1, 2] and c.asked == 0  # b wins; c is never asked
    merged = DraftPlanner([a, b, c], merge=True).propose(ctx, DraftLimits(3))
    assert sorted(merged.tree.tokens) == [1, 2, 3, 4] and set(merged.tree.sources) == {"b", "c"}
    assert len(DraftPlanner([b]).propose(ctx, DraftLimits(0)).tree) == 0
    assert list(DraftPlanner([Fixed("v", [5, 900])], vocab_size=500).propose(ctx, DraftLimits(4)).tree.tokens) == [5]
