"""The model's generation_config shapes the logits as in Hugging Face ``generate`` (issue 17, item 1).

Before: a model whose generation_config set repetition_penalty, no_repeat_ngram_size or min_new_tokens decoded in
redraft as if they were not there. Each setting alone and combined, on tiny models: plain, chain-drafted and
tree-drafted output equal ``model.generate(do_sample=False)`` token for token, with drafts that are right (the HF
answer frozen in a corpus) and wrong (the unshaped answer) so both acceptance and rejection are exercised.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
from conftest import RecordingTarget, build_tiny, hf_greedy
from transformers import GenerationConfig

from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.decoding.genconfig import GenerationConfigError, LogitsShaping
from redraft.decoding.sampling import SamplingParams, TokenChooser
from redraft.drafters import CorpusDrafter, NgramDrafter

PROMPT = [5, 17, 33, 2, 9, 5, 17]  # the issue's prompt
N = 40
EOS = 28  # the tiny Llama's second greedy token: EOS-based settings change the output early


@pytest.fixture(scope="module")
def model():
    """A private tiny Llama (seed 0, as in the issue): tests change its generation_config."""
    return build_tiny("llama", "sdpa", seed=0)


@contextmanager
def configured(model, **fields):
    """The model with these generation_config fields set, restored afterwards."""
    saved = copy.deepcopy(model.generation_config)
    for k, v in fields.items():
        setattr(model.generation_config, k, v)
    try:
        yield model
    finally:
        model.generation_config = saved


def eos_list(eos):
    return [eos] if eos is not None else []


def drafted_runs(model, prompt, n, eos, right, wrong, **engine_kw):
    """Chain and tree runs whose drafts come from ``right`` (the expected answer) and ``wrong`` (another answer).

    Returns {name: GenerationResult} and the RecordingTarget of the tree run (to check trees were verified).
    """
    vocab = model.config.vocab_size
    both = Corpus.from_spans([prompt + right, prompt + wrong], vocab_size=vocab)
    chain = Engine(model, [CorpusDrafter(Corpus.from_spans([prompt + right], vocab_size=vocab), k=8),
                           NgramDrafter(k=8, min_n=1)], eos_token_ids=eos_list(eos), max_depth=8, **engine_kw)
    wrong_chain = Engine(model, [CorpusDrafter(Corpus.from_spans([prompt + wrong], vocab_size=vocab), k=8)],
                         eos_token_ids=eos_list(eos), max_depth=8, **engine_kw)
    target = RecordingTarget(model)
    tree = Engine(target, [CorpusDrafter(both, k=8, tree_branches=4), NgramDrafter(k=8, min_n=1)],
                  eos_token_ids=eos_list(eos), max_depth=8, merge=True, **engine_kw)
    return {"chain": chain.generate(prompt, n), "wrong chain": wrong_chain.generate(prompt, n),
            "tree": tree.generate(prompt, n)}, target


CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.3), None),
    "repetition_penalty<1": (dict(repetition_penalty=0.7), None),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), None),
    "min_new_tokens": (dict(min_new_tokens=5), EOS),
    "min_length": (dict(min_length=len(PROMPT) + 6), EOS),
    "bad_words_ids": (dict(bad_words_ids=[[66, 28], [87]]), None),
    "bad_words_ids with a lone EOS (dropped, as in HF)": (dict(bad_words_ids=[[EOS], [66]]), EOS),
    "suppress_tokens": (dict(suppress_tokens=[28, 5]), None),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[66]), None),
    "forced_eos_token_id": (dict(forced_eos_token_id=EOS), None),
    "sequence_bias": (dict(sequence_bias=[[[28], -2.0], [[66, 28], 3.0]]), None),
    "exponential_decay_length_penalty": (dict(exponential_decay_length_penalty=(3, 1.6)), 87),
    "combined": (dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5, suppress_tokens=[87],
                      bad_words_ids=[[48, 15]], forced_eos_token_id=EOS), EOS),
    # order matters here: HF biases first, then penalises (the penalty of a biased logit differs)
    "sequence_bias+repetition_penalty": (dict(sequence_bias=[[[5], 2.0], [[28], 2.0], [[66], 2.0]],
                                              repetition_penalty=1.8), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_config_matches_hf_generate_plain_chain_and_tree(model, case):
    fields, eos = CASES[case]
    unshaped = Engine(model, [], eos_token_ids=eos_list(eos)).generate(PROMPT, N).output_ids
    with configured(model, **fields):
        want = hf_greedy(model, PROMPT, N, eos)
        assert want != unshaped, f"{case}: the setting does not change this output, the test proves nothing"
        plain = Engine(model, [], eos_token_ids=eos_list(eos)).generate(PROMPT, N)
        assert plain.output_ids == want
        runs, target = drafted_runs(model, PROMPT, N, eos, want, unshaped)
    for name, res in runs.items():
        assert res.output_ids == want, f"{case}: {name}"
    assert sum(s.accepted for s in runs["chain"].sources.values()) > 0  # drafts were verified and accepted
    assert any(tree_mask for _, tree_mask, _ in target.log), "no token tree was verified"


def test_issue_inputs_repetition_penalty(model):
    """The issue's inputs: tiny Llama seed 0, prompt [5, 17, 33, 2, 9, 5, 17], 40 tokens, repetition_penalty 1.3
    in the generation_config: redraft's plain output is HF's, not the unpenalised one it gave before."""
    unpenalised = Engine(model, [], generation_config=False).generate(PROMPT, N).output_ids
    with configured(model, repetition_penalty=1.3):
        want = hf_greedy(model, PROMPT, N)
        got = Engine(model, []).generate(PROMPT, N).output_ids
        explicit = Engine(model, [], generation_config=False).generate(
            PROMPT, N, sampling=SamplingParams(repetition_penalty=1.3)).output_ids
    assert got == want == explicit
    assert got[:2] == unpenalised[:2] and got != unpenalised


def test_forced_bos_and_begin_suppress_with_a_one_token_prompt(model):
    """forced_bos_token_id acts on a 1-token context, and then begin_suppress_tokens moves one token later (HF)."""
    prompt = [5]
    with configured(model, forced_bos_token_id=40, begin_suppress_tokens=[66, 28]):
        want = hf_greedy(model, prompt, 20)
        assert want[0] == 40
        assert Engine(model, []).generate(prompt, 20).output_ids == want


def test_flags_override_the_generation_config(model):
    """SamplingParams values replace the file's, also the "off" ones; unset ones (None) keep the file's."""
    nothing = Engine(model, [], eos_token_ids=[EOS]).generate(PROMPT, N).output_ids
    with configured(model, repetition_penalty=1.5, min_new_tokens=5):
        want = hf_greedy(model, PROMPT, N, EOS)
    with configured(model, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5):
        engine = Engine(model, [], eos_token_ids=[EOS])
        off = engine.generate(PROMPT, N, sampling=SamplingParams(
            repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)).output_ids
        other = engine.generate(PROMPT, N, sampling=SamplingParams(repetition_penalty=1.5,
                                                                   no_repeat_ngram_size=0)).output_ids
    assert off == nothing
    assert other == want != nothing


def test_generation_config_false_or_another_config(model):
    plain = Engine(model, []).generate(PROMPT, N).output_ids
    with configured(model, repetition_penalty=1.3):
        assert Engine(model, [], generation_config=False).generate(PROMPT, N).output_ids == plain
        want = hf_greedy(model, PROMPT, N)
    explicit = Engine(model, [], generation_config=GenerationConfig(repetition_penalty=1.3))
    assert explicit.generate(PROMPT, N).output_ids == want


def test_sampling_settings_of_the_generation_config_do_not_turn_sampling_on(model):
    plain = Engine(model, []).generate(PROMPT, N).output_ids
    with configured(model, do_sample=True, temperature=0.7, top_k=5, top_p=0.9):
        assert Engine(model, []).generate(PROMPT, N).output_ids == plain


def test_seeded_sampling_with_generation_config_is_identical_across_draft_depths(model):
    params = SamplingParams(temperature=1.0, seed=3)
    with configured(model, repetition_penalty=1.3, no_repeat_ngram_size=3):
        ref = Engine(model, []).generate(PROMPT, N, sampling=params).output_ids
        corpus = Corpus.from_spans([PROMPT + ref], vocab_size=model.config.vocab_size)
        for k in (2, 8):
            res = Engine(model, [CorpusDrafter(corpus, k=k)], max_depth=k).generate(PROMPT, N, sampling=params)
            assert res.output_ids == ref
            assert sum(s.accepted for s in res.sources.values()) > 0
        without = Engine(model, [], generation_config=False).generate(PROMPT, N, sampling=params).output_ids
    assert without != ref


def test_tree_rows_see_their_own_context():
    """Each verify row of a token tree is shaped with committed context + that node's ancestors + itself: the same
    choice and top-2 gap as transformers' processors called on that one full context."""
    shaping = LogitsShaping(repetition_penalty=1.7, no_repeat_ngram_size=2, sequence_bias=(((3, 4), -5.0),),
                            min_new_tokens=4)
    vocab, prompt = 12, [1, 2, 3, 1]
    ch = TokenChooser(SamplingParams(), vocab, shaping, eos_token_ids=[0], max_new_tokens=20)
    ch.reset(prompt)
    ch.commit([2])
    context = prompt + [2]
    # the root row, then a tree: node0=3 (depth 1), node1=4 and node2=5 under node0, node3=5 (depth 1)
    extra = [[], [3], [3, 4], [3, 5], [5]]
    logits = torch.randn(len(extra), vocab, generator=torch.Generator().manual_seed(0))
    logits[:, [0, 3, 4, 5]] += torch.tensor([9.0, 6.0, 5.5, 5.0])  # EOS and the tree's tokens lead every row
    choices, margins = ch.choose(logits, [len(context) + len(e) for e in extra], extra)
    procs = shaping.processors(len(prompt), 20, [0])
    for r, e in enumerate(extra):
        want = procs(torch.tensor([context + e]), logits[r:r + 1].double())[0]
        top2 = want.topk(2).values
        assert choices[r] == int(want.argmax()), f"row {r}"
        assert float(margins[r]) == pytest.approx(float(top2[0] - top2[1]))
    assert logits.argmax(-1).tolist() == [0] * len(extra)  # unshaped every row would choose EOS
    assert len(set(choices)) > 2  # rows with different ancestors chose differently


def test_nothing_configured_builds_no_processors(model):
    ch = TokenChooser(SamplingParams(), 96, LogitsShaping.of(model.generation_config), eos_token_ids=[EOS],
                      max_new_tokens=10)
    ch.reset(PROMPT)
    assert not ch.processors and ch.context == []


@pytest.mark.parametrize("field,value,match", [
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("no_repeat_ngram_size", -1, "no_repeat_ngram_size must be an integer >= 0"),
    ("bad_words_ids", [5, 6], "bad_words_ids must be a non-empty list of lists"),
    ("suppress_tokens", ["a"], "suppress_tokens must be a token id or a non-empty list"),
    ("exponential_decay_length_penalty", 3, "exponential_decay_length_penalty must be a"),
])
def test_bad_generation_config_values_name_the_field(model, field, value, match):
    with configured(model, **{field: value}):
        with pytest.raises(GenerationConfigError, match=f"generation_config.{match}"):
            Engine(model, []).generate(PROMPT, 4)


def test_processor_order_is_transformers_order(model):
    """Every supported setting at once builds the same processor classes in the same order as transformers'
    ``GenerationMixin._get_logits_processor`` (private API, read here only to notice when transformers changes)."""
    gc = GenerationConfig(sequence_bias=[[[5], 2.0]], repetition_penalty=1.3, no_repeat_ngram_size=2,
                          bad_words_ids=[[3]], min_length=9, min_new_tokens=2, forced_bos_token_id=4,
                          forced_eos_token_id=EOS, exponential_decay_length_penalty=(3, 1.5), suppress_tokens=[7],
                          begin_suppress_tokens=[8], eos_token_id=EOS, max_length=len(PROMPT) + N)
    model._prepare_special_tokens(gc, device="cpu")
    hf = model._get_logits_processor(gc, input_ids_seq_length=len(PROMPT), device="cpu")
    ours = LogitsShaping.of(gc).processors(len(PROMPT), N, [EOS])
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in hf]
    assert len(ours) == len(LogitsShaping.of(gc).applied())
