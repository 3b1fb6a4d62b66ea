"""The GliDe draft model: L_D layers of self-attention -> cross-attention (to the target's KV cache) -> MLP.

GliDe (Du et al. 2024, "GliDe with a CaPE", arXiv 2402.02082, section 3.1): a small draft model whose layers
also attend to the *target's* key/value cache of the verified prefix. Draft layer i reads the target's layer
``L_T - L_D + i`` (a one-layer draft reads the last layer). The cross-attention owns only a query projection
(draft hidden -> target heads x target head_dim) and an output projection; its keys and values are the target's
cached K/V, already rotary-encoded, with GQA heads shared the way the target shares them. The query gets rotary
at its absolute position with the **target's** rope settings (the official code hard-codes base 10000, which is
wrong for targets such as SmolLM2 whose theta is 100000).

Embeddings and the LM head are the target's, frozen, held as non-persistent buffers (never saved in a draft
checkpoint). An optional reduced-vocabulary head keeps only the rows of chosen token ids (the most frequent ones):
the draft then never proposes a token outside that subset, and the head costs N/vocab of the full one.

With ``cross_attention=False`` the same class is the *vanilla* baseline draft: self-attention -> MLP only.

Shapes in this file: B batch, S query tokens, T target-cache tokens, P draft-cache tokens, H hidden size,
n/nk draft query/KV heads, Ht/Hkt target query/KV heads, D head_dim (shared with the target). All float tensors
are the draft dtype (fp32 by default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redraft.glide.config import GlideConfig
from redraft.glide.positions import Rotary, apply_rope, rotate_half, target_rope

# ---- layers ---------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama RMSNorm: x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class DraftCache:
    """The draft's own self-attention KV cache (batch 1 at inference): per layer keys/values [1, nk, P, D]."""

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, nk, S, D] to ``layer``; return that layer's full keys and values [B, nk, P + S, D]."""
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]
        self.length = min(self.length, length)


class SelfAttention(nn.Module):
    """Causal GQA self-attention over the draft's own tokens (Llama layout, no biases)."""

    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        self.n, self.nk, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nk * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nk * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DraftCache | None = None,
                layer: int = 0) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]. With ``cache``, the S new tokens follow its P cached ones."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n, self.d).transpose(1, 2)  # [B, n, S, D]
        k = self.k_proj(x).view(B, S, self.nk, self.d).transpose(1, 2)  # [B, nk, S, D]
        v = self.v_proj(x).view(B, S, self.nk, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=True)
        else:
            k, v = cache.update(layer, k, v)  # [B, nk, P + S, D]
            mask = None
            if S > 1:  # new token i sees the P cached ones and new tokens <= i
                P = k.shape[2] - S
                mask = torch.ones(S, P + S, dtype=torch.bool, device=x.device).tril(P)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.n * self.d))


class CrossAttention(nn.Module):
    """Attention from draft queries to the target's cached K/V (paper section 3.1).

    Only ``q_proj`` (H -> Ht*D) and ``o_proj`` (Ht*D -> H) are parameters; keys and values come from the target's
    cache, already rotary-encoded at their own positions, so only the query is rotated here.

    With ``cfg.cross_recency`` (ours, not in the paper) each head h also has a learned slope s_h > 0 and its score
    for key position j from a query at position p gets ``-s_h * (p - j)`` added (ALiBi's linear bias, Press et al.
    2022, initialised with ALiBi's geometric slopes). Why: the newest visible target entry carries the freshest
    information, but which entry is newest depends on the draft depth (the block mask hides the last d entries
    from depth d), and rotary scores alone cannot express "the newest visible key" for every depth at once.

    With ``cfg.cross_gate`` (ours; docs/glide.md) the output goes through an RMSNorm whose per-channel gain starts at
    zero, so its size is a learned parameter in the residual stream's units (Flamingo's zero-initialised tanh gate,
    Alayrac et al. 2022, per channel). Why: without it, a draft trained from a zero o_proj ends with a
    cross-attention output far larger than the residual stream it is added to: Adam moves every o_proj weight by
    ~lr per step whatever the scale of its input, and the target's last-layer values are much larger than the
    draft's embeddings, so the branch swamps the token embedding it should refine (Measurements: docs/measurements.md#redraft-glide-network).
    """

    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        self.n, self.nk, self.d = cfg.target_n_heads, cfg.target_n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, cfg.hidden_size, bias=False)
        # cross_newest: [newest K | newest V] (2 x Hkt x D) -> H, added to the output (see newest_entry)
        self.newest = nn.Linear(2 * self.nk * self.d, cfg.hidden_size, bias=False) if cfg.cross_newest else None
        # cross_gate: output = g * rmsnorm(output), g zero at the start (see the class docstring)
        self.gate = None
        if cfg.cross_gate:
            self.gate = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            nn.init.zeros_(self.gate.weight)
        self.recency = None
        if cfg.cross_recency:
            slopes = 2.0 ** (-8.0 * torch.arange(1, self.n + 1) / self.n)  # ALiBi's slopes
            self.recency = nn.Parameter(torch.log(torch.expm1(slopes)))  # softplus^-1: softplus(param) = slope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, q_pos: torch.Tensor | None = None,
                newest: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-attend.

        Args:
            x: [B, S, H] normalised draft hidden states.
            cos, sin: [B, 1, S, D] rotary tables at the queries' absolute positions.
            k, v: [B, Hkt, T, D] target cache (GQA: each KV head serves Ht/Hkt query heads, as in the target);
                entry j is the target's position j.
            mask: BoolTensor broadcastable to [B, 1, S, T], True = attend; None = every query sees all T.
            q_pos: LongTensor [B, S] absolute query positions (needed only with the recency bias).
            newest: [B, S, 2*Hkt*D] each query's newest visible entry (:func:`newest_entry`), used with
                ``cfg.cross_newest``.
        Returns:
            [B, S, H]; a query that sees no key at all gets a zero output (no NaN).
        """
        B, S, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, S, self.n, self.d).transpose(1, 2), cos, sin)  # [B, Ht, S, D]
        if k.shape[2] == 0:
            return torch.zeros_like(x)
        attn_mask = mask
        if self.recency is not None:
            T = k.shape[2]
            dist = (q_pos[:, None, :, None] - torch.arange(T, device=q.device)[None, None, None, :]).clamp(min=0)
            dist = dist.to(q.dtype)
            bias = -F.softplus(self.recency)[None, :, None, None] * dist  # [B, Ht, S, T]
            # finite fill: a row with no visible key must not turn into NaN (it is zeroed below)
            attn_mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=attn_mask, enable_gqa=True)
        if mask is not None:
            o = o * mask.any(-1, keepdim=True).to(o.dtype)  # [B, 1, S, 1]: rows with no visible key -> 0
        out = self.o_proj(o.transpose(1, 2).reshape(B, S, self.n * self.d))
        if self.newest is not None and newest is not None:
            out = out + self.newest(newest)
        if self.gate is not None:
            out = self.gate(out)
        return out


def newest_entry(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, rotary: Rotary,
                 n_queries: int) -> torch.Tensor:
    """Each query's newest visible target entry: [K | V] with K's rotary undone, zero where nothing is visible.

    Why (ours; docs/glide.md): a linear probe on the target's last-layer K/V at the position just before the root
    predicts the token after the root 7 points better than the root's embedding alone, but softmax attention with
    rotary scores cannot single out "the newest visible key" (which one it is depends on the draft depth). Every
    visible set here is a prefix (block mask, prefix mask, or everything), so the newest entry is at index
    (visible count - 1). K is stored rotated at its own position; rotating back makes the feature position-free.

    Args:
        k, v: [B, Hkt, T, D] the target cache of the layer read.
        mask: BoolTensor broadcastable to [B, 1, S, T] of prefix rows, or None (every query sees all T).
        rotary: the draft's (= the target's) rotary tables.
        n_queries: S.
    Returns:
        [B, S, 2*Hkt*D] in k's dtype.
    """
    B, Hkt, T, D = k.shape
    if mask is None:
        count = torch.full((B, n_queries), T, dtype=torch.long, device=k.device)
    else:
        count = mask.expand(-1, -1, n_queries, T)[:, 0].sum(-1).expand(B, n_queries)  # [B, S]
    idx = (count - 1).clamp(min=0)  # [B, S]
    gather = idx[:, None, :, None].expand(B, Hkt, n_queries, D)
    kn, vn = k.gather(2, gather), v.gather(2, gather)  # [B, Hkt, S, D]
    cos, sin = rotary(idx, kn.dtype)  # [B, 1, S, D]
    s2 = rotary.scaling ** 2
    kn = (kn * cos - rotate_half(kn) * sin) / s2  # inverse rotation (cos^2 + sin^2 = scaling^2)
    feat = torch.cat((kn, vn), 1).transpose(1, 2).reshape(B, n_queries, 2 * Hkt * D)
    return feat * (count > 0)[..., None].to(feat.dtype)


class MLP(nn.Module):
    """SwiGLU MLP (Llama): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm block: x += self_attn(norm(x)); x += cross_attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: GlideConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.cross_attn = self.cross_layernorm = None
        if cfg.cross_attention:
            self.cross_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.cross_attn = CrossAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, target_kv=None, cross_mask=None, cache=None, layer=0, pos=None, newest=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        if self.cross_attn is not None and target_kv is not None:  # no target cache visible: contributes 0
            k, v = target_kv
            x = x + self.cross_attn(self.cross_layernorm(x), cos, sin, k, v, cross_mask, pos, newest)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- the draft model ------------------------------------------------------------------------------------------------

class GlideDraft(nn.Module):
    """GliDe draft (or vanilla draft when ``cfg.cross_attention`` is False).

    Args:
        cfg: :class:`GlideConfig`.
        embed_weight: the target's input embeddings [vocab, H] (frozen; referenced, not copied).
        head_weight: the target's LM head [vocab, H] (frozen).
        inv_freq, rope_scaling: the target's rope (:func:`target_rope`).
        vocab_ids: LongTensor [N] token ids of a reduced-vocabulary head, or None for the full head.
    """

    def __init__(self, cfg: GlideConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 inv_freq: torch.Tensor, rope_scaling: float = 1.0, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(inv_freq, rope_scaling)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        self.vocab_ids: torch.Tensor | None = None
        self.set_vocab(vocab_ids)

    def set_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        """Use a reduced-vocabulary head over ``vocab_ids`` [N] (ascending unique ids), or None for the full head.

        The head's rows are copied once (N x H floats); the draft never proposes an id outside the subset.
        """
        if vocab_ids is None or len(vocab_ids) == 0:
            self.vocab_ids, self.sub_head = None, None
            self.cfg.head_vocab = 0
            return
        ids = torch.as_tensor(vocab_ids, dtype=torch.long).to(self.head_weight.device)
        if int(ids.min()) < 0 or int(ids.max()) >= self.head_weight.shape[0]:
            raise ValueError(f"vocabulary subset ids must lie in [0, {self.head_weight.shape[0]})")
        self.vocab_ids = ids
        self.sub_head = self.head_weight.index_select(0, ids).contiguous()  # [N, H]
        self.cfg.head_vocab = len(ids)

    @property
    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, target_kv: list | None = None,
                cross_mask: torch.Tensor | None = None, cache: DraftCache | None = None) -> torch.Tensor:
        """Run the draft layers.

        Args:
            ids: LongTensor [B, S] input token ids.
            pos: LongTensor [B, S] absolute positions (the same positions the target gives these tokens).
            target_kv: per draft layer a (keys, values) pair [B, Hkt, T, D] from target layer L_T - L_D + i;
                ignored by a vanilla draft; None = no target cache visible (the cross-attention adds 0).
            cross_mask: BoolTensor broadcastable to [B, 1, S, T] (True = attend), None = all visible.
            cache: the draft's self-attention cache (inference) or None (training: causal over the S tokens).
        Returns:
            FloatTensor [B, S, H]: final-normed hidden states (feed to :meth:`logits`).
        """
        x = F.embedding(ids, self.embed_weight)  # [B, S, H]
        cos, sin = self.rotary(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            kv = target_kv[i] if (target_kv is not None and self.cfg.cross_attention) else None
            newest = None
            if kv is not None and self.cfg.cross_newest and kv[0].shape[2] > 0:
                newest = newest_entry(kv[0].to(x.dtype), kv[1].to(x.dtype), cross_mask, self.rotary, ids.shape[1])
            x = layer(x, cos, sin, kv, cross_mask, cache, i, pos, newest)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V'] over the full vocabulary or the reduced head's N ids."""
        return hidden @ (self.sub_head if self.vocab_ids is not None else self.head_weight).T

    def to_token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map head indices (as returned by argmax/topk over :meth:`logits`) to token ids."""
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def to_head_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map token ids to head indices; ids outside a reduced head map to -100 (ignored by the loss)."""
        if self.vocab_ids is None:
            return token_ids
        lut = torch.full((self.head_weight.shape[0],), -100, dtype=torch.long, device=self.vocab_ids.device)
        lut[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=self.vocab_ids.device)
        return torch.where(token_ids >= 0, lut[token_ids.clamp(min=0)], torch.full_like(token_ids, -100))


def init_from_target(draft: GlideDraft, target) -> None:
    """Initialise the draft's trainable weights from the target (a cheap, better-than-random start).

    Draft layer i copies the self-attention, MLP and norms of target layer i (the first target layers, like the
    draft, work on token embeddings). Its cross-attention q_proj comes from target layer L_T - L_D + i (the layer
    whose K/V it reads: those queries were trained to match exactly these keys) and its o_proj starts at zero, so
    the draft starts as its vanilla counterpart and learns how much to take from the target's cache (the zero-
    gated start of Flamingo's cross-attention layers). The final norm is the target's. This is our choice, not the
    paper's (which trains from scratch on far more data than a CPU allows). Measured on SmolLM2 (docs/glide.md):
    copying o_proj as well made the last layer's large outputs swamp the draft and it learned slower than the
    vanilla draft; all layers copied from the last target layer started at a loss of 51 nats (random init: 17).
    """
    layers = target.base_model.layers
    with torch.no_grad():
        for i, li in enumerate(draft.cfg.target_layers):
            src, dst = layers[i], draft.layers[i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
            if dst.cross_attn is not None:
                read = layers[li]
                dst.cross_attn.q_proj.weight.copy_(read.self_attn.q_proj.weight)
                if dst.cross_attn.gate is not None:  # the zero gain gates the branch: o_proj may start as the target's
                    dst.cross_attn.o_proj.weight.copy_(read.self_attn.o_proj.weight)
                else:
                    dst.cross_attn.o_proj.weight.zero_()
                if dst.cross_attn.newest is not None:
                    dst.cross_attn.newest.weight.zero_()
                dst.cross_layernorm.weight.copy_(read.input_layernorm.weight)
        draft.norm.weight.copy_(target.base_model.norm.weight)


def build_draft(target, cfg: GlideConfig, vocab_ids: torch.Tensor | None = None) -> GlideDraft:
    """A draft for ``target`` (a transformers causal LM): frozen embeddings/head/rope taken from it.

    Raises:
        ValueError: the draft geometry does not fit the target (hidden size, head_dim, heads, vocab).
    """
    tcfg = target.config
    want = GlideConfig.from_target(tcfg, n_layers=cfg.n_layers, cross_attention=cfg.cross_attention,
                                   cross_recency=cfg.cross_recency, cross_newest=cfg.cross_newest,
                                   cross_gate=cfg.cross_gate)
    for f in ("hidden_size", "head_dim", "target_n_layers", "target_n_heads", "target_n_kv_heads", "vocab_size"):
        if getattr(cfg, f) != getattr(want, f):
            raise ValueError(f"draft {f}={getattr(cfg, f)} does not fit the target ({getattr(want, f)})")
    inv_freq, scaling = target_rope(tcfg)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    draft = GlideDraft(cfg, embed, head, inv_freq, scaling, vocab_ids)
    return draft.to(device=embed.device, dtype=embed.dtype)  # on the target's device (a GPU run drafts there)


__all__ = ["GlideDraft", "DraftCache", "CrossAttention", "newest_entry", "SelfAttention", "DraftLayer", "init_from_target",
           "build_draft"]
