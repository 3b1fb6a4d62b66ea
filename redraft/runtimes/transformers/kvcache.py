"""A KV cache whose layers grow in place: appending a forward's keys/values writes them into room kept at the end of
a buffer instead of concatenating a new tensor.

transformers' ``DynamicLayer`` appends with ``torch.cat``: every forward copies the layer's whole cache, so a
decode step at L cached tokens moves 2 x layers x L x kv heads x head dim values for one new row
(Measurements: docs/measurements.md#redraft-decoding-kvcache). :class:`GrowingLayer` keeps
each layer's keys and values in a buffer [1, H_kv, capacity, D] with ``keys``/``values`` the views of its first L
positions; an append that fits writes into the buffer, one that does not moves to a buffer with room for a quarter
more (amortised O(1) copies per token, as a growing array: CPython's list over-allocation). Everything that reads or
replaces ``keys``/``values`` as transformers' cache layers do (crop by slicing, gather by ``index_select``, a prefix
shared from elsewhere) still works: a layer writes in place only while ``keys`` is the view of its own buffer's
first positions, and otherwise moves its entries to a new buffer first.

Views handed out stay correct as long as their positions are not written again: :meth:`GrowingLayer.freeze` marks
the first n positions as shared (a prefix-cache entry holds views of them), and a later append that would write
into them (after a crop below n) moves the layer to a new buffer first (copy on write).

Attention reads the views as strided tensors; the results are bit-identical to the concatenated cache's (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from redraft.runtimes.base import PrefixKV

ROOM_MIN = 256  # positions of room a new buffer keeps at least, beyond what it holds


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` (same interface, same tensors as seen by attention) that appends into room kept at the end
    of a buffer (module docstring).

    Attributes:
        keys, values: FloatTensor [1, H_kv, L, D] in the model dtype: views of the buffer's first L positions (or any
            tensor assigned from outside, which the next append moves into a new buffer).
        frozen: positions [0, frozen) of the buffer are shared with a reader and are never written in place.
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None
        self.frozen = 0

    @property
    def capacity(self) -> int:
        """Positions the current buffer holds (0 before the first append)."""
        return 0 if self._key_buf is None else int(self._key_buf.shape[-2])

    def _writable(self, n: int, s: int) -> bool:
        """Whether ``s`` new positions can be written after the ``n`` held ones in place."""
        buf, keys = self._key_buf, self.keys
        return (buf is not None and keys is not None and keys.dim() == 4 and n + s <= buf.shape[-2] and n >= self.frozen
                and keys.data_ptr() == buf.data_ptr() and keys.stride() == buf.stride()
                and self.values.data_ptr() == self._value_buf.data_ptr()
                and self.values.stride() == self._value_buf.stride() and self.values.shape[-2] == n)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ([1, H_kv, S, D]) after the held positions.

        Returns:
            (keys, values): views [1, H_kv, L + S, D] of every held position (what attention reads).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = self.keys
        if key_states.shape[-2] == 0 and not self._writable(0, 0):  # nothing to append (seed creates layers so)
            return keys, self.values
        n = int(keys.shape[-2]) if keys is not None and keys.dim() == 4 else 0
        s = int(key_states.shape[-2])
        if not self._writable(n, s):
            need = n + s
            cap = need + max(ROOM_MIN, need // 4)
            shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
            kb, vb = key_states.new_empty(shape), value_states.new_empty(shape)
            if n:
                kb[..., :n, :] = keys
                vb[..., :n, :] = self.values
            self._key_buf, self._value_buf, self.frozen = kb, vb, 0
        self._key_buf[..., n:n + s, :] = key_states
        self._value_buf[..., n:n + s, :] = value_states
        self.keys, self.values = self._key_buf[..., :n + s, :], self._value_buf[..., :n + s, :]
        return self.keys, self.values

    def freeze(self, n: int) -> None:
        """Mark the first ``n`` positions as shared: they are never written in place again (copy on write)."""
        self.frozen = max(self.frozen, int(n))

    def reset(self) -> None:
        """Drop every entry (the layer starts empty, as before its first append). Nothing is written: the buffer
        and any views of it handed out stay as they were."""
        self._key_buf = self._value_buf = None
        self.keys = self.values = None
        self.frozen = 0
        self.is_initialized = False


def growing_cache() -> DynamicCache:
    """An empty ``DynamicCache`` whose layers are :class:`GrowingLayer` (created lazily, one per decoder layer, as
    transformers creates ``DynamicLayer``s for a cache built without a config)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def held_views(layer, n: int, *, slack: float = 0.125) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` cached positions of ``layer`` to hand to a reader that keeps them (a prefix-cache entry).

    A :class:`GrowingLayer` gives views and freezes those positions, unless its buffer holds more than
    ``(1 + slack) x n`` positions: a view would keep that room allocated for as long as the reader keeps it, so the
    entries are copied out instead. Any other layer gives views (its tensors are replaced, never written).

    Args:
        layer: a cache layer holding at least ``n`` positions (``keys``/``values`` [1, H_kv, L, D], L >= n).
        n: positions to hand out, from the first.
        slack: the most unused room, as a share of ``n``, that a view may keep allocated.
    Returns:
        (keys, values): FloatTensor [1, H_kv, n, D] each, in the layer's dtype and on its device.
    """
    keys, values = layer.keys[:, :, :n], layer.values[:, :, :n]
    if isinstance(layer, GrowingLayer):
        if layer.capacity > (1.0 + slack) * n:
            return keys.clone(), values.clone()
        layer.freeze(n)
    return keys, values


def kv_tensors(entry: PrefixKV) -> dict[str, torch.Tensor]:
    """A transformers :class:`PrefixKV`'s entries as named contiguous tensors: ``k.<layer>`` and ``v.<layer>``,
    each [1, H_kv, n, D] in the model dtype (a copy of the views the cache shares)."""
    out = {}
    for i, (k, v) in enumerate(entry.kv):
        out[f"k.{i}"], out[f"v.{i}"] = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
    return out


def kv_entry(ids: Sequence[int], tensors: dict[str, torch.Tensor], layers: int, dtype: torch.dtype) -> PrefixKV:
    """The inverse of :func:`kv_tensors`, checked against the model: ``layers`` pairs of [1, H, n, D] tensors of
    ``dtype`` with n = len(ids). Raises ValueError naming what does not match."""
    kv = []
    for i in range(layers):
        k, v = tensors.get(f"k.{i}"), tensors.get(f"v.{i}")
        if k is None or v is None:
            raise ValueError(f"no KV tensors for layer {i} (the model has {layers})")
        if k.dtype != dtype or v.dtype != dtype or k.dim() != 4 or k.shape != v.shape or k.shape[2] != len(ids):
            raise ValueError(f"layer {i}: KV tensors {tuple(k.shape)} {k.dtype} do not hold {len(ids)} positions "
                             f"in {dtype}")
        kv.append((k, v))
    if len([n for n in tensors if n.startswith("k.")]) != layers:
        raise ValueError(f"KV tensors for another number of layers than the model's {layers}")
    return PrefixKV(tuple(int(t) for t in ids), tuple(kv), origin="disk")
