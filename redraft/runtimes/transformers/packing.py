"""One forward over several sequences' rows: linear layers over all rows at once, attention per sequence.

Each sequence keeps its own transformers ``DynamicCache`` (batch size 1). A packed forward runs batch size 1 over
the new rows of every participating sequence laid one after another, so the projections, MLPs and LM head see all
rows in one matrix product (where the step's cost is); attention runs sequence by sequence, each participant's rows
against its own cache and its own causal or token-tree mask, so its cost is the sum of each sequence's own and no row
can see another sequence's keys. This is the shape of vLLM's and SGLang's varlen ("packed") attention, run here
through transformers' attention interface: :func:`enable_packed_attention` registers an attention function that
does exactly what the model's own does unless the forward carries a :class:`PackedStep`, and the forward's cache
(:class:`SplitCache`) appends each sequence's new keys/values to that sequence's own cache. Position ids come from
each sequence's own positions, so each row is computed as in a forward of its sequence alone, up to rounding
(kernels round differently by shape). See docs/architecture.md, "Continuous batching", for why per-sequence caches
rather than paged attention.

Functions over tensors, plus the process-wide registration :func:`enable_packed_attention` makes with
transformers; the scheduling is :mod:`redraft.runtimes.transformers.batching`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from redraft.io.loading import PACKED_PREFIX

STEP_KWARG = "redraft_packed_step"
PACKABLE = ("sdpa", "eager")  # attention functions that take each call's 4D mask and keys as given


@dataclass
class Block:
    """One sequence's part of a packed forward.

    Attributes:
        n_cached: tokens in the sequence's own KV cache before the forward (L).
        positions: LongTensor [S] (or [1, S]): position id of each new row.
        mask: additive FloatTensor [1, 1, S, L + S] (the sequence's own tree/causal mask, as
            :meth:`HFTarget.forward` takes it) or None for plain causal attention over the cache and the new rows.
    """

    n_cached: int
    positions: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.positions.shape[-1])


def own_mask(block: Block, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask one sequence's rows attend with inside a packed forward.

    Args:
        block: the sequence's part.
        dtype: the model's dtype (0 = attend, ``finfo(dtype).min`` = blocked, as :func:`tree_attention_mask`).
    Returns:
        the block's own mask in ``dtype``, or for causal rows an additive FloatTensor [1, 1, S, L + S] (every cached
        column open, the new rows causal), or None for one causal row (it sees everything).
    """
    if block.mask is not None:
        return block.mask.to(dtype)
    s, n = block.rows, block.n_cached
    if s == 1:
        return None
    mask = torch.zeros(s, n + s, dtype=dtype)
    mask[:, n:].masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), torch.finfo(dtype).min)
    return mask[None, None]


def causal_positions(n_cached: int, rows: int) -> torch.Tensor:
    """LongTensor [rows]: n_cached .. n_cached + rows - 1 (plain decoding's positions for rows after the cache)."""
    return torch.arange(n_cached, n_cached + rows, dtype=torch.long)


class PackedStep:
    """What one packed forward's attention layers need: where each sequence's rows are, its mask, and per layer its
    keys/values (its cache after this forward's rows were appended).

    Args:
        blocks: the participants in packing order.
        dtype: the model's dtype (for the masks).
    """

    def __init__(self, blocks: Sequence[Block], dtype: torch.dtype) -> None:
        self.rows = [b.rows for b in blocks]
        self.masks = [own_mask(b, dtype) for b in blocks]
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def attend(self, module, query: torch.Tensor, attention, kwargs: dict) -> torch.Tensor:
        """Attention of every sequence's rows over its own keys/values.

        Args:
            module: the attention layer (its ``layer_idx`` names the cache layer).
            query: FloatTensor [1, H, Q, D], Q = sum of the participants' rows.
            attention: the model's own attention function (transformers' interface), run once per sequence.
            kwargs: the keywords it takes (scaling, dropout, ...).
        Returns:
            FloatTensor [1, Q, H, D] (the attention interface's output layout).
        """
        outs, at = [], 0
        for (keys, values), mask, s in zip(self.kv[module.layer_idx], self.masks, self.rows, strict=True):
            out, _ = attention(module, query[:, :, at:at + s], keys, values, mask, **kwargs)
            outs.append(out)
            at += s
        return torch.cat(outs, dim=1)


class SplitCache:
    """The cache a packed forward passes to the model: each layer's new keys/values ([1, H_kv, Q, D]) are split by
    sequence and appended to each participant's own ``DynamicCache``; the full keys/values of each go to the
    :class:`PackedStep`. Has the ``Cache.update`` interface the attention layers call.

    Args:
        caches: per participant, its own cache.
        step: the forward's :class:`PackedStep`.
    """

    is_compileable = False

    def __init__(self, caches: Sequence, step: PackedStep) -> None:
        self.caches, self.step = list(caches), step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        parts, at = [], 0
        for cache, s in zip(self.caches, self.step.rows, strict=True):
            parts.append(cache.update(key_states[:, :, at:at + s], value_states[:, :, at:at + s], layer_idx))
            at += s
        self.step.kv[layer_idx] = parts
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def enable_packed_attention(model) -> None:
    """Let ``model`` run packed forwards: its attention implementation becomes a wrapper that calls the model's own
    function unchanged (same arguments, same result bit for bit) unless the forward carries a :class:`PackedStep`,
    and then runs it once per sequence. Its mask function stays the model's own. Idempotent.

    Args:
        model: a transformers causal LM whose attention runs through transformers' attention interface with
            ``sdpa`` or ``eager`` (``model.config._attn_implementation``). This registers process-wide attention
            and mask functions under a new name and switches the model's config to it.
    Raises:
        ValueError: the model's attention implementation is not ``sdpa`` or ``eager``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = str(model.config._attn_implementation)
    if base.startswith(PACKED_PREFIX):
        return
    if base not in PACKABLE:
        raise ValueError(f"attn_implementation {base!r}: packed forwards run {' or '.join(PACKABLE)} attention "
                         "(kernels that read the mask as padding and the positions as packed sequences do not apply)")

    def own(module):
        if base == "eager":  # the modeling file's own function, as transformers' lookup falls back to it
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, **kwargs):
        step = kwargs.pop(STEP_KWARG, None)
        if step is None:
            return own(module)(module, query, key, value, attention_mask, **kwargs)
        return step.attend(module, query, own(module), kwargs), None

    name = PACKED_PREFIX + base
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


def drop_after(cache, n: int) -> None:
    """Keep only the first ``n`` entries of every layer of ``cache`` (a ``DynamicCache``; layers may differ in
    length after a forward that failed part way)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.shape[-2] > n:
            layer.keys, layer.values = keys[..., :n, :], layer.values[..., :n, :]


def logit_rows(blocks_rows: Sequence[int], wanted: Sequence[range]) -> list[int]:
    """Global row indices of a packed forward whose logits are needed.

    Args:
        blocks_rows: per participant, its rows in the packed forward, in packing order.
        wanted: per participant, the indices (within its own rows) that need logits.
    Returns:
        the global indices, ascending (participants' wanted rows in packing order).
    """
    out, base = [], 0
    for s, want in zip(blocks_rows, wanted, strict=True):
        out.extend(base + j for j in want)
        base += s
    return out


def packed_forward(model, caches: Sequence, blocks: Sequence[Block], ids: Sequence[Sequence[int]],
                   wanted: Sequence[range], *, cache_kwarg: str = "cache") -> list[torch.Tensor]:
    """ONE forward (batch size 1) over several sequences' new rows; each sequence's new KV entries are appended to
    its own cache.

    Args:
        model: the transformers causal LM, after :func:`enable_packed_attention` (its forward takes
            ``position_ids`` and ``logits_to_keep`` as an index tensor).
        caches: per participant, its own ``DynamicCache`` holding exactly ``blocks[i].n_cached`` tokens.
        blocks: per participant, its rows' positions and own mask (:class:`Block`).
        ids: per participant, the token ids of its new rows (len = ``blocks[i].rows``).
        wanted: per participant, the indices (within its new rows) whose logits are needed (may be empty).
        cache_kwarg: the forward keyword for the cache (:func:`redraft.runtimes.transformers.target.cache_kwarg`).
    Returns:
        per participant, FloatTensor [len(wanted[i]), vocab] in the model dtype on the CPU.
    Raises:
        ValueError: the model's attention was not wrapped by :func:`enable_packed_attention`.
        Whatever the model raises; each cache is then cut back to its ``n_cached`` entries.
    """
    if not str(model.config._attn_implementation).startswith(PACKED_PREFIX):
        raise ValueError("packed_forward: call enable_packed_attention(model) first")
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    rows = [b.rows for b in blocks]
    keep = logit_rows(rows, wanted)
    flat = [int(t) for part in ids for t in part]
    step = PackedStep(blocks, dtype)
    if dev.type != "cpu":
        step.masks = [m if m is None else m.to(dev) for m in step.masks]
    with torch.inference_mode():  # the caches' tensors are inference tensors, as HFTarget.forward makes them
        try:
            out = model(input_ids=torch.tensor([flat], dtype=torch.long, device=dev),
                        position_ids=torch.cat([b.positions.reshape(-1) for b in blocks])[None].to(dev),
                        # a prepared 4D mask makes transformers skip building one; the rows' own masks are the step's
                        attention_mask=torch.zeros(1, 1, len(flat), 1, dtype=dtype, device=dev), use_cache=True,
                        logits_to_keep=torch.tensor(keep or [0], dtype=torch.long, device=dev),
                        **{cache_kwarg: SplitCache(caches, step), STEP_KWARG: step})
        except BaseException:
            for cache, b in zip(caches, blocks, strict=True):  # layers before the failure had the rows appended
                drop_after(cache, b.n_cached)
            raise
        logits = out.logits[0].cpu()
    parts, at = [], 0
    for want in wanted:
        parts.append(logits[at:at + len(want)])
        at += len(want)
    return parts
