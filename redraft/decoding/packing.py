"""One forward over several sequences' rows: the combined KV cache, the block mask, splitting the result back.

Each sequence keeps its own transformers ``DynamicCache`` (batch size 1). A packed forward runs batch size 1 over
the new rows of every participating sequence laid one after another; its cache is a temporary one whose layers hold
the participants' cached keys/values concatenated along the sequence axis, and its additive 4D mask is
block-diagonal: a row sees only its own sequence's cached columns and its own sequence's new rows (with that
sequence's own causal or token-tree mask inside its block). Position ids come from each sequence's own positions,
so each row is computed as in a forward of its sequence alone, up to rounding (kernels round differently by shape).
After the forward the new keys/values (the last Q columns of every layer) are split per sequence and appended to
each sequence's own cache. This is the per-sequence-cache alternative to paged attention (vLLM's PagedAttention,
transformers' ``generate_batch``): see docs/architecture.md, "Continuous batching".

Pure functions over tensors; the scheduling is :mod:`redraft.decoding.batching`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


def block_mask(blocks: Sequence[Block], dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a packed forward: each block's rows see only their own block's columns.

    Column layout (the combined cache's): every block's cached columns in block order (K_total = sum of n_cached),
    then every block's new rows in block order (the model appends them to the combined cache).

    Args:
        blocks: the participants in packing order.
        dtype: the model's dtype (0 = attend, ``finfo(dtype).min`` = blocked, as :func:`tree_attention_mask`).
    Returns:
        FloatTensor [1, 1, Q, K_total + Q] of ``dtype``, Q = sum of rows.
    """
    q = sum(b.rows for b in blocks)
    k_total = sum(b.n_cached for b in blocks)
    blocked = torch.finfo(dtype).min
    mask = torch.full((q, k_total + q), blocked, dtype=dtype)
    r = c = 0
    for b in blocks:
        s, n = b.rows, b.n_cached
        if b.mask is None:
            mask[r:r + s, c:c + n] = 0
            new = torch.zeros(s, s, dtype=dtype).masked_fill_(torch.ones(s, s, dtype=torch.bool).triu(1), blocked)
        else:
            own = b.mask.reshape(s, n + s).to(dtype)
            mask[r:r + s, c:c + n] = own[:, :n]
            new = own[:, n:]
        mask[r:r + s, k_total + r:k_total + r + s] = new
        r, c = r + s, c + n
    return mask[None, None]


def causal_positions(n_cached: int, rows: int) -> torch.Tensor:
    """LongTensor [rows]: n_cached .. n_cached + rows - 1 (plain decoding's positions for rows after the cache)."""
    return torch.arange(n_cached, n_cached + rows, dtype=torch.long)


class SlotLayer:
    """A combined cache layer built once per packed forward: the participants' cached keys/values followed by room
    for the forward's new rows, which ``update`` writes in place (no second copy of the active KV, where a
    ``DynamicLayer`` would concatenate). Has the ``DynamicLayer`` interface the attention layers use.

    Args:
        keys, values: FloatTensors [1, H_kv, filled + room, D]; the first ``filled`` columns hold cached entries.
        filled: columns already holding entries.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        self.keys, self.values, self.filled = keys, values, filled
        self.is_initialized = True
        self.device = keys.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new rows ([1, H_kv, q, D]) after the filled columns; returns the keys/values so far."""
        q = key_states.shape[-2]
        if self.filled + q > self.keys.shape[-2]:
            raise ValueError(f"packed cache: {q} new rows do not fit the {self.keys.shape[-2] - self.filled} left")
        self.keys[:, :, self.filled:self.filled + q] = key_states
        self.values[:, :, self.filled:self.filled + q] = value_states
        self.filled += q
        return self.keys[:, :, :self.filled], self.values[:, :, :self.filled]

    def get_seq_length(self) -> int:
        return self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_max_length(self) -> int:
        return -1


def combined_cache(caches: Sequence, lengths: Sequence[int], room: int = 0):
    """A temporary ``DynamicCache`` holding the given caches' entries one after another along the sequence axis.

    Args:
        caches: per participant, its ``DynamicCache`` (batch size 1) or None when it holds nothing.
        lengths: per participant, the tokens its cache holds (a cache holding 0 contributes nothing).
        room: new rows the forward will append (written in place: :class:`SlotLayer`).
    Returns:
        a DynamicCache whose layer i holds keys/values [1, H_kv, sum(lengths) + room, D] (one copy of the active KV;
        the room uninitialised until the forward writes it), or an empty DynamicCache when every length is 0. The
        participants' caches are not changed.
    Raises:
        ValueError: caches with different numbers of layers.
    """
    from transformers import DynamicCache

    held = [c for c, n in zip(caches, lengths, strict=True) if n > 0]
    out = DynamicCache()
    if not held:
        return out
    n_layers = {len(c.layers) for c in held}
    if len(n_layers) != 1:
        raise ValueError(f"combined_cache: the caches hold different numbers of layers {sorted(n_layers)}")
    held_lengths = [n for n in lengths if n > 0]
    if any(c.layers[0].keys.shape[-2] != n for c, n in zip(held, held_lengths, strict=True)):
        raise ValueError("combined_cache: a cache does not hold the number of tokens given for it")
    total = sum(held_lengths)
    for i in range(n_layers.pop()):
        parts = []
        for kind in ("keys", "values"):
            first = getattr(held[0].layers[i], kind)
            shape = (*first.shape[:-2], total + room, first.shape[-1])
            buf = torch.empty(shape, dtype=first.dtype, device=first.device)
            at = 0
            for c in held:
                t = getattr(c.layers[i], kind)
                buf[:, :, at:at + t.shape[-2]] = t
                at += t.shape[-2]
            parts.append(buf)
        out.layers.append(SlotLayer(parts[0], parts[1], total))
    return out


def append_new_rows(combined, k_total: int, owners: Sequence, rows: Sequence[int]) -> None:
    """Append each participant's new keys/values (the last Q columns of ``combined``) to its own cache.

    Args:
        combined: the packed forward's cache after the forward: per layer [1, H_kv, k_total + Q, D].
        k_total: columns it held before the forward.
        owners: per participant, its own ``DynamicCache`` (entries appended with ``update``, which copies).
        rows: per participant, its new rows (Q = sum), in packing order.
    """
    for i, layer in enumerate(combined.layers):
        r = k_total
        for cache, s in zip(owners, rows, strict=True):
            cache.update(layer.keys[:, :, r:r + s], layer.values[:, :, r:r + s], i)
            r += s


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
        model: the transformers causal LM (its forward takes ``position_ids``, a 4D ``attention_mask`` and
            ``logits_to_keep`` as an index tensor).
        caches: per participant, its own ``DynamicCache`` holding exactly ``blocks[i].n_cached`` tokens.
        blocks: per participant, its rows' positions and own mask (:class:`Block`).
        ids: per participant, the token ids of its new rows (len = ``blocks[i].rows``).
        wanted: per participant, the indices (within its new rows) whose logits are needed (may be empty).
        cache_kwarg: the forward keyword for the cache (:func:`redraft.decoding.target.cache_kwarg`).
    Returns:
        per participant, FloatTensor [len(wanted[i]), vocab] in the model dtype on the CPU.
    """
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    rows = [b.rows for b in blocks]
    k_total = sum(b.n_cached for b in blocks)
    keep = logit_rows(rows, wanted)
    flat = [int(t) for part in ids for t in part]
    with torch.inference_mode():  # the caches' tensors are inference tensors, as HFTarget.forward makes them
        cache = combined_cache(caches, [b.n_cached for b in blocks], room=sum(rows))
        out = model(input_ids=torch.tensor([flat], dtype=torch.long, device=dev),
                    position_ids=torch.cat([b.positions.reshape(-1) for b in blocks])[None].to(dev),
                    attention_mask=block_mask(blocks, dtype).to(dev), use_cache=True,
                    logits_to_keep=torch.tensor(keep or [0], dtype=torch.long, device=dev), **{cache_kwarg: cache})
        append_new_rows(cache, k_total, caches, rows)
        logits = out.logits[0].cpu()
    parts, at = [], 0
    for want in wanted:
        parts.append(logits[at:at + len(want)])
        at += len(want)
    return parts
