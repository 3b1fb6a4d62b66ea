"""Lossless sampling: seeded speculative sampling equals seeded plain sampling token for token, and the sampled
distribution is the target's (chi-square per draft source); logits processors and stop strings with drafts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import build_tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.decoding.sampling import SamplingParams, TokenChooser, gumbel_noise
from redraft.decoding.stopping import StopStrings
from redraft.drafters import CorpusDrafter, NgramDrafter
from redraft.drafters.base import AcceptanceGuard
from redraft.tree import TokenTree

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_model():
    """A tiny Llama with an 8-token vocabulary and a moderately peaked output distribution."""
    m = build_tiny("llama", "eager", seed=3, vocab_size=SMALL_VOCAB)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(0.15)  # soften: several tokens carry real probability
    return m


class ArgmaxDrafter:
    """Point-mass drafter proposing the target's greedy continuation (probable, so often accepted when sampling)."""

    name = "argmax"
    guard = None  # never pauses itself

    def __init__(self, model, k: int) -> None:
        self.model, self.k = model, k

    def bind(self, target) -> None:
        pass

    def begin(self, prompt):
        pass

    @torch.no_grad()
    def propose(self, context, max_depth):
        ids = torch.tensor([context.tolist()])
        out = []
        for _ in range(min(self.k, max_depth)):
            nxt = int(self.model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        return TokenTree.chain(out, self.name)

    def observe(self, proposed, accepted, emitted):
        pass


class TreeArgmaxDrafter(ArgmaxDrafter):
    """Proposes the top-3 first tokens as siblings, each followed by nothing (a wide tree)."""

    name = "tree"

    @torch.no_grad()
    def propose(self, context, max_depth):
        logits = self.model(input_ids=torch.tensor([context.tolist()])).logits[0, -1]
        top = torch.topk(logits, 3).indices.tolist()
        return TokenTree.from_parents(top, [-1, -1, -1], self.name)


def hf_processed(logits: torch.Tensor, params: SamplingParams, contexts: list[list[int]]) -> torch.Tensor:
    """Hugging Face's own processing of each row, in ``generate``'s order: repetition penalty (a processor), then
    the temperature, top-k and top-p warpers. Row r is processed with contexts[r] as its input ids."""
    from transformers import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = []
    if params.repetition_penalty not in (None, 1.0):  # None: the model's generation_config (none here)
        procs.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if not params.greedy:
        procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
    rows = []
    for r, ctx in enumerate(contexts):
        row = logits[r:r + 1].float().clone()
        for proc in procs:
            row = proc(torch.tensor([ctx], dtype=torch.long), row)
        rows.append(row)
    return torch.cat(rows)


def _exact_second_token_marginal(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """p(t2) = sum_t1 p(t1) p(t2 | t1), from the model's logits processed by Hugging Face's own warpers."""
    with torch.no_grad():
        l1 = model(input_ids=torch.tensor([prompt])).logits[0, -1:]
        p1 = hf_processed(l1, params, [prompt]).softmax(-1)[0]
        batch = [prompt + [t] for t in range(SMALL_VOCAB)]
        p2 = hf_processed(model(input_ids=torch.tensor(batch)).logits[:, -1], params, batch).softmax(-1)
    return (p1[:, None] * p2).sum(0).double().numpy()


def _drafters(kind: str, model, corpus):
    if kind == "plain":
        return [], False
    if kind == "argmax":
        return [ArgmaxDrafter(model, 4)], False
    if kind == "tree":
        return [TreeArgmaxDrafter(model, 1)], True
    if kind == "corpus":
        return [CorpusDrafter(corpus, k=4, min_n=1, max_n=4, guard=AcceptanceGuard(0.0))], False
    if kind == "ngram":
        return [NgramDrafter(k=4, min_n=1, max_n=3, guard=AcceptanceGuard(0.0))], False
    raise ValueError(kind)


@pytest.mark.parametrize("params,prompt", [
    (SamplingParams(temperature=1.0), [1, 2, 3, 1, 2]),
    # the n-gram draft after "1 2" is 7, a token top-k keeps (3, the draft of the first prompt, is cut here)
    (SamplingParams(temperature=1.4, top_k=5, top_p=0.8), [1, 2, 7, 1, 2]),
], ids=["T1", "T1.4-topk5-topp0.8"])
@pytest.mark.parametrize("kind", ["plain", "argmax", "tree", "corpus", "ngram"])
def test_second_token_distribution_is_the_targets(small_model, kind, params, prompt):
    """Chi-square goodness of fit of the 2nd sampled token against the exact marginal, per draft source, plain
    T=1 and with a temperature, top-k and top-p (the expected marginal from Hugging Face's warpers)."""
    # corpus spans planted so that the suffix of prompt + t1 often matches and drafts get verified
    corpus = Corpus.from_spans([prompt + [t, u] for t in range(SMALL_VOCAB) for u in (0, 5)],
                               vocab_size=SMALL_VOCAB)
    drafters, merge = _drafters(kind, small_model, corpus)
    engine = Engine(small_model, drafters, merge=merge)
    n = 1200
    counts = np.zeros(SMALL_VOCAB)
    accepted = 0
    for seed in range(n):
        res = engine.generate(prompt, 2, sampling=replace(params, seed=seed))
        counts[res.output_ids[1]] += 1
        accepted += sum(s.accepted for s in res.sources.values())
    expected = _exact_second_token_marginal(small_model, prompt, params) * n
    assert not counts[expected == 0].any(), "a token the warpers remove was sampled"
    keep = expected >= 5  # chi-square needs enough expected counts per cell; pool the rest
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat, p = chisquare(obs, exp * obs.sum() / exp.sum())
    assert p > 0.01, f"{kind}: chi-square rejects (p={p:.4f}) observed={counts} expected={expected.round(1)}"
    if kind != "plain":
        assert accepted > 0, f"{kind}: no draft was ever accepted, the test proves nothing"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=1.3, top_k=5, seed=12),
    SamplingParams(temperature=0.7, top_p=0.8, seed=13),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=14),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
])
def test_seeded_sampling_identical_across_draft_depths(tiny_llama, params):
    """Seeded speculative sampling reproduces seeded plain sampling token for token, at every draft depth."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ref = Engine(tiny_llama, []).generate(prompt, 40, sampling=params)
    accepted = 0
    for k in (1, 2, 5, 8, 16):
        corpus = Corpus.from_spans([prompt + ref.output_ids], vocab_size=tiny_llama.config.vocab_size)
        eng = Engine(tiny_llama, [CorpusDrafter(corpus, k=k), NgramDrafter(k=k, min_n=1)], max_depth=k)
        res = eng.generate(prompt, 40, sampling=params)
        assert res.output_ids == ref.output_ids, f"k={k}"
        accepted += sum(s.accepted for s in res.sources.values())
    assert accepted > 0  # the replayed corpus must have made drafts count


def test_greedy_choice_breaks_ties_at_the_first_best_index():
    """A greedy row whose best score is tied picks the lowest such index (torch.argmax, plain decoding's choice),
    with margin 0; a row with a unique best picks it with its top-2 gap."""
    ch = TokenChooser(SamplingParams(), vocab=6)
    ch.reset([1])
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0],   # best tied at 1, 3, 5
                           [5.0, 0.0, 0.0, 0.0, 0.0, 5.0],   # tied at both ends
                           [0.0, 1.0, 2.0, 4.5, 2.0, 0.0]])  # unique best
    choices, margins = ch.choose(logits, [1, 2, 3])
    assert choices == [1, 0, 3] == logits.argmax(-1).tolist()
    assert margins.tolist() == [0.0, 0.0, 2.5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-np.inf, -2.0, 0.0, 0.5, 1.0, 3.0]), min_size=5, max_size=5),
                min_size=1, max_size=4))
def test_the_greedy_fast_path_chooses_as_topk_and_leaves_the_logits_as_they_were(rows):
    """Plain greedy without processors takes a numpy path (argmax, then the runner-up with the best masked): its
    choices and margins equal the general path's (torch's topk, ties to the first best index), on rows full of ties
    and -inf, and the logits it read are unchanged."""
    rows = [r if max(r) > -np.inf else [0.0] + r[1:] for r in rows]  # a row of only -inf is refused, not chosen
    logits = torch.tensor(rows, dtype=torch.float32)
    before = logits.clone()
    ch = TokenChooser(SamplingParams(), vocab=5)
    ch.reset([1])
    choices, margins = ch.choose(logits, list(range(len(rows))))
    assert torch.equal(logits, before)
    top = torch.topk(logits, 2, dim=-1).values
    assert choices == logits.argmax(-1).tolist()
    assert margins.tolist() == (top[:, 0] - top[:, 1]).tolist()
    ch.margins = False  # no runner-up pass: the same choices, no gaps
    assert ch.choose(logits, list(range(len(rows)))) == (choices, None)
    assert torch.equal(logits, before)


def test_seed_changes_output(tiny_llama):
    prompt = [3, 4, 5]
    a = Engine(tiny_llama, []).generate(prompt, 30, sampling=SamplingParams(temperature=1.0, seed=1)).output_ids
    b = Engine(tiny_llama, []).generate(prompt, 30, sampling=SamplingParams(temperature=1.0, seed=2)).output_ids
    assert a != b


def test_gumbel_noise_is_keyed_by_position_only():
    both = gumbel_noise(7, [10, 11], 32)
    assert torch.equal(both[1], gumbel_noise(7, [11], 32)[0])
    assert not torch.equal(gumbel_noise(7, [10], 32), gumbel_noise(8, [10], 32))


def test_repetition_penalty_sees_tree_ancestors():
    """A tree node's row is penalised for its ancestors' tokens, the root row only for the committed context."""
    ch = TokenChooser(SamplingParams(repetition_penalty=2.0), vocab=4)
    ch.reset([0])
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0], [1.0, 3.0, 2.5, 0.0]])
    choices, _ = ch.choose(logits, [1, 2], [[], [1]])
    assert choices == [1, 2]  # row 1 saw token 1 as an ancestor: 3.0 / 2 < 2.5


def _logits(kind: str, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    if kind == "random":
        return torch.randn(rows, vocab, generator=gen) * 2.5
    if kind == "quarters":
        # four equal logits and the rest far below: probabilities exactly 0, 1/4, 1/2, 3/4 after the cumulative sum,
        # so top_p = 0.5 puts a cumulative probability exactly on the nucleus boundary
        out = torch.full((rows, vocab), -1e4)
        for r in range(rows):
            out[r, torch.randperm(vocab, generator=gen)[:4]] = 1.0
        return out
    # few distinct values: ties everywhere, at the top-k boundary and inside the top-p nucleus; zeros and negatives
    return torch.randint(-2, 3, (rows, vocab), generator=gen).float()


@pytest.mark.parametrize("logits_kind", ["random", "ties", "quarters"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3, seed=1),
    SamplingParams(temperature=0.8, top_p=0.7, seed=2),
    SamplingParams(temperature=1.0, top_p=0.5, seed=8),
    SamplingParams(temperature=1.5, top_k=5, top_p=0.85, seed=3),
    SamplingParams(temperature=1.0, top_k=1, seed=4),
    SamplingParams(temperature=0.6, top_p=0.01, seed=5),
    SamplingParams(temperature=2.0, top_k=12, top_p=1.0, seed=6),  # both off (k = vocab)
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.6),
    SamplingParams(temperature=1.2, top_k=4, top_p=0.9, repetition_penalty=1.4, seed=7),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-rp{p.repetition_penalty}")
def test_processors_match_hugging_face(params, logits_kind):
    """Top-k, top-p, temperature and repetition penalty give Hugging Face's processed scores: on the same logits,
    TokenChooser's choice and top-2 margin equal argmax / gap of HF's processors plus the same Gumbel noise, for 300
    rows (each its own noise draw and its own repetition context: committed ids plus the row's tree ancestors)."""
    rows, vocab = 300, 12
    logits = _logits(logits_kind, rows, vocab)
    committed = [0, 3, 3, 7]
    extra = [[(r + j) % vocab for j in range(r % 3)] for r in range(rows)]  # 0, 1 or 2 ancestor ids per row
    positions = list(range(100, 100 + rows))
    chooser = TokenChooser(params, vocab)
    chooser.reset(committed)
    choices, margins = chooser.choose(logits, positions, extra)

    ref = hf_processed(logits, params, [committed + e for e in extra])
    if not params.greedy:
        ref = ref + gumbel_noise(params.seed, positions, vocab)
    top2 = ref.topk(2, dim=-1).values
    ref_margins = (top2[:, 0] - top2[:, 1]) * (1.0 if params.greedy else params.temperature)
    assert choices == ref.argmax(-1).tolist()
    finite = torch.isfinite(ref_margins)
    assert torch.equal(finite, torch.isfinite(margins))
    assert torch.allclose(margins[finite].double(), ref_margins[finite].double(), atol=1e-5, rtol=1e-5)
    if not params.greedy and (params.top_k or params.top_p < 1.0) and params.top_k != vocab:
        assert (~torch.isfinite(ref)).any(), "the warpers removed nothing: the case proves nothing"


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


class CharTokenizer:
    """Each id decodes to a fixed piece of text (multi-character), for stop-string tests."""

    pieces = ["ab", "c", "de", "f", "gh", "i", "jk", "l"] * 12

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_stop_string_split_across_tokens_inside_accepted_chunk(tiny_llama):
    """The stop string spans two tokens in the middle of an 8-token accepted chunk: the output ends there."""
    prompt = [9, 10, 11]
    ref = Engine(tiny_llama, []).generate(prompt, 24).output_ids
    tok = CharTokenizer()
    text = tok.decode(ref)
    # a stop string made of the last char of token 3 and the first char of token 4
    t3, t4 = tok.pieces[ref[3]], tok.pieces[ref[4]]
    stop_str = t3[-1] + t4[0]
    cut = text.find(stop_str)
    corpus = Corpus.from_spans([prompt + ref], vocab_size=tiny_llama.config.vocab_size)
    stop = StopStrings(tok, [stop_str])
    res = Engine(tiny_llama, [CorpusDrafter(corpus, k=8)], max_depth=8).generate(prompt, 24, stop=stop)
    assert res.stop_reason == "stop"
    assert res.accepted_per_forward[0] >= 4  # the stop came inside a multi-token accepted chunk
    assert stop.text == text[:cut]
    assert stop_str in tok.decode(res.output_ids) and stop_str not in tok.decode(res.output_ids[:-1])
    assert res.output_ids == ref[:len(res.output_ids)]


def test_a_step_chosen_without_gaps_refuses_to_give_one():
    from redraft.decoding.planner import Draft
    from redraft.decoding.step import Step

    step = Step(Draft(), [1], 0, torch.zeros(1, 4), [1], None, [0], None, [], [0], [0])
    with pytest.raises(ValueError, match="skipped the top-2 gaps"):
        step.margin(0)
