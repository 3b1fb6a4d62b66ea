"""GliDe draft configuration: the geometry of a draft's trainable part, mirrored from its target's config.

Shapes and names follow :mod:`redraft.glide.network`: H hidden size, D head_dim (shared with the target), L_D draft
layers, L_T target layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from redraft.glide.positions import rope_params


@dataclass
class GlideConfig:
    """Everything needed to rebuild a draft's trainable part (the target supplies embeddings, head and rope).

    Attributes:
        hidden_size: H, equal to the target's (the embeddings and LM head are shared).
        intermediate_size: MLP width.
        n_layers: L_D draft layers.
        n_heads, n_kv_heads: draft self-attention heads (GQA when n_kv_heads < n_heads).
        head_dim: D, equal to the target's (one rotary table serves both attentions).
        target_n_layers: L_T.
        target_n_heads, target_n_kv_heads: the target's query and KV heads (cross-attention geometry).
        vocab_size: rows of the target's LM head.
        rms_norm_eps: RMSNorm epsilon (the target's).
        rope_theta, rope_type: the target's rope settings, recorded for the reader; the frequencies themselves
            are always recomputed from the target's config (:func:`redraft.glide.positions.target_rope`).
        cross_attention: False = vanilla draft (no cross-attention sub-layer).
        head_vocab: size of the reduced-vocabulary head, 0 = full head.
        block_size: training block size of the cross-attention mask (5 in the paper).
        cross_recency: add a learned per-head recency bias to the cross-attention scores (ours, not in the
            paper; see :class:`redraft.glide.network.CrossAttention`). False = the paper's cross-attention.
        cross_newest: also feed the newest visible target K/V entry (rotary removed) through a linear map into
            the cross-attention's output (ours, not in the paper; see :func:`redraft.glide.network.newest_entry`).
        cross_gate: scale the cross-attention's output to a learned per-channel size, zero at the start (RMSNorm
            with a zero-initialised gain; ours, see :class:`redraft.glide.network.CrossAttention`).
    """

    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    target_n_layers: int
    target_n_heads: int
    target_n_kv_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    cross_attention: bool = True
    head_vocab: int = 0
    block_size: int = 5
    cross_recency: bool = False
    cross_newest: bool = False
    cross_gate: bool = False

    @property
    def target_layers(self) -> list[int]:
        """Target layer read by each draft layer: ``L_T - L_D + i`` (paper section 3.1)."""
        return [self.target_n_layers - self.n_layers + i for i in range(self.n_layers)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GlideConfig:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_target(cls, tcfg, *, n_layers: int = 1, cross_attention: bool = True, head_vocab: int = 0,
                    intermediate_size: int | None = None, block_size: int = 5,
                    cross_recency: bool = False, cross_newest: bool = False,
                    cross_gate: bool = False) -> GlideConfig:
        """Draft geometry mirroring a Llama-style target config (heads, head_dim, norm eps, rope).

        Raises:
            ValueError: ``n_layers`` outside 1..L_T, or a target without the Llama attention fields.
        """
        n_t = int(tcfg.num_hidden_layers)
        if not 1 <= n_layers <= n_t:
            raise ValueError(f"a GliDe draft needs 1 <= n_layers <= {n_t} (target layers), got {n_layers}")
        heads = int(tcfg.num_attention_heads)
        kv = int(getattr(tcfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads)
        theta, rtype = rope_params(tcfg)
        return cls(hidden_size=int(tcfg.hidden_size),
                   intermediate_size=int(intermediate_size or tcfg.intermediate_size),
                   n_layers=n_layers, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, target_n_layers=n_t,
                   target_n_heads=heads, target_n_kv_heads=kv, vocab_size=int(tcfg.vocab_size),
                   rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-5)), rope_theta=theta, rope_type=rtype,
                   cross_attention=cross_attention, head_vocab=int(head_vocab), block_size=block_size,
                   cross_recency=cross_recency, cross_newest=cross_newest, cross_gate=cross_gate)
