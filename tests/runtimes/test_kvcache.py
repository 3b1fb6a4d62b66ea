"""The growing KV cache: appends write into room kept in a buffer, with results bit-identical to transformers'
concatenating ``DynamicCache``, and no entry handed out (prefix-cache views, seeded prefixes) ever written again."""

import pytest
import torch
from transformers import DynamicCache

from redraft.runtimes.transformers.kvcache import ROOM_MIN, GrowingLayer, growing_cache, held_views
from redraft.runtimes.transformers.target import HFTarget, PrefixKV, cache_kwarg

PROMPT = [5, 17, 3, 90, 42, 7, 7, 64, 12, 50, 8, 33]


def _decode(model, cache, prompt, n, *, verify_at=None):
    """Greedy one token per forward on ``cache``; at step ``verify_at`` a 4-row forward is run and cropped off (as a
    rejected draft). Returns the logit rows [n, vocab]."""
    rows, length, nxt = [], 0, list(prompt)
    with torch.inference_mode():
        for i in range(n):
            out = model(input_ids=torch.tensor([nxt]), use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
            length += len(nxt)
            rows.append(out.logits[0, -1])
            nxt = [int(rows[-1].argmax())]
            if i == verify_at:
                model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=True, **{cache_kwarg(model): cache})
                cache.crop(-4)
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa", "qwen2-sdpa"])
def test_growing_cache_is_bit_identical_to_dynamic_cache(tiny_models, name):
    model = tiny_models[name]
    want = _decode(model, DynamicCache(), PROMPT, 40, verify_at=9)
    cache = growing_cache()
    got = _decode(model, cache, PROMPT, 40, verify_at=9)
    assert torch.equal(got, want)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer)
    # the prompt, 39 decoded tokens and the cropped 4 rows all fit the first buffer: no move, views of it
    assert layer.capacity == len(PROMPT) + ROOM_MIN
    assert layer.keys.data_ptr() == layer._key_buf.data_ptr()


def test_growth_is_amortised():
    layer = GrowingLayer()
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(1, 2, 12, 3, generator=gen)
    layer.update(first, -first)
    rows, caps = [first], {layer.capacity}
    for _ in range(2000):
        k = torch.randn(1, 2, 1, 3, generator=gen)
        layer.update(k, -k)
        rows.append(k)
        caps.add(layer.capacity)
    want = torch.cat(rows, dim=-2)
    assert torch.equal(layer.keys, want) and torch.equal(layer.values, -want)
    # a quarter more room at each move, at least ROOM_MIN: 268, 536, 670, ... (log growth, not one per append)
    assert len(caps) <= 10 and layer.capacity >= 2012


def test_snapshot_views_are_never_written_again(tiny_llama_sdpa):
    t = HFTarget(tiny_llama_sdpa)
    t.reset()
    t.forward(PROMPT + [1, 2, 3, 4, 5, 6])
    snap = t.snapshot(PROMPT)
    saved = [(k.clone(), v.clone()) for k, v in snap.kv]
    t.crop(8)  # below the snapshot's end
    t.forward([77, 78, 79, 80, 81, 82, 83])  # writes positions 8..14, which the snapshot covers
    for (k, v), (k0, v0) in zip(snap.kv, saved, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_frozen_positions_move_the_layer_before_a_write():
    layer = GrowingLayer()
    k = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(1, 2, 4, 3)
    layer.update(k, k + 100)
    keys, values = held_views(layer, 4, slack=1e9)  # views, frozen
    assert keys.data_ptr() == layer._key_buf.data_ptr() and layer.frozen == 4
    saved = keys.clone()
    layer.crop(-2)
    layer.update(torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3))
    assert torch.equal(keys, saved)  # the held view kept its entries
    assert layer.keys.data_ptr() != keys.data_ptr() and layer.frozen == 0
    assert torch.equal(layer.keys[:, :, :2], saved[:, :, :2]) and layer.keys.shape[-2] == 5
    # appending past the frozen positions writes in place again
    ptr = layer._key_buf.data_ptr()
    layer.update(torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3))
    assert layer._key_buf.data_ptr() == ptr and layer.keys.shape[-2] == 6


def test_held_views_copy_out_of_a_mostly_empty_buffer():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 10, 3)
    layer.update(k, k)
    keys, _ = held_views(layer, 10)  # capacity 266 > 1.125 x 10: a copy, nothing frozen
    assert keys.data_ptr() != layer._key_buf.data_ptr() and layer.frozen == 0
    assert torch.equal(keys, k)


def test_seeded_prefix_is_not_written(tiny_llama_sdpa):
    src = HFTarget(tiny_llama_sdpa)
    src.reset()
    src.forward(PROMPT)
    kv = tuple((layer.keys.clone(), layer.values.clone()) for layer in src.cache.layers)
    saved = [(k.clone(), v.clone()) for k, v in kv]
    t = HFTarget(tiny_llama_sdpa)
    t.seed(PrefixKV(tuple(PROMPT), kv))
    t.crop(6)
    seeded = t.forward([9, 9, 9, 9])
    for (k, v), (k0, v0) in zip(kv, saved, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    fresh = HFTarget(tiny_llama_sdpa)
    fresh.reset()
    fresh.forward(PROMPT[:6])
    assert torch.equal(fresh.forward([9, 9, 9, 9]), seeded)


def test_keep_gathers_then_appends(tiny_llama_sdpa):
    t = HFTarget(tiny_llama_sdpa)
    t.reset()
    t.forward(PROMPT + [20, 21, 22, 23])
    t.keep(len(PROMPT), [len(PROMPT) + 1, len(PROMPT) + 3])  # skip siblings: a gather into new tensors
    row = t.forward([30])
    ref = HFTarget(tiny_llama_sdpa)
    ref.reset()
    ref.forward(PROMPT)
    ref.keep(len(PROMPT), [])
    # the same entries computed directly: prompt, then 21 and 23 at positions 13 and 15
    full = HFTarget(tiny_llama_sdpa)
    full.reset()
    full.forward(PROMPT + [20, 21, 22, 23])
    for a, b in zip(t.cache.layers, full.cache.layers, strict=True):
        idx = torch.tensor(list(range(len(PROMPT))) + [len(PROMPT) + 1, len(PROMPT) + 3])
        assert torch.equal(a.keys[:, :, :-1], b.keys.index_select(-2, idx))
    assert row.shape == (1, t.vocab_size) and t.length == len(PROMPT) + 3


def test_reset_drops_entries_without_writing_them():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 6, 3)
    layer.update(k, -k)
    keys, values = held_views(layer, 6, slack=1e9)
    layer.reset()
    assert torch.equal(keys, k) and torch.equal(values, -k)  # transformers' base reset zeroes in place; not here
    assert layer.get_seq_length() == 0 and layer.capacity == 0
    layer.update(k[:, :, :2], k[:, :, :2])
    assert layer.keys.shape[-2] == 2 and torch.equal(keys, k)


def test_an_empty_append_allocates_nothing():
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 0, 3), torch.randn(1, 2, 0, 3))
    assert layer.capacity == 0 and layer.get_seq_length() == 0
