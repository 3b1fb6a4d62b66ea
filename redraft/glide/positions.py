"""Where each token sits: the target's rotary tables for draft queries, and the cross-attention masks (which
target-cache positions a draft query may read, in training and at inference).

GliDe (arXiv 2402.02082, section 3.1): draft queries rotate with the **target's** rope settings, so they meet the
target's cached keys, already rotated at their own positions; the official code hard-codes base 10000, which is
wrong for targets such as SmolLM2 (theta 100000). Shapes: B batch, S query tokens, D head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

# ---- rotary position embedding (the target's settings) ------------------------------------------------------------

def rope_params(tcfg) -> tuple[float, str]:
    """(theta, rope type) from a transformers config: ``rope_parameters`` (v5) or ``rope_theta``/``rope_scaling``."""
    rp = getattr(tcfg, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"]), str(rp.get("rope_type", "default"))
    scaling = getattr(tcfg, "rope_scaling", None) or {}
    return float(getattr(tcfg, "rope_theta", 10000.0)), str(scaling.get("rope_type", scaling.get("type", "default")))


def target_rope(tcfg) -> tuple[torch.Tensor, float]:
    """The target's rotary inverse frequencies and cos/sin scaling.

    Default rope: inv_freq[i] = theta ** (-2i / D) with the target's theta (not a hard-coded 10000).
    Other static rope types (linear, llama3, yarn, ...) use transformers' own initialisers on the target config,
    so the draft's queries rotate exactly like the target's keys.

    Returns:
        (inv_freq FloatTensor [D/2] fp32, attention scaling float).
    Raises:
        ValueError: a rope type transformers does not know, or partial rotary.
    """
    theta, rtype = rope_params(tcfg)
    heads = int(tcfg.num_attention_heads)
    dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads)
    if float(getattr(tcfg, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise ValueError("targets with partial rotary embeddings are not supported")
    if rtype == "default":
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rtype not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rtype!r} of the target is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rtype](tcfg, None)
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D] rotated by cos/sin [B, 1, S, D] (the Llama "rotate half" convention)."""
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """cos/sin tables for absolute positions, from the target's inverse frequencies.

    Args:
        inv_freq: FloatTensor [D/2] (see :func:`target_rope`).
        scaling: multiplier applied to cos and sin (1.0 for default rope).
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos LongTensor [B, S] -> (cos, sin) each [B, 1, S, D] in ``dtype``."""
        freqs = pos[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


# ---- masks ----------------------------------------------------------------------------------------------------------

def block_mask(n_q: int, n_k: int | None = None, block: int = 5, offset: int = 0) -> torch.Tensor:
    """Training cross-attention mask: query i sees target KV j only if block(j) < block(i).

    block(i) = (i + offset) // block. This simulates the delayed cache at inference: the draft's root token at
    position n sees target KV [0, n), and the drafted tokens after it see no more (paper section 3.1).

    Returns:
        BoolTensor [n_q, n_k] (True = attend); n_k defaults to n_q. Rows of the first block are all False.
    """
    n_k = n_q if n_k is None else n_k
    bq = (torch.arange(n_q) + offset) // block
    bk = (torch.arange(n_k) + offset) // block
    return bk[None, :] < bq[:, None]


def prefix_mask(q_pos: torch.Tensor, n_visible: int) -> torch.Tensor:
    """Inference cross-attention mask: query at absolute position p sees target KV j < min(p, n_visible).

    Args:
        q_pos: LongTensor [S] absolute positions of the queries.
        n_visible: target-cache length (the verified prefix).
    Returns:
        BoolTensor [S, n_visible].
    """
    j = torch.arange(n_visible, device=q_pos.device)
    return j[None, :] < torch.clamp(q_pos, max=n_visible)[:, None]
