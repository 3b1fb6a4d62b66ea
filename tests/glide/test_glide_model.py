"""GliDe draft architecture on tiny Llama targets (GQA and MHA): cross-attention, masks, rotary, heads.

The strongest check: the draft's CrossAttention, given the target's last-layer q/o weights and the target's own
normalised hidden states, reproduces the target's last self-attention output from the target's KV cache. That
pins down the rotary convention and theta, the GQA head grouping and the score scaling against transformers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from redraft.glide.config import GlideConfig
from redraft.glide.network import CrossAttention, DraftCache, build_draft, init_from_target
from redraft.glide.positions import block_mask, prefix_mask, target_rope

GEOMETRIES = {"gqa": dict(num_attention_heads=4, num_key_value_heads=2),
              "mha": dict(num_attention_heads=4, num_key_value_heads=4)}


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def target(request):
    return build_tiny("llama", "sdpa", seed=3, rope_theta=50000.0, **GEOMETRIES[request.param])


def _cache_of(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, output_hidden_states=True)
    return cache, out


def test_config_mirrors_target(target):
    cfg = GlideConfig.from_target(target.config, n_layers=1)
    c = target.config
    assert (cfg.target_n_heads, cfg.target_n_kv_heads) == (c.num_attention_heads, c.num_key_value_heads)
    assert cfg.head_dim == c.hidden_size // c.num_attention_heads and cfg.target_layers == [c.num_hidden_layers - 1]
    assert GlideConfig.from_target(c, n_layers=2).target_layers == [0, 1]
    with pytest.raises(ValueError):
        GlideConfig.from_target(c, n_layers=3)
    assert cfg.rope_theta == 50000.0


def test_cross_attention_shapes_and_projections(target):
    cfg = GlideConfig.from_target(target.config)
    ca = CrossAttention(cfg)
    H, D = cfg.hidden_size, cfg.head_dim
    assert ca.q_proj.weight.shape == (cfg.target_n_heads * D, H) and ca.o_proj.weight.shape == (H, cfg.target_n_heads * D)
    assert not hasattr(ca, "k_proj") and not hasattr(ca, "v_proj")
    B, S, T = 2, 3, 7
    x = torch.randn(B, S, H)
    k, v = torch.randn(B, cfg.target_n_kv_heads, T, D), torch.randn(B, cfg.target_n_kv_heads, T, D)
    pos = torch.arange(T, T + S)[None].expand(B, S)
    draft = build_draft(target, cfg)
    cos, sin = draft.rotary(pos, x.dtype)
    assert cos.shape == (B, 1, S, D)
    out = ca(x, cos, sin, k, v)
    assert out.shape == (B, S, H)
    # GQA: equal to the same attention with every KV head repeated for its group of query heads
    g = cfg.target_n_heads // cfg.target_n_kv_heads
    q = ca.q_proj(x).view(B, S, cfg.target_n_heads, D).transpose(1, 2)
    from redraft.glide.positions import apply_rope

    q = apply_rope(q, cos, sin)
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    att = torch.softmax(q @ kr.transpose(-1, -2) / D ** 0.5, -1) @ vr
    want = ca.o_proj(att.transpose(1, 2).reshape(B, S, -1))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_cross_attention_mask_rows_without_keys_are_zero(target):
    cfg = GlideConfig.from_target(target.config)
    ca = CrossAttention(cfg)
    draft = build_draft(target, cfg)
    S = 10
    x = torch.randn(1, S, cfg.hidden_size)
    k = torch.randn(1, cfg.target_n_kv_heads, S, cfg.head_dim)
    cos, sin = draft.rotary(torch.arange(S)[None], x.dtype)
    mask = block_mask(S, S, 5)[None, None]
    out = ca(x, cos, sin, k, k.clone(), mask)
    assert torch.isfinite(out).all()
    assert out[0, :5].abs().max() == 0 and out[0, 5:].abs().min() > 0
    # a masked key has no influence: changing keys the mask hides leaves the output unchanged
    k2 = k.clone()
    k2[:, :, 5:] += 10.0
    torch.testing.assert_close(ca(x, cos, sin, k2, k.clone(), mask), out)


def test_block_mask_blocks_of_five():
    m = block_mask(12, 12, 5)
    for i in range(12):
        for j in range(12):
            assert bool(m[i, j]) == (j // 5 < i // 5)
    assert not m[:5].any() and m[5, :5].all() and not m[5, 5:].any() and m[9, :5].all() and not m[9, 5]
    assert m[10, :10].all() and not m[10, 10:].any()
    shifted = block_mask(12, 12, 5, offset=2)  # blocks [0,3), [3,8), [8,13)
    assert not shifted[2].any() and shifted[3, :3].all() and not shifted[3, 3] and shifted[8, :8].all()


def test_prefix_mask():
    m = prefix_mask(torch.tensor([3, 6, 7, 8]), 7)
    assert m.shape == (4, 7)
    assert m[0].tolist() == [True] * 3 + [False] * 4
    assert m[1].tolist() == [True] * 6 + [False]
    assert m[2].all() and m[3].all()


def test_rotary_uses_the_targets_theta(target):
    draft = build_draft(target, GlideConfig.from_target(target.config))
    D = draft.cfg.head_dim
    want = 1.0 / (50000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    torch.testing.assert_close(draft.rotary.inv_freq, want)
    torch.testing.assert_close(draft.rotary.inv_freq, target.model.rotary_emb.inv_freq.float())
    wrong = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    assert not torch.allclose(draft.rotary.inv_freq, wrong)
    pos = torch.arange(20)[None]
    cos, sin = draft.rotary(pos, torch.float32)
    tcos, tsin = target.model.rotary_emb(torch.zeros(1), pos)
    torch.testing.assert_close(cos[:, 0], tcos)
    torch.testing.assert_close(sin[:, 0], tsin)


def test_scaled_rope_type_follows_transformers():
    model = build_tiny("llama", "sdpa", seed=3, rope_parameters={"rope_theta": 20000.0, "rope_type": "linear",
                                                                   "factor": 4.0})
    inv, scale = target_rope(model.config)
    torch.testing.assert_close(inv, model.model.rotary_emb.inv_freq.float())
    assert scale == model.model.rotary_emb.attention_scaling


def test_cross_attention_reproduces_the_targets_last_attention(target):
    """Target q_proj/o_proj + the target's normalised hidden + its cached K/V = the target's own attention output."""
    ids = [5, 17, 33, 2, 80, 41, 9, 60]
    cache, out = _cache_of(target, ids)
    last = target.model.layers[-1]
    captured = {}

    def grab(module, args, output):
        captured["o"] = output[0]

    hook = last.self_attn.register_forward_hook(grab)
    with torch.no_grad():
        target(input_ids=torch.tensor([ids]))
    hook.remove()
    cfg = GlideConfig.from_target(target.config)
    draft = build_draft(target, cfg)
    ca = CrossAttention(cfg)
    ca.q_proj.weight.data.copy_(last.self_attn.q_proj.weight)
    ca.o_proj.weight.data.copy_(last.self_attn.o_proj.weight)
    x = last.input_layernorm(out.hidden_states[-2])  # input of the last layer's attention
    S = len(ids)
    cos, sin = draft.rotary(torch.arange(S)[None], x.dtype)
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]  # the target sees itself too
    layer = cache.layers[cfg.target_layers[0]]
    with torch.no_grad():
        got = ca(x, cos, sin, layer.keys, layer.values, causal)
    torch.testing.assert_close(got, captured["o"], atol=1e-5, rtol=1e-4)


def test_incremental_decoding_equals_full_forward(target):
    """Cached one-token-at-a-time draft steps give the same hidden states as one masked full pass."""
    cfg = GlideConfig.from_target(target.config)
    draft = build_draft(target, cfg)
    init_from_target(draft, target)
    ids = [3, 9, 27, 81, 50, 7, 11, 4, 66, 12]
    cache_t, _ = _cache_of(target, ids)
    n_vis = 6
    layer = cache_t.layers[cfg.target_layers[0]]
    kv = [(layer.keys[:, :, :n_vis], layer.values[:, :, :n_vis])]
    pos = torch.arange(len(ids))
    with torch.no_grad():
        full = draft(torch.tensor([ids]), pos[None], kv, prefix_mask(pos, n_vis)[None, None])
        dc = DraftCache(cfg.n_layers)
        part = [draft(torch.tensor([ids[:4]]), pos[None, :4], kv, prefix_mask(pos[:4], n_vis)[None, None], dc)]
        for i in range(4, len(ids)):
            part.append(draft(torch.tensor([[ids[i]]]), pos[None, i:i + 1], kv,
                              prefix_mask(pos[i:i + 1], n_vis)[None, None], dc))
    torch.testing.assert_close(torch.cat(part, 1), full, atol=1e-5, rtol=1e-5)
    assert dc.length == len(ids)
    dc.crop(5)
    assert dc.length == 5 and dc.keys[0].shape[2] == 5


def test_embeddings_and_head_are_the_targets_and_frozen(target):
    draft = build_draft(target, GlideConfig.from_target(target.config))
    assert draft.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert draft.head_weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    names = [n for n, _ in draft.named_parameters()]
    assert not any("embed" in n or "head" in n for n in names)
    assert "embed_weight" not in draft.state_dict() and "head_weight" not in draft.state_dict()


def test_vanilla_draft_has_no_cross_attention(target):
    cfg = GlideConfig.from_target(target.config, cross_attention=False)
    draft = build_draft(target, cfg)
    assert all(layer.cross_attn is None for layer in draft.layers)
    glide = build_draft(target, GlideConfig.from_target(target.config))
    extra = 2 * cfg.hidden_size * cfg.target_n_heads * cfg.head_dim + cfg.hidden_size
    assert glide.n_trainable - draft.n_trainable == extra
    h = draft(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    assert h.shape == (1, 3, cfg.hidden_size)


def test_reduced_vocabulary_head(target):
    draft = build_draft(target, GlideConfig.from_target(target.config))
    ids = torch.tensor([2, 5, 11, 40, 77])
    draft.set_vocab(ids)
    h = torch.randn(3, draft.cfg.hidden_size)
    logits = draft.logits(h)
    assert logits.shape == (3, 5)
    torch.testing.assert_close(logits, h @ target.get_output_embeddings().weight[ids].T)
    assert set(draft.to_token_ids(logits.argmax(-1)).tolist()) <= set(ids.tolist())
    assert draft.to_head_index(torch.tensor([5, 6, 77, -100])).tolist() == [1, -100, 4, -100]
    with pytest.raises(ValueError):
        draft.set_vocab(torch.tensor([1000]))
    draft.set_vocab(None)
    assert draft.logits(h).shape == (3, target.config.vocab_size)


def test_init_from_target_starts_as_the_vanilla_draft(target):
    """Cross-attention o_proj starts at zero (q_proj from the read layer): GliDe == vanilla until trained."""
    glide = build_draft(target, GlideConfig.from_target(target.config))
    vanilla = build_draft(target, GlideConfig.from_target(target.config, cross_attention=False))
    init_from_target(glide, target)
    init_from_target(vanilla, target)
    last = target.model.layers[-1]
    assert torch.equal(glide.layers[0].cross_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(glide.layers[0].self_attn.k_proj.weight, target.model.layers[0].self_attn.k_proj.weight)
    ids = [4, 8, 15, 16, 23, 42]
    cache, _ = _cache_of(target, ids)
    layer = cache.layers[-1]
    pos = torch.arange(6)
    with torch.no_grad():
        a = glide(torch.tensor([ids]), pos[None], [(layer.keys, layer.values)], prefix_mask(pos, 6)[None, None])
        b = vanilla(torch.tensor([ids]), pos[None])
    torch.testing.assert_close(a, b)


def test_cross_recency_bias_weights_keys_by_distance(target):
    """With scores zeroed (q_proj = 0), head h weighs visible key j by exp(-s_h * (p - j)): the ALiBi bias."""
    cfg = GlideConfig.from_target(target.config, cross_recency=True)
    ca = CrossAttention(cfg)
    draft = build_draft(target, cfg)
    torch.nn.init.zeros_(ca.q_proj.weight)
    S, T = 7, 7
    pos = torch.arange(S)[None]
    x = torch.randn(1, S, cfg.hidden_size)
    k = torch.randn(1, cfg.target_n_kv_heads, T, cfg.head_dim)
    v = torch.randn(1, cfg.target_n_kv_heads, T, cfg.head_dim)
    cos, sin = draft.rotary(pos, x.dtype)
    mask = block_mask(S, T, 3)[None, None]
    captured = {}
    ca.o_proj.register_forward_hook(lambda m, a, o: captured.setdefault("attn", a[0]))
    out = ca(x, cos, sin, k, v, mask, pos)
    assert torch.isfinite(out).all() and out[0, :3].abs().max() == 0  # first block sees nothing
    attn = captured["attn"].view(1, S, ca.n, ca.d)  # per-head attention outputs before o_proj
    slopes = torch.nn.functional.softplus(ca.recency.detach())
    assert torch.all(slopes[:-1] > slopes[1:])  # ALiBi's geometric slopes, steepest first
    group = ca.n // ca.nk
    for h in range(ca.n):
        for p in range(3, S):
            vis = torch.nonzero(mask[0, 0, p]).flatten()
            w = torch.softmax(-slopes[h] * (p - vis).float(), 0)
            want = (w[:, None] * v[0, h // group, vis]).sum(0)
            torch.testing.assert_close(attn[0, p, h], want, atol=1e-5, rtol=1e-4)


def test_cross_recency_is_saved_and_the_draft_stays_lossless(target, tmp_path):
    from conftest import plain_greedy

    from redraft.decoding.engine import Engine
    from redraft.drafters.glide import GlideDrafter
    from redraft.glide.checkpoint import load_draft, save_draft

    draft = build_draft(target, GlideConfig.from_target(target.config, cross_recency=True))
    torch.nn.init.normal_(draft.layers[0].cross_attn.o_proj.weight, std=0.3)
    with torch.no_grad():
        draft.layers[0].cross_attn.recency.add_(0.25)
    save_draft(tmp_path, draft, target)
    back = load_draft(tmp_path, target)
    assert back.cfg.cross_recency and torch.equal(back.layers[0].cross_attn.recency, draft.layers[0].cross_attn.recency)
    d = GlideDrafter(back, None, gamma=4)
    engine = Engine(target, [d])
    prompt = [5, 9, 2, 7, 7, 1, 30, 4]
    assert engine.generate(prompt, 40).output_ids == plain_greedy(target, prompt, 40)
