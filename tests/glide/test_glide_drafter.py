"""GliDe drafter and CaPE through the Engine: lossless output, draft-state rollback, CaPE sibling counts.

Drafts come from untrained tiny drafts (random init, and init from the target, which gets drafts accepted on these
tiny 2-layer targets), so the engine sees both accepted and rejected chains and trees.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny, plain_greedy

from redraft.decoding.engine import Engine
from redraft.drafters.cape import CapeBins, expand
from redraft.drafters.glide import GlideDrafter
from redraft.glide.config import GlideConfig
from redraft.glide.network import build_draft, init_from_target
from redraft.runtimes.transformers.target import HFTarget

PROMPTS = [[7, 21, 3, 88, 40, 12, 7, 21, 3], [1], [50, 51, 52, 53, 54, 50, 51]]
N = 40


@pytest.fixture(scope="module", params=["gqa", "mha"])
def target(request):
    kv = 2 if request.param == "gqa" else 4
    return build_tiny("llama", "sdpa", seed=0, num_key_value_heads=kv)


def _draft(target, init: str, vanilla: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    d = build_draft(target, GlideConfig.from_target(target.config, cross_attention=not vanilla))
    if init == "target":
        init_from_target(d, target)
    return d


@pytest.mark.parametrize("init", ["random", "target"])
@pytest.mark.parametrize("cape", [None, CapeBins()], ids=["chain", "cape"])
def test_glide_drafts_are_lossless(target, init, cape):
    draft = _draft(target, init)
    proposed = accepted = 0
    for prompt in PROMPTS:
        want = plain_greedy(target, prompt, N)
        t = HFTarget(target)
        drafter = GlideDrafter(draft, t, cape=cape)
        res = Engine(t, [drafter]).generate(prompt, N)
        assert res.output_ids == want
        st = res.sources["glide"]
        proposed, accepted = proposed + st.proposed, accepted + st.accepted
        assert res.forwards <= len(want)
    assert proposed > 0
    if init == "target":
        assert accepted > 0  # the test really exercised accepted drafts


def test_vanilla_and_reduced_head_are_lossless(target):
    for draft in (_draft(target, "target", vanilla=True), _draft(target, "target")):
        draft.set_vocab(torch.arange(0, 96, 2))
        for prompt in PROMPTS:
            t = HFTarget(target)
            res = Engine(t, [GlideDrafter(draft, t, cape=CapeBins())]).generate(prompt, N)
            assert res.output_ids == plain_greedy(target, prompt, N)


def test_glide_merged_with_other_sources_is_lossless(target):
    from redraft.drafters import NgramDrafter

    draft = _draft(target, "target")
    t = HFTarget(target)
    drafters = [NgramDrafter(k=6), GlideDrafter(draft, None, cape=CapeBins())]
    engine = Engine(t, drafters, merge=True, tree_budget=32)  # binds t to the GliDe drafter
    for prompt in PROMPTS:
        assert engine.generate(prompt, N).output_ids == plain_greedy(target, prompt, N)


class _Spy(GlideDrafter):
    """Records what the drafter saw at each propose call."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def propose(self, context, max_depth):
        before = (len(context), self.target.length, self.cache.length)
        prop = super().propose(context, max_depth)
        self.seen.append(before + (self.cache.length, None if prop is None else len(prop)))
        return prop


def test_root_is_the_bonus_token_and_draft_state_is_rolled_back(target):
    draft = _draft(target, "target")
    t = HFTarget(target)
    spy = _Spy(draft, t, gamma=4)
    Engine(t, [spy]).generate(PROMPTS[0], N)
    first = spy.seen[0]
    assert first[1] == 0 and first[4] is None  # prefill: the target cache is empty, nothing to read yet
    for ctx_len, t_len, before, after, n in spy.seen[1:]:
        assert t_len == ctx_len - 1  # the target cache = the verified prefix without the root
        assert before <= ctx_len - 1  # no drafted token survived from the previous step
        assert after == ctx_len  # only the verified context stays in the draft cache
        assert n is None or n <= 4


def test_no_target_bound_raises(target):
    d = GlideDrafter(_draft(target, "random"))
    with pytest.raises(RuntimeError, match="bind"):
        d.propose(np.array([1, 2, 3]), 4)


def test_gamma_and_max_depth(target):
    draft = _draft(target, "target")
    t = HFTarget(target)
    t.reset()
    t.forward([5, 6, 7])
    for gamma, depth, want in ((4, 48, 4), (4, 2, 2), (6, 48, 6), (3, 0, None)):
        prop = GlideDrafter(draft, t, gamma=gamma).propose(np.array([5, 6, 7, 8]), depth)
        assert (None if prop is None else len(prop)) == want


# ---- CaPE ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,extra", [(0.05, 7), (0.29, 7), (0.3, 5), (0.59, 5), (0.6, 3), (0.79, 3), (0.8, 1),
                                     (0.99, 1)])
def test_cape_bins(p, extra):
    assert CapeBins().extras_for(p) == extra


def test_cape_bins_configurable():
    b = CapeBins.parse("0.5:2,0")
    assert b.extras_for(0.4) == 2 and b.extras_for(0.5) == 0 and b.max_extras == 2
    for bad in ("0.5:1", "0.9,0.2:1,1,1", "x:1", "0.5:1,-1"):
        with pytest.raises(ValueError):
            CapeBins.parse(bad)


def test_cape_expand_structure():
    prop = expand([10, 11, 12], [[20, 21], [], [30]])
    assert list(prop.tokens) == [10, 20, 21, 11, 12, 30]
    assert list(prop.parents) == [-1, -1, -1, 0, 3, 3]


def _confident_logits(p: float, n: int, hot: int) -> torch.Tensor:
    """Logits over n entries whose softmax puts probability p on ``hot`` and spreads the rest decreasingly."""
    rest = torch.linspace(1.0, 0.5, n - 1)
    rest = rest / rest.sum() * (1 - p)
    probs = torch.cat((torch.tensor([p]), rest))
    order = [hot] + [i for i in range(n) if i != hot]
    out = torch.empty(n)
    out[order] = probs.log()
    return out


@pytest.mark.parametrize("confidences", [(0.2, 0.5, 0.7, 0.9), (0.95, 0.1, 0.65, 0.31)])
def test_cape_sibling_counts_per_confidence_bin(target, confidences):
    """Each draft step adds exactly extras_for(p) siblings next to the greedy token, p = its top probability."""
    draft = _draft(target, "random")
    steps = iter(confidences)
    hot = iter([11, 12, 13, 14])
    draft.logits = lambda h: _confident_logits(next(steps), draft.cfg.vocab_size, next(hot))[None]
    t = HFTarget(target)
    t.reset()
    t.forward([5, 6, 7])
    prop = GlideDrafter(draft, t, gamma=4, cape=CapeBins()).propose(np.array([5, 6, 7, 8]), 48)
    bins = CapeBins()
    depth_of, parents = {}, list(prop.parents)
    for i, par in enumerate(parents):
        depth_of[i] = 1 if par < 0 else depth_of[par] + 1
    spine = [min(i for i in depth_of if depth_of[i] == d) for d in range(1, 5)]  # the greedy node comes first
    assert [prop.tokens[i] for i in spine] == [11, 12, 13, 14]
    assert [parents[i] for i in spine] == [-1] + spine[:-1]
    for d, p in enumerate(confidences, start=1):
        at_depth = [i for i in depth_of if depth_of[i] == d]
        assert len(at_depth) == 1 + bins.extras_for(p)
        # siblings are leaves: nothing hangs below them
        for i in at_depth[1:]:
            assert i not in parents
    assert len(prop) == 4 + sum(bins.extras_for(p) for p in confidences)



def test_guard_counts_cape_trees_by_depth(target):
    """A CaPE tree can get at most one node per level accepted: the guard counts its levels, not its nodes."""
    from redraft.drafters.base import AcceptanceGuard

    guard = AcceptanceGuard(0.25)
    t = HFTarget(target)
    t.reset()
    t.forward(PROMPTS[0][:-1])
    d = GlideDrafter(_draft(target, "random"), t, gamma=4, cape=CapeBins(), guard=guard)
    prop = d.propose(np.array(PROMPTS[0]), 4)
    assert len(prop.tokens) > 4  # a random draft is unsure: siblings at every level
    d.observe(len(prop.tokens), 1, 2)
    assert (guard.proposed, guard.accepted) == (4, 1) and guard.active  # 25%: not paused


def test_run_report_says_when_the_guard_paused_a_draft(target):
    """An untrained draft fails its guard: the engine counts the pause and the run report names it."""
    from redraft.decoding.runstats import source_lines
    from redraft.drafters.base import AcceptanceGuard

    d = GlideDrafter(_draft(target, "random"), None, gamma=4, guard=AcceptanceGuard(0.9, window=8, pause=10))
    engine = Engine(target, [d])
    g = engine.generate(PROMPTS[0], 40)
    assert g.output_ids == plain_greedy(target, PROMPTS[0], 40)
    st = g.sources["glide"]
    assert st.paused >= 1 and st.paused == d.guard.pauses
    (line,) = source_lines(g)
    assert line.startswith("glide drafts: ") and f"paused {st.paused} time" in line
