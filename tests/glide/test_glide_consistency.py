"""Training and inference see the same thing: the hidden states the training forward (block mask) computes at a
block's root and the positions after it equal those :meth:`GlideDrafter.propose` computes when it drafts from that
root with the target cache holding the verified prefix (issue 15: rule out a train/inference mismatch first).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny

from redraft.drafters.glide import GlideDrafter
from redraft.glide.config import GlideConfig
from redraft.glide.network import build_draft, init_from_target
from redraft.runtimes.transformers.target import HFTarget
from redraft.training.data import generate_records
from redraft.training.objective import collate

GAMMA = 4


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("llama", "sdpa", seed=5)


def _draft(tiny, **kw):
    torch.manual_seed(1)
    draft = build_draft(tiny, GlideConfig.from_target(tiny.config, **kw))
    init_from_target(draft, tiny)
    for layer in draft.layers:  # a zero o_proj would hide the cross-attention from the comparison
        if layer.cross_attn is not None:
            torch.nn.init.normal_(layer.cross_attn.o_proj.weight, std=0.3)
            if layer.cross_attn.newest is not None:
                torch.nn.init.normal_(layer.cross_attn.newest.weight, std=0.3)
            if layer.cross_attn.gate is not None:
                torch.nn.init.normal_(layer.cross_attn.gate.weight, std=0.3)
    return draft.eval()


def _propose_hidden(draft, tiny, ids: list[int], root: int) -> torch.Tensor:
    """Hidden states [GAMMA, H] the drafter feeds its head when it drafts from ``ids[root]`` (a fresh drafter)."""
    seen = []
    logits = draft.logits
    draft.logits = lambda h: (seen.append(h.detach().clone()), logits(h))[1]
    try:
        t = HFTarget(tiny)
        t.reset()
        t.forward(ids[:root])
        prop = GlideDrafter(draft, t, gamma=GAMMA).propose(np.array(ids[:root + 1]), GAMMA)
    finally:
        del draft.logits
    assert prop is not None and len(seen) == GAMMA
    return torch.cat(seen), prop.tokens


@pytest.mark.parametrize("kw", [{}, {"cross_recency": True}, {"cross_newest": True},
                                {"cross_newest": True, "cross_gate": True}, {"cross_attention": False}],
                         ids=["glide", "recency", "newest", "gated-newest", "vanilla"])
def test_training_forward_equals_inference_drafting(tiny, kw):
    draft = _draft(tiny, **kw)
    rec = generate_records(tiny, [[5, 6, 7, 8]], [1], max_new_tokens=24)[0]
    n = len(rec)
    size = GAMMA + 1
    checked = 0
    for root in range(size, n - GAMMA):
        offset = (-root) % size  # root starts a block: (root + offset) % size == 0
        b = collate([rec], block=size, offset=offset)
        with torch.no_grad():
            h_train = draft(b.ids, b.pos, b.kv, b.mask)[0, root:root + GAMMA]  # [GAMMA, H]
        # inference feeds the drafted tokens; on the target's path they equal the record's next inputs
        h_inf, tokens = _propose_hidden(draft, tiny, rec.ids.tolist(), root)
        fed = [int(t) for t in rec.ids[root + 1:root + GAMMA]]
        steps = 1 + next((i for i in range(GAMMA - 1) if tokens[i] != fed[i]), GAMMA - 1)
        # training reads the fp16 copy of the target KV, inference the live fp32 cache: fp16 rounding only
        torch.testing.assert_close(h_inf[:steps], h_train[:steps], atol=2e-3, rtol=2e-3)
        checked += steps
    assert checked >= n - GAMMA - size  # every root compared at least at depth 0


def test_multi_layer_context_tokens_see_more_at_inference(tiny):
    """Known, documented mismatch for drafts of 2+ layers: at inference a context token's layer-1 output (read by
    layer 2's self-attention) has seen the target cache up to itself, in training only up to its block's start.
    A one-layer draft (the default) is exact (test above): its self-attention reads embeddings only."""
    draft = _draft(tiny, n_layers=2)
    rec = generate_records(tiny, [[5, 6, 7, 8]], draft.cfg.target_layers, max_new_tokens=24)[0]
    root = 12
    b = collate([rec], block=GAMMA + 1, offset=(-root) % (GAMMA + 1))
    with torch.no_grad():
        h_train = draft(b.ids, b.pos, b.kv, b.mask)[0, root]
    h_inf, _ = _propose_hidden(draft, tiny, rec.ids.tolist(), root)
    assert not torch.allclose(h_inf[0], h_train, atol=1e-3)
