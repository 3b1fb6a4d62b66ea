"""Prefix KV reuse across requests (redraft/server/prefix_cache.py and ``Engine.generate(prefix=...)``).

Outputs with a reused prefix equal plain greedy decoding of the whole prompt without reuse: on tiny models, with
drafts, with every reused row made a near-tie, with perturbed (planted-noise) reused entries, and over random
conversations (hypothesis). The store keeps tenants apart and evicts least recently used entries within its budget.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, ConstantDrafter, RecordingTarget, SequenceDrafter, hf_greedy, plain_greedy, top2_gap
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.decoding.engine import Engine
from redraft.drafters import NgramDrafter
from redraft.runtimes.transformers.target import HFTarget, PrefixKV
from redraft.server.prefix_cache import PrefixCache, common_prefix, remember

PROMPT = [7, 21, 3, 88, 40, 12, 7, 21, 3]


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _turn(engine: Engine, cache: PrefixCache, tenant: str, prompt, n: int, **kw):
    """One request as the server runs it: look up, generate from the hit, remember prompt + answer."""
    hit = cache.lookup(tenant, prompt)
    res = engine.generate(prompt, n, prefix=hit, **kw)
    remember(cache, tenant, engine.target, res)
    return res


def _fake_entry(ids, layers: int = 2) -> PrefixKV:
    n = len(ids)
    return PrefixKV(tuple(ids), tuple((torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2)) for _ in range(layers)))


# ---- exactness ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa", "qwen2-sdpa"])
def test_next_turn_from_the_cached_conversation_equals_plain_greedy(tiny_models, name):
    model = tiny_models[name]
    cache = PrefixCache(10_000)
    engine = Engine(model, [NgramDrafter()])
    first = _turn(engine, cache, "a", PROMPT, 20)
    assert first.prefix_hit_tokens == 0 and first.output_ids == plain_greedy(model, PROMPT, 20)
    prompt2 = PROMPT + first.output_ids + [5, 6, 7, 8]  # previous request + its answer + an observation
    second = _turn(engine, cache, "a", prompt2, 25)
    assert second.prefix_hit_tokens >= len(PROMPT) + len(first.output_ids) - 1
    assert second.output_ids == plain_greedy(model, prompt2, 25)
    # the first forward fed only the new tail: fewer prompt tokens than a full prefill
    assert second.forwards <= plain_greedy_forwards(model, prompt2, 25)


def plain_greedy_forwards(model, prompt, n) -> int:
    return Engine(model, []).generate(prompt, n).forwards


def test_reused_prefix_feeds_only_the_tail(tiny_llama):
    cache = PrefixCache(10_000)
    target = RecordingTarget(tiny_llama)
    engine = Engine(target, [])
    first = _turn(engine, cache, "a", PROMPT, 10)
    target.log.clear()
    prompt2 = PROMPT + first.output_ids + [1, 2, 3]
    second = _turn(engine, cache, "a", prompt2, 10)
    assert target.log[0][0] == len(prompt2) - second.prefix_hit_tokens == 3 + 1  # the uncached answer token + 3
    assert second.output_ids == plain_greedy(tiny_llama, prompt2, 10)


@pytest.mark.parametrize("name", ["llama-eager", "mixtral-sdpa"])
def test_every_reused_row_a_near_tie_rebuilds_the_cache_plainly(tiny_models, name):
    """exact_margin=1e9: no row computed on reused entries is trusted; the first one is recomputed after the whole
    prompt is prefilled from an empty cache, as plain decoding does."""
    model = tiny_models[name]
    cache = PrefixCache(10_000)
    first = _turn(Engine(model, []), cache, "a", PROMPT, 12)
    prompt2 = PROMPT + first.output_ids + [9, 9, 4]
    target = RecordingTarget(model)
    res = _turn(Engine(target, [], exact_margin=1e9), cache, "a", prompt2, 15)
    assert res.prefix_hit_tokens > 0 and res.near_ties >= 1
    assert res.output_ids == plain_greedy(model, prompt2, 15)
    assert target.log[0][0] < len(prompt2) and len(prompt2) in [n for n, _, _ in target.log[1:3]]


def _noisy(prefix: PrefixKV, scale: float, seed: int = 0) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    return PrefixKV(prefix.ids, tuple((k + scale * torch.randn(k.shape, generator=g),
                                       v + scale * torch.randn(v.shape, generator=g)) for k, v in prefix.kv))


def test_planted_near_ties_on_perturbed_reused_entries(tiny_llama):
    """Reused entries perturbed on purpose (standing in for another forward shape's rounding) move the logits by
    less than half the near-tie margin: with exact mode the output is plain greedy's; the rows that are near-ties
    under that margin are the ones settled."""
    model = tiny_llama
    cache = PrefixCache(10_000)
    first = _turn(Engine(model, []), cache, "a", PROMPT, 16)
    prompt2 = PROMPT + first.output_ids + [30, 31]
    want = plain_greedy(model, prompt2, 30)
    _, logits = hf_greedy(model, prompt2, 30, scores=True)
    margin = 1.0
    tied = [i for i, g in enumerate(top2_gap(logits).tolist()) if g < margin]
    assert tied, "no planted near-tie: the test would prove nothing"
    hit = cache.lookup("a", prompt2)
    noisy = _noisy(hit, 2e-3)
    # how far the perturbation moves the first row: well under margin / 2, so trusted rows keep plain's choice
    plain_row = Engine(model, []).target
    plain_row.reset()
    clean = plain_row.forward(prompt2)[0]
    t = HFTarget(model)
    t.seed(noisy)
    moved = (t.forward(prompt2[noisy.length:])[0] - clean).abs().max().item()
    assert 0 < moved < margin / 2
    res = Engine(model, [SequenceDrafter(prompt2 + want)], exact_margin=margin).generate(prompt2, 30, prefix=noisy)
    assert res.output_ids == want
    assert res.near_ties >= 1


def test_one_entry_seeds_any_number_of_sequences_and_stays_unchanged(tiny_llama):
    """Seeding shares the entry's tensors (no copy): verify forwards, an accepted tree path that skips a sibling
    branch (a gather), crops and exact mode's rebuilds never write into them, so the entry is bit for bit what it
    was after several generations from it, and each of them equals plain greedy."""
    model = tiny_llama
    cache = PrefixCache(10_000)
    first = _turn(Engine(model, []), cache, "a", PROMPT, 16)
    prompt2 = PROMPT + first.output_ids + [30, 31]
    want = plain_greedy(model, prompt2, 20)
    hit = cache.lookup("a", prompt2)
    assert hit is cache.entries[("a", hit.ids)]  # the stored entry itself, not a slice of it
    before = [(k.clone(), v.clone()) for k, v in hit.kv]
    wrong = [(want[0] + 1) % VOCAB, (want[1] + 1) % VOCAB]
    engines = {"tree": Engine(model, [ConstantDrafter(wrong), SequenceDrafter(prompt2 + want)], merge=True),
               "settle": Engine(model, [SequenceDrafter(prompt2 + want)], exact_margin=1e9),
               "plain": Engine(model, [])}
    for name, engine in engines.items():
        res = engine.generate(prompt2, 20, prefix=hit)
        assert res.output_ids == want, name
        assert res.prefix_hit_tokens == hit.length
        for (k, v), (k0, v0) in zip(hit.kv, before, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0), name
    assert engines["settle"].generate(prompt2, 20, prefix=hit).near_ties >= 1  # the rebuild path did run


@given(data=st.data())
@_settings(30)
def test_random_conversations_equal_plain_greedy(tiny_llama, data):
    """Random multi-turn conversations (each prompt extends an earlier prompt + answer, or branches from it, or is
    new) through one store shared by two tenants: every answer equals plain greedy of its whole prompt."""
    model = tiny_llama
    budget = data.draw(st.sampled_from([0, 24, 80, 10_000]), label="budget")
    cache = PrefixCache(budget)
    engine = Engine(model, [NgramDrafter()] if data.draw(st.booleans(), label="ngram") else [])
    history: dict[str, list[list[int]]] = {"a": [], "b": []}
    ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
    for _ in range(data.draw(st.integers(2, 4), label="turns")):
        tenant = data.draw(st.sampled_from(["a", "b"]), label="tenant")
        past = history[tenant] + history["b" if tenant == "a" else "a"]
        how = data.draw(st.sampled_from(["extend", "branch", "new"]) if past else st.just("new"), label="how")
        if how == "new":
            prompt = data.draw(ids, label="prompt")
        else:
            base = data.draw(st.sampled_from(past), label="base")
            cut = len(base) if how == "extend" else data.draw(st.integers(1, len(base)), label="cut")
            prompt = base[:cut] + data.draw(ids, label="observation")
        n = data.draw(st.integers(1, 12), label="max_new_tokens")
        res = _turn(engine, cache, tenant, prompt, n)
        assert res.output_ids == plain_greedy(model, prompt, n), (tenant, how, prompt)
        assert res.prefix_hit_tokens < len(prompt)
        assert cache.tokens <= budget
        history[tenant].append(prompt + res.output_ids)


def test_prefix_must_be_a_proper_prefix_of_the_prompt(tiny_llama):
    cache = PrefixCache(10_000)
    engine = Engine(tiny_llama, [])
    _turn(engine, cache, "a", PROMPT, 4)
    entry = next(iter(cache.entries.values()))
    with pytest.raises(ValueError, match="proper prefix"):
        engine.generate(list(entry.ids), 4, prefix=entry)  # nothing left to feed
    with pytest.raises(ValueError, match="proper prefix"):
        engine.generate([t + 1 for t in entry.ids] + [1], 4, prefix=entry)


def test_stop_cut_answer_caches_only_emitted_positions(tiny_llama):
    """An EOS inside an accepted draft ends the output before tokens whose KV was kept: only prompt + output is
    cached, and the next turn is still exact."""
    want = plain_greedy(tiny_llama, PROMPT, 20)
    eos = want[5]
    out = want[:want.index(eos) + 1]
    cache = PrefixCache(10_000)
    engine = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)], eos_token_ids=[eos])
    res = _turn(engine, cache, "a", PROMPT, 20)
    assert res.output_ids == out
    (entry,) = cache.entries.values()
    assert list(entry.ids) == (PROMPT + out)[:entry.length] and entry.length <= len(PROMPT) + len(out)
    prompt2 = PROMPT + out + [2, 3]
    assert _turn(Engine(tiny_llama, []), cache, "a", prompt2, 10).output_ids == plain_greedy(tiny_llama, prompt2, 10)


# ---- the store: tenants, budget, recency ---------------------------------------------------------------------------

def test_tenants_never_share_entries():
    cache = PrefixCache(1000)
    cache.store("a", _fake_entry([1, 2, 3, 4, 5]))
    assert cache.lookup("b", [1, 2, 3, 4, 5, 6]) is None
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.ids == (1, 2, 3, 4, 5)
    assert cache.tenant_tokens("a") == 5 and cache.tenant_tokens("b") == 0


def test_hit_leaves_one_prompt_token_to_feed_and_takes_the_longest_match():
    cache = PrefixCache(1000)
    cache.store("a", _fake_entry([1, 2, 3, 4, 5, 6]))
    cache.store("a", _fake_entry([1, 2, 9, 9]))
    hit = cache.lookup("a", [1, 2, 3, 4])
    assert hit.ids == (1, 2, 3) and all(k.shape[-2] == 3 for k, _ in hit.kv)
    assert cache.lookup("a", [1, 2, 9, 7]).ids == (1, 2, 9)
    assert cache.lookup("a", [8, 1, 2]) is None
    assert cache.stats.hits == 6 and cache.stats.queries == 11


def test_lru_eviction_within_the_token_budget():
    cache = PrefixCache(10)
    cache.store("a", _fake_entry([1, 1, 1, 1]))
    cache.store("b", _fake_entry([2, 2, 2, 2]))
    assert cache.lookup("a", [1, 1, 1, 1, 7]) is not None  # "a" becomes the most recently used
    cache.store("a", _fake_entry([3, 3, 3, 3]))  # 12 tokens > 10: evicts the least recently used, "b"'s
    assert cache.tokens == 8 and cache.stats.evictions == 1
    assert cache.lookup("b", [2, 2, 2, 2, 7]) is None and cache.lookup("a", [1, 1, 1, 7]) is not None
    cache.store("a", _fake_entry(list(range(11))))  # longer than the whole budget: not kept
    assert cache.tokens == 8 and len(cache) == 2


def test_an_entry_extending_another_replaces_it():
    cache = PrefixCache(100)
    cache.store("a", _fake_entry([1, 2, 3]))
    cache.store("b", _fake_entry([1, 2, 3]))
    cache.store("a", _fake_entry([1, 2, 3, 4, 5]))
    assert cache.tokens == 8 and cache.stats.replaced == 1 and cache.stats.evictions == 0
    assert cache.lookup("b", [1, 2, 3, 4, 5, 6]).ids == (1, 2, 3)


def test_zero_budget_stores_nothing(tiny_llama):
    cache = PrefixCache(0)
    engine = Engine(tiny_llama, [])
    res = _turn(engine, cache, "a", PROMPT, 5)
    assert len(cache) == 0 and _turn(engine, cache, "a", PROMPT + res.output_ids + [1], 5).prefix_hit_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], limit=2) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_seed_refuses_entries_of_another_shape(tiny_llama):
    t = HFTarget(tiny_llama)
    layers = tiny_llama.config.num_hidden_layers
    with pytest.raises(ValueError, match="layers"):
        t.seed(_fake_entry([1, 2], layers=layers + 1))
    bad = PrefixKV((1, 2, 3), tuple((torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)) for _ in range(layers)))
    with pytest.raises(ValueError, match="positions"):
        t.seed(bad)


@pytest.mark.parametrize("seed", [0, 5, 123])
def test_seeded_sampling_with_a_reused_prefix_equals_sampling_without(tiny_llama, seed):
    """Sampling is seeded per position: a reused prefix gives the same sample as a fresh prefill."""
    from redraft.decoding.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    cache = PrefixCache(10_000)
    first = _turn(Engine(tiny_llama, []), cache, "a", PROMPT, 12, sampling=sampling)
    prompt2 = PROMPT + first.output_ids + [17, 18]
    engine = Engine(tiny_llama, [NgramDrafter()])
    reused = _turn(engine, cache, "a", prompt2, 30, sampling=sampling)
    fresh = Engine(tiny_llama, []).generate(prompt2, 30, sampling=sampling)
    assert reused.prefix_hit_tokens > 0 and reused.output_ids == fresh.output_ids
    other = Engine(tiny_llama, []).generate(prompt2, 30, sampling=SamplingParams(temperature=0.9, top_p=0.95,
                                                                                  seed=seed + 1))
    assert other.output_ids != fresh.output_ids  # the seed matters: the comparison can fail
