"""Token trees, tree attention (mask + positions) against sequential decoding, greedy acceptance, KV compaction."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from conftest import VOCAB, RecordingTarget, SequenceDrafter, plain_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.decoding.engine import Engine
from redraft.decoding.verify import greedy_accept, tree_attention_mask, tree_positions
from redraft.runtimes.transformers.target import HFTarget
from redraft.tree import TokenTree

ATOL = 1e-4


# ---- TokenTree ----------------------------------------------------------------------------------------------------

def test_add_chain_shares_prefixes_and_records_first_source():
    t = TokenTree()
    assert t.is_chain and len(t) == 0 and t.max_depth == 0
    assert t.add_chain([1, 2, 3], "a") == 3
    assert t.is_chain
    assert t.add_chain([1, 2, 4, 5], "b") == 2  # shares 1,2
    assert t.tokens == [1, 2, 3, 4, 5]
    assert t.parents == [-1, 0, 1, 1, 3]
    assert t.depths == [1, 2, 3, 3, 4]
    assert t.sources == ["a", "a", "a", "b", "b"]
    assert not t.is_chain
    assert t.add_chain([1, 2, 3], "c") == 0  # fully present: nothing added, sources unchanged
    assert t.sources == ["a", "a", "a", "b", "b"]
    assert t.add_chain([7], "c") == 1 and t.parents[-1] == -1 and t.depths[-1] == 1
    assert t.child(-1, 1) == 0 and t.child(-1, 7) == 5 and t.child(-1, 2) == -1
    assert t.child(1, 4) == 3 and t.child(3, 5) == 4
    assert t.path_to(4) == [0, 1, 3, 4]
    assert t.path_to(5) == [5]
    assert t.max_depth == 4


def test_add_chain_budget_and_depth_limits():
    t = TokenTree()
    assert t.add_chain(range(10, 20), "a", max_depth=4) == 4
    assert t.tokens == [10, 11, 12, 13]
    # budget counts nodes in the whole tree; existing nodes along the way are still followed
    assert t.add_chain([10, 11, 50, 51, 52], "b", budget=6) == 2
    assert t.tokens == [10, 11, 12, 13, 50, 51] and t.parents[4:] == [1, 4]
    assert t.add_chain([60], "c", budget=6) == 0
    assert len(t) == 6


def test_add_subtree_dedups_against_existing_nodes():
    t = TokenTree()
    t.add_chain([1, 2, 3], "chain")
    # proposal: 1 -> {2 -> 9, 8}, and a second root child 4 -> 5
    added = t.add_subtree([1, 2, 9, 8, 4, 5], [-1, 0, 1, 0, -1, 4], "tree")
    assert added == 4
    assert t.tokens == [1, 2, 3, 9, 8, 4, 5]
    assert t.parents == [-1, 0, 1, 1, 0, -1, 5]
    assert t.depths == [1, 2, 3, 3, 2, 1, 2]
    assert t.sources == ["chain"] * 3 + ["tree"] * 4
    assert all(p < i for i, p in enumerate(t.parents))


def test_add_subtree_drops_descendants_of_dropped_nodes():
    t = TokenTree()
    # depth limit 2: node 2 (depth 3) and its child 3 are dropped; node 4 (depth 2) is kept
    added = t.add_subtree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 0], "x", max_depth=2)
    assert added == 3
    assert t.tokens == [1, 2, 5] and t.parents == [-1, 0, 0]
    t2 = TokenTree()
    # budget 2: the third node and everything below it goes, even though its own child would fit nothing
    assert t2.add_subtree([1, 2, 3, 4], [-1, 0, -1, 2], "x", budget=2) == 2
    assert t2.tokens == [1, 2]


def test_add_node_returns_existing_sibling():
    t = TokenTree()
    a = t.add_node(-1, 5, "x")
    assert t.add_node(-1, 5, "y") == a and len(t) == 1
    b = t.add_node(a, 5, "y")
    assert b != a and t.parents[b] == a


def test_chain_and_from_parents_build_the_same_tree_as_add_chain():
    c = TokenTree.chain([4, 5, 6], "a")
    ref = TokenTree()
    ref.add_chain([4, 5, 6], "a")
    assert (c.tokens, c.parents, c.depths, c.sources) == (ref.tokens, ref.parents, ref.depths, ref.sources)
    assert c.child(1, 6) == 2 and c.is_chain and c.max_depth == 3
    t = TokenTree.from_parents([1, 2, 2, 3], [-1, 0, 0, -1], "b", counts=[5, 3, 9, 1], match_length=4,
                               occurrences=7)
    assert t.tokens == [1, 2, 3] and t.parents == [-1, 0, -1] and t.counts == [5, 3, 1]  # twin sibling merged
    assert (t.match_length, t.occurrences) == (4, 7)
    with pytest.raises(ValueError, match="parents must come before"):
        TokenTree.from_parents([1, 2], [1, -1], "b")
    with pytest.raises(ValueError, match="one parent"):
        TokenTree.from_parents([1, 2], [-1], "b")


def test_merge_credits_the_source_and_keeps_counts():
    t = TokenTree()
    t.merge(TokenTree.from_parents([1, 2, 3], [-1, 0, 0], "corpus", counts=[4, 3, 1], match_length=5), "corpus")
    assert t.counts == [4, 3, 1] and t.match_length == 5
    assert t.merge(TokenTree.chain([1, 2, 7, 8], "whatever"), "ngram", budget=5) == 2
    assert t.tokens == [1, 2, 3, 7, 8] and t.sources == ["corpus"] * 3 + ["ngram"] * 2
    assert t.counts == [4, 3, 1, 0, 0]
    u = TokenTree()
    u.merge(TokenTree.chain([9], "x"), "x")
    u.merge(TokenTree.from_parents([5], [-1], "c", counts=[2]), "c")
    assert u.counts == [0, 2]


def test_within_vocab_drops_bad_ids_with_their_descendants():
    t = TokenTree.from_parents([1, -3, 96, 2, 7, 4], [-1, -1, -1, 0, 1, 3], "x", counts=[1, 2, 3, 4, 5, 6])
    assert t.within_vocab(96 + 1) is not t
    v = t.within_vocab(96)
    assert v.tokens == [1, 2, 4] and v.parents == [-1, 0, 1] and v.counts == [1, 4, 6]
    ok = TokenTree.chain([1, 2], "x")
    assert ok.within_vocab(3) is ok  # nothing to drop: no copy
    assert TokenTree.chain([1, 99, 2], "x").within_vocab(50).tokens == [1]  # a chain is cut at the first bad id


def test_first_path_takes_the_first_listed_child_at_each_level():
    t = TokenTree.from_parents([1, 2, 3, 4, 5], [-1, -1, 0, 0, 3], "x", counts=[9, 8, 7, 6, 5])
    f = t.first_path()
    assert f.is_chain and f.tokens == [1, 3] and f.counts == [9, 7] and f.sources == ["x", "x"]
    c = TokenTree.chain([1, 2], "x")
    assert c.first_path() is c


# ---- positions and mask by hand -----------------------------------------------------------------------------------

def _small_tree() -> TokenTree:
    t = TokenTree()
    t.add_chain([10, 11], "a")  # nodes 0 (d1), 1 (d2)
    t.add_chain([20, 21], "b")  # nodes 2 (d1), 3 (d2)
    t.add_chain([10, 12], "c")  # node 4 (d2), parent 0
    return t


def test_tree_positions_siblings_share_positions():
    t = _small_tree()
    pos = tree_positions(t, n_past=5, n_pending=2)
    assert pos.dtype == torch.long and pos.shape == (1, 7)
    # pending at 5, 6; root is position 6; nodes at 6 + depth
    assert pos[0].tolist() == [5, 6, 7, 8, 7, 8, 8]


def test_tree_attention_mask_by_hand():
    t = _small_tree()
    n_past, n_pend = 3, 2
    m = tree_attention_mask(t, n_past, n_pend, torch.float32)
    assert m.shape == (1, 1, n_pend + 5, n_past + n_pend + 5) and m.dtype == torch.float32
    allowed = (m[0, 0] == 0).int().tolist()
    blocked = m[0, 0][m[0, 0] != 0]
    assert torch.all(blocked == torch.finfo(torch.float32).min)
    past, pend = [1, 1, 1], None
    expect = [
        past + [1, 0] + [0, 0, 0, 0, 0],   # pending 0: causal
        past + [1, 1] + [0, 0, 0, 0, 0],   # pending 1 (the root)
        past + [1, 1] + [1, 0, 0, 0, 0],   # node 0: itself
        past + [1, 1] + [1, 1, 0, 0, 0],   # node 1: 0, itself
        past + [1, 1] + [0, 0, 1, 0, 0],   # node 2: itself
        past + [1, 1] + [0, 0, 1, 1, 0],   # node 3: 2, itself
        past + [1, 1] + [1, 0, 0, 0, 1],   # node 4: 0, itself (not its sibling 1)
    ]
    assert pend is None and allowed == expect


def test_tree_attention_mask_half_precision_uses_dtype_min():
    m = tree_attention_mask(_small_tree(), 0, 1, torch.bfloat16)
    assert m.dtype == torch.bfloat16
    assert m.min().item() == torch.finfo(torch.bfloat16).min


# ---- greedy acceptance -------------------------------------------------------------------------------------------

def test_greedy_accept_longest_matching_path():
    t = _small_tree()  # tokens [10, 11, 20, 21, 12]
    # root row picks 10; node 0 row picks 12 -> node 4; node 4 row picks 99 (bonus)
    choices = [10, 12, 0, 0, 0, 99]
    assert greedy_accept(t, choices) == ([0, 4], 99)
    # root picks 20 -> node 2; node 2 picks 21 -> node 3; node 3's row gives the bonus
    assert greedy_accept(t, [20, 0, 0, 21, 42, 0]) == ([2, 3], 42)
    # root picks something not in the tree: nothing accepted, bonus = root choice
    assert greedy_accept(t, [7, 10, 11, 20, 21, 12]) == ([], 7)
    assert greedy_accept(TokenTree(), [5]) == ([], 5)


# ---- tree attention against sequential decoding on real (tiny) models --------------------------------------------

def _random_tree(rng: random.Random, n: int) -> TokenTree:
    t = TokenTree()
    while len(t) < n:
        parent = rng.randrange(-1, len(t)) if len(t) else -1
        t.add_node(parent, rng.randrange(VOCAB), "r")
    return t


def _sequential_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa", "qwen2-sdpa"])
@pytest.mark.parametrize("n_past,n_pend", [(0, 4), (6, 1), (5, 3)])
def test_tree_verify_logits_match_sequential(tiny_models, name, n_past, n_pend):
    """Every node's logits from one tree verify forward equal feeding its root-to-node path sequentially."""
    model = tiny_models[name]
    rng = random.Random(zlib.crc32(f"{name}/{n_past}/{n_pend}".encode()))
    prefix = [rng.randrange(VOCAB) for _ in range(n_past + n_pend)]
    tree = _random_tree(rng, 12)
    assert not tree.is_chain
    target = HFTarget(model)
    target.reset()
    if n_past:
        target.forward(prefix[:n_past])
    assert target.length == n_past
    pos = tree_positions(tree, n_past, n_pend)
    mask = tree_attention_mask(tree, n_past, n_pend, target.dtype)
    logits = target.forward(prefix[n_past:] + tree.tokens, pos, mask, n_logits=len(tree) + 1)
    assert logits.shape == (len(tree) + 1, VOCAB)
    assert target.length == n_past + n_pend + len(tree)
    worst = 0.0
    ref = _sequential_last_logits(model, prefix)
    worst = max(worst, (logits[0] - ref).abs().max().item())
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in tree.path_to(i)]
        ref = _sequential_last_logits(model, prefix + path)
        worst = max(worst, (logits[i + 1] - ref).abs().max().item())
    assert worst < ATOL, f"{name}: tree verify logits differ from sequential by {worst:.2e}"


def test_wrong_tree_mask_is_detected(tiny_llama):
    """Control for the test above: a plain causal mask over the same tree does NOT reproduce sequential logits."""
    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(5)]
    tree = TokenTree()
    tree.add_chain([3, 4], "a")
    tree.add_chain([5, 6], "b")  # node 2 = 5 (sibling of node 0), node 3 = 6
    target = HFTarget(tiny_llama)
    target.reset()
    target.forward(prefix[:4])
    pos = tree_positions(tree, 4, 1)
    logits = target.forward(prefix[4:] + tree.tokens, pos, None, n_logits=len(tree) + 1)  # causal: sees sibling
    ref = _sequential_last_logits(tiny_llama, prefix + [5, 6])
    assert (logits[4] - ref).abs().max().item() > 1e-3


# ---- KV compaction -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "mixtral-sdpa", "qwen2-sdpa"])
def test_keep_noncontiguous_path_gives_sequential_next_logits(tiny_models, name):
    model = tiny_models[name]
    prefix = [11, 12, 13, 14, 15, 16]
    root = 17
    tree = TokenTree()
    tree.add_chain([30, 31, 32], "a")      # nodes 0, 1, 2
    tree.add_chain([40, 41, 42], "b")      # nodes 3, 4, 5
    tree.add_chain([40, 50], "c")          # node 6 (parent 3)
    accepted = [3, 6]                      # 40, 50: skips nodes 0-2 and 4-5
    target = HFTarget(model)
    target.reset()
    target.forward(prefix)
    n_past = target.length
    pos = tree_positions(tree, n_past, 1)
    mask = tree_attention_mask(tree, n_past, 1, target.dtype)
    target.forward([root] + tree.tokens, pos, mask, n_logits=len(tree) + 1)
    target.keep(n_past + 1, [n_past + 1 + i for i in accepted])
    assert target.length == n_past + 1 + len(accepted)
    assert target.cache.get_seq_length() == target.length
    seq = prefix + [root, 40, 50]
    for nxt in (60, 61, 62):  # two more plain steps after the compaction
        got = target.forward([nxt])[0]
        seq.append(nxt)
        ref = _sequential_last_logits(model, seq)
        assert (got - ref).abs().max().item() < ATOL
    assert target.length == len(seq)


def test_keep_contiguous_is_a_crop(tiny_llama):
    target = HFTarget(tiny_llama)
    target.reset()
    target.forward([1, 2, 3, 4])
    target.forward([5, 6, 7, 8])
    target.keep(5, [5, 6])          # keep positions 0..6: tokens 1..7
    assert target.length == 7 and target.cache.get_seq_length() == 7
    got = target.forward([9])[0]
    ref = _sequential_last_logits(tiny_llama, [1, 2, 3, 4, 5, 6, 7, 9])
    assert (got - ref).abs().max().item() < ATOL
    target.keep(3, [])
    assert target.length == 3 and target.cache.get_seq_length() == 3


# ---- Engine with merged token trees ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa"])
def test_engine_merge_several_branches_is_exact(tiny_models, name):
    model = tiny_models[name]
    prompt = [3, 14, 15, 92, 65, 35]
    n = 30
    greedy = plain_greedy(model, prompt, n + 16)
    seq = prompt + greedy
    drafters = [
        SequenceDrafter(seq, "wrong", shift=1, limit=3),        # highest priority, always wrong
        SequenceDrafter(seq, "oracle", limit=4),               # right, second branch
        SequenceDrafter(seq[:len(prompt) + 10] + [(t + 2) % VOCAB for t in seq[len(prompt) + 10:]],
                        "half"),                               # right for 10 tokens, then wrong
    ]
    target = RecordingTarget(model)
    res = Engine(target, drafters, merge=True, max_depth=6).generate(prompt, n)
    assert res.output_ids == greedy[:n]
    assert res.stop_reason == "length"
    assert any(m for _, m, _ in target.log), "no forward used a tree mask: the tree was never branched"
    assert res.sources["wrong"].accepted == 0 and res.sources["wrong"].proposed > 0
    assert res.sources["oracle"].accepted + res.sources["half"].accepted > 0
    assert res.forwards < n  # the oracle branch pays even though a wrong drafter has priority
    # without merge the wrong drafter wins every step: one token per forward
    plain = Engine(model, [SequenceDrafter(seq, "wrong", shift=1), SequenceDrafter(seq, "oracle")],
                   merge=False).generate(prompt, n)
    assert plain.output_ids == greedy[:n] and plain.forwards == n
    assert plain.sources["oracle"].proposed == 0


def test_engine_merge_respects_tree_budget(tiny_llama):
    prompt = [5, 6, 7, 8]
    greedy = plain_greedy(tiny_llama, prompt, 24)
    seq = prompt + greedy
    drafters = [SequenceDrafter(seq, f"w{s}", shift=s) for s in (1, 2, 3)] + [SequenceDrafter(seq, "oracle")]
    target = RecordingTarget(tiny_llama)
    res = Engine(target, drafters, merge=True, max_depth=8, tree_budget=10).generate(prompt, 20)
    assert res.output_ids == greedy[:20]
    # pending tokens + at most 10 tree nodes per forward
    assert all(n - (len(prompt) if i == 0 else 1) <= 10 for i, (n, _, _) in enumerate(target.log))
    # first step at full depth: the first drafter's 8 nodes + 2 of the second fill the budget; the oracle is left out
    assert target.log[0][0] == len(prompt) + 10
    # Every step emits one token (the shifted drafters are always wrong) until the oracle gets a turn. Depth is
    # min(8, tokens left - 1), so the shifted drafters fill the 10-node budget (w1 + w2 at depth >= 5, w1 + w2 + w3
    # at depth 4) until depth 3 (3+3+3 = 9 nodes): only then is the oracle asked; its 1 node is accepted (2 tokens),
    # and the same happens at depth 1 for the last two tokens.
    assert drafters[3].calls == [(len(prompt) + 16, 3), (len(prompt) + 18, 1)]
    assert res.sources["oracle"].accepted == res.sources["oracle"].proposed == 2


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_engine_random_trees_exact(tiny_llama_sdpa, data):
    """Random mixtures of right, half-right and wrong branches, merged into trees: output is plain greedy."""
    model = tiny_llama_sdpa
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), label="prompt")
    n = data.draw(st.integers(1, 24), label="n")
    greedy = plain_greedy(model, prompt, n + 48)
    seq = prompt + greedy
    drafters = []
    for j in range(data.draw(st.integers(1, 4), label="drafters")):
        cut = data.draw(st.integers(0, len(greedy)), label="right for")
        shift = data.draw(st.integers(0, 3), label="shift")
        lim = data.draw(st.integers(1, 12), label="limit")
        drafters.append(SequenceDrafter(seq[:len(prompt) + cut] + [(t + shift) % VOCAB for t in seq[len(prompt) + cut:]],
                                        f"d{j}", limit=lim))
    depth = data.draw(st.sampled_from([1, 2, 5, 8, 16, 48]), label="depth")
    budget = data.draw(st.integers(1, 64), label="budget")
    res = Engine(model, drafters, merge=True, max_depth=depth, tree_budget=budget).generate(prompt, n)
    assert res.output_ids == greedy[:n]
    assert len(res.output_ids) == n and res.forwards <= n



def test_verified_kv_reads_the_chosen_layers_of_the_cache(tiny_llama):
    target = HFTarget(tiny_llama)
    target.reset()
    target.forward([1, 2, 3, 4, 5])
    cfg = tiny_llama.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = target.verified_kv([1, -2], 3)
    assert len(kv) == 2
    for (k, v), layer in zip(kv, (1, 0), strict=True):
        assert k.shape == v.shape == (1, cfg.num_key_value_heads, 3, head_dim) and k.dtype == target.dtype
        # the first 3 positions of that layer, as a fresh 3-token forward caches them
        ref = HFTarget(tiny_llama)
        ref.reset()
        ref.forward([1, 2, 3])
        (rk, rv), = ref.verified_kv([layer], 3)
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)
    for n in (0, 6):
        with pytest.raises(ValueError, match="cached positions"):
            target.verified_kv([0], n)
    with pytest.raises(ValueError, match="out of range"):
        target.verified_kv([cfg.num_hidden_layers], 2)
