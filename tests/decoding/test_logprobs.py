"""Token log-probabilities: emitted tokens' (from verify rows) against plain decoding's, prompt scoring against
transformers' own ``log_softmax(model(ids).logits)``.

Tolerance: verify rows differ from plain decoding's single-token rows by float rounding (~1e-4 logits in float32);
log-probabilities are compared within 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SequenceDrafter, plain_greedy

from redraft.decoding.engine import Engine
from redraft.decoding.logprobs import row_logprobs, score_prompt
from redraft.decoding.sampling import SamplingParams
from redraft.runtimes.transformers.target import HFTarget
from redraft.tree import TokenTree

TOL = 1e-3
PROMPT = [7, 21, 3, 88, 40, 12, 7, 21, 3]
N = 30


class TreeDrafter(SequenceDrafter):
    """The oracle's chain plus a wrong sibling at the first node: a token tree, whose accepted path skips a node."""

    def propose(self, context, max_depth):
        chain = super().propose(context, max_depth)
        if chain is None or len(chain) < 2:
            return chain
        tree = TokenTree.chain([(chain.tokens[0] + 1) % self.vocab], "oracle")
        tree.merge(chain, "oracle")
        assert not tree.is_chain
        return tree


def _reference(model, prompt, out, k):
    """Log-probabilities of ``out`` after ``prompt`` from one transformers forward over both (no cache)."""
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    rows = lp[len(prompt) - 1:len(prompt) - 1 + len(out)]
    return rows[torch.arange(len(out)), torch.tensor(out)], rows.topk(k, -1) if k else None


@pytest.mark.parametrize("k", [0, 1, 5])
def test_drafted_logprobs_match_plain_decoding(tiny_llama, k):
    want = plain_greedy(tiny_llama, PROMPT, N)
    plain = Engine(tiny_llama, []).generate(PROMPT, N, logprobs=k)
    oracle = SequenceDrafter(PROMPT + want)
    spec = Engine(tiny_llama, [oracle], max_depth=8).generate(PROMPT, N, logprobs=k)
    assert spec.output_ids == plain.output_ids == want
    assert spec.forwards < plain.forwards  # drafts were accepted: verify rows produced most tokens
    assert len(spec.logprobs) == len(plain.logprobs) == N
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.token == b.token
        assert abs(a.logprob - b.logprob) < TOL
        assert len(a.top_ids) == len(b.top_ids) == k
        assert a.top_ids[:1] == b.top_ids[:1] == ([a.token] if k else [])  # greedy: the chosen token is the top one
        assert all(abs(x - y) < TOL for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True))
    ref, top = _reference(tiny_llama, PROMPT, want, k)
    assert max(abs(a.logprob - r) for a, r in zip(spec.logprobs, ref.tolist(), strict=True)) < TOL
    if k:
        assert [a.top_ids for a in spec.logprobs] == top.indices.tolist()


def test_tree_verify_rows_give_the_accepted_paths_logprobs(tiny_llama):
    want = plain_greedy(tiny_llama, PROMPT, N)
    spec = Engine(tiny_llama, [TreeDrafter(PROMPT + want)], max_depth=6).generate(PROMPT, N, logprobs=2)
    assert spec.output_ids == want
    ref, _ = _reference(tiny_llama, PROMPT, want, 0)
    assert max(abs(a.logprob - r) for a, r in zip(spec.logprobs, ref.tolist(), strict=True)) < TOL


def test_sampled_logprobs_are_raw_and_reproducible(tiny_llama):
    """Under sampling the recorded value is the raw (pre-temperature) log-probability of the sampled token."""
    s = SamplingParams(temperature=1.5, top_k=10, seed=3)
    a = Engine(tiny_llama, []).generate(PROMPT, 12, sampling=s, logprobs=3)
    b = Engine(tiny_llama, []).generate(PROMPT, 12, sampling=s, logprobs=3)
    assert a.output_ids == b.output_ids and [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
    ref, _ = _reference(tiny_llama, PROMPT, a.output_ids, 0)
    assert max(abs(x.logprob - r) for x, r in zip(a.logprobs, ref.tolist(), strict=True)) < TOL


def test_no_logprobs_by_default(tiny_llama):
    assert Engine(tiny_llama, []).generate(PROMPT, 3).logprobs is None


def test_score_prompt_equals_transformers_log_softmax(tiny_llama, tiny_qwen2):
    for model in (tiny_llama, tiny_qwen2):
        ids = PROMPT + [5, 9, 60, 2]
        got = score_prompt(HFTarget(model), ids, 3)
        assert got[0] is None and len(got) == len(ids)
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for i in range(1, len(ids)):
            assert got[i].token == ids[i]
            assert abs(got[i].logprob - lp[i - 1, ids[i]].item()) < 1e-5
            assert got[i].top_ids == lp[i - 1].topk(3).indices.tolist()


def test_long_prompts_are_scored_in_chunks(tiny_llama):
    ids = (PROMPT * 4)[:33]
    whole = score_prompt(HFTarget(tiny_llama), ids, 2)
    for chunk in (1, 4, 10, 32):
        got = score_prompt(HFTarget(tiny_llama), ids, 2, chunk=chunk)
        assert got[0] is None and len(got) == len(ids)
        assert [g.token for g in got[1:]] == ids[1:]
        assert max(abs(g.logprob - w.logprob) for g, w in zip(got[1:], whole[1:], strict=True)) < 1e-4


def test_score_prompt_of_one_token_and_bad_k(tiny_llama):
    assert score_prompt(HFTarget(tiny_llama), [4], 0) == [None]
    with pytest.raises(ValueError, match="k must be"):
        row_logprobs(torch.zeros(2, 8), [0], [1], 21)
    with pytest.raises(ValueError, match="no token ids"):
        score_prompt(HFTarget(tiny_llama), [], 0)
