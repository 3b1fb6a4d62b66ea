"""Grouped-query heads handed to torch's SDPA as they are (``enable_gqa``, what :func:`sdpa_gqa_on_cpu` turns on for
masked forwards on the CPU) give the logits transformers' ``repeat_kv`` path gives, bit for bit: a prompt, a
multi-row forward on a cache, a tree-masked verify forward and the one-token step after it."""

import os

import pytest
import torch

from redraft.decoding.verify import tree_attention_mask, tree_positions
from redraft.runtimes.transformers.target import HFTarget, sdpa_gqa_on_cpu
from redraft.tree import TokenTree
from tests.conftest import build_tiny

PROMPT = [5, 17, 3, 90, 42, 7, 7, 64, 12, 50, 8, 33, 21, 9, 70, 2]


def _rows(target: HFTarget) -> list[torch.Tensor]:
    tree, parent = TokenTree(), -1
    for d in range(4):
        node = tree.add_node(parent, 10 + d, "a")
        tree.add_node(parent, 40 + d, "b")
        parent = node
    target.reset()
    out = [target.forward(PROMPT, n_logits=4), target.forward([3, 4, 5, 6, 7], n_logits=5)]
    n_past = target.length
    out.append(target.forward([8] + tree.tokens, tree_positions(tree, n_past, 1),
                              tree_attention_mask(tree, n_past, 1, target.dtype), n_logits=len(tree) + 1))
    target.crop(n_past + 1)
    out.append(target.forward([11]))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_grouped_heads_in_sdpa_give_repeat_kvs_logits(kind, monkeypatch):
    from transformers.integrations import sdpa_attention

    target = HFTarget(build_tiny(kind))  # 4 query heads over 2 key/value heads
    assert target.model.config.num_key_value_heads < target.model.config.num_attention_heads
    copies = []
    inner = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: copies.append(n) or inner(h, n))
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    copied = _rows(target)
    assert copies  # the masked forwards took the copying path
    copies.clear()
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    grouped = _rows(target)
    assert not copies  # and now none did
    for a, b in zip(copied, grouped, strict=True):
        assert torch.equal(a, b)


def test_a_cpu_target_turns_it_on_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    sdpa_gqa_on_cpu()
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    HFTarget(build_tiny("llama"))
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "0"  # the user's choice stands
