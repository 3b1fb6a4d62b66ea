"""Extreme but legal sampling values give valid distributions; non-finite logits are an error (issue 11, item 2).

Before: temperature 1e-300 turned logits / T into inf / NaN and every token became id 0; a repetition penalty of
1e-300 made every seen positive logit inf and chose the first of them.
"""

from __future__ import annotations

import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import build_tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.decoding.sampling import NonFiniteLogitsError, SamplingParams, TokenChooser
from redraft.drafters import CorpusDrafter, NgramDrafter

VANISHING = [1e-300, 1e-45, 5e-324, sys.float_info.min, 1e-310]  # the last three: subnormal / smallest normal
TINY_P = [1e-300, 5e-324, 1e-17, 1e-9]
PENALTIES = [5e-324, 1e-300, 1e-250, 1e-30, 0.5, 2.0, 1e30, 1e250, 1e300, sys.float_info.max]

logit_rows = st.lists(st.floats(-30, 30, width=32), min_size=6, max_size=6).filter(lambda r: len(set(r)) == 6)


def exact_penalised(row: list[float], seen: set[int], penalty: float) -> list[Fraction]:
    """HF/CTRL repetition penalty in exact arithmetic."""
    p = Fraction(penalty)
    return [(Fraction(x) / p if x > 0 else Fraction(x) * p) if i in seen else Fraction(x) for i, x in enumerate(row)]


def choose(params: SamplingParams, rows: list[list[float]], seen=(), position: int = 0) -> list[int]:
    ch = TokenChooser(params, vocab=len(rows[0]))
    ch.reset(list(seen))
    return ch.choose(torch.tensor(rows, dtype=torch.float32), [position + r for r in range(len(rows))])[0]


def argmax(values) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(logit_rows, min_size=1, max_size=3), st.sampled_from(VANISHING), st.integers(0, 6),
       st.sampled_from([1.0, 0.5] + TINY_P), st.integers(0, 2**40), st.sampled_from([1.0] + PENALTIES),
       st.sets(st.integers(0, 5)))
def test_vanishing_temperature_chooses_the_argmax(rows, t, top_k, top_p, seed, penalty, seen):
    """Alone and combined with top-k, top-p and any repetition penalty: the (exactly penalised) argmax, or a token
    within 50 T of it (any other has probability < e^-50). Gaps that small are not rare here: a huge penalty
    divides seen positive logits down to ~1e-250, where even 1e-45 is a large temperature."""
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, repetition_penalty=penalty, seed=seed)
    rows32 = [np.float32(r).tolist() for r in rows]
    got = choose(params, rows32, seen, position=seed % 1000)
    for r, choice in zip(rows32, got, strict=True):
        scores = exact_penalised(r, seen if penalty != 1.0 else set(), penalty)
        best = max(scores)
        near = [i for i, x in enumerate(scores) if best - x <= 50 * Fraction(t)]
        assert choice in near


@pytest.mark.parametrize("t", VANISHING)
def test_vanishing_temperature_is_greedy_on_ordinary_logits(t):
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 4, (64, 50)).astype(np.float32)
    want = rows.argmax(-1).tolist()
    for seed in range(5):
        assert choose(SamplingParams(temperature=t, seed=seed), rows.tolist(), position=100 * seed) == want
        assert choose(SamplingParams(temperature=t, top_k=7, top_p=0.3, seed=seed), rows.tolist()) == want


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(logit_rows, min_size=1, max_size=3), st.sampled_from([1e-3, 1.0, 7.0, 1e30, 1e300, 1.7e308]),
       st.integers(0, 2**40))
def test_top_k_1_and_tiny_top_p_choose_the_argmax_at_any_temperature(rows, t, seed):
    rows32 = [np.float32(r).tolist() for r in rows]
    want = [argmax(r) for r in rows32]
    assert choose(SamplingParams(temperature=t, top_k=1, seed=seed), rows32) == want
    if t <= 1e30:  # beyond, the distribution is uniform to float64 precision: no token is "the top" any more
        for p in TINY_P:
            assert choose(SamplingParams(temperature=t, top_p=p, seed=seed), rows32) == want


def test_huge_temperature_is_near_uniform():
    row = [[8.0, 4.0, 2.0, 1.0, 0.0, -3.0, -9.0, -20.0]]
    for t in (1e30, 1e300, sys.float_info.max):
        counts = np.bincount([choose(SamplingParams(temperature=t, seed=3), row, position=i)[0]
                              for i in range(1600)], minlength=8)
        assert chisquare(counts).pvalue > 1e-3, (t, counts)


@pytest.mark.parametrize("penalty", PENALTIES)
def test_greedy_repetition_penalty_extremes(penalty):
    rng = np.random.default_rng(int(np.log10(penalty) + 400))
    for _ in range(50):
        row = np.float32(rng.normal(0, 5, 12)).tolist()
        seen = set(rng.choice(12, 4, replace=False).tolist())
        assert choose(SamplingParams(repetition_penalty=penalty), [row], seen) == [
            argmax(exact_penalised(row, seen, penalty))]


def test_masked_tokens_are_allowed_and_never_chosen():
    row = [[float("-inf"), 1.0, float("-inf"), 0.5]]
    for params in (SamplingParams(), SamplingParams(temperature=1e300, seed=1), SamplingParams(temperature=1e-300),
                   SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(repetition_penalty=1e-300)):
        for pos in range(40):
            assert choose(params, row, seen=[0, 1], position=pos)[0] in (1, 3)


@pytest.mark.parametrize("bad,what", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_non_finite_logits_are_an_error(bad, what, params):
    rows = [[1.0, 2.0, 3.0], [1.0, bad, 3.0]]
    with pytest.raises(NonFiniteLogitsError, match=rf"{what} logits for the token at position 8 \(verify row 1"):
        choose(params, rows, position=7)
    with pytest.raises(NonFiniteLogitsError, match="only -inf"):
        choose(params, [[float("-inf")] * 3])


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", -0.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -2.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")),
    ("seed", 1.5), ("seed", None),
])
def test_meaningless_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- through the engine: plain and drafted runs agree, vanishing temperature is greedy ---------------------------
ENGINE_CASES = [
    dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e-45, top_k=3, top_p=1e-300),
    dict(temperature=1.0, top_p=1e-300), dict(temperature=1e300, top_k=1), dict(temperature=0.0, top_k=1),
    dict(temperature=1e300), dict(temperature=1e-300, repetition_penalty=1e-300),
    dict(temperature=1e-300, repetition_penalty=1e300), dict(repetition_penalty=5e-324),
    dict(repetition_penalty=sys.float_info.max), dict(temperature=2.0, top_k=4, top_p=1e-9, repetition_penalty=1e-250),
]
GREEDY_LIKE = {0, 1, 2, 3, 4, 5}  # cases whose output must equal greedy (with the same repetition penalty)


@pytest.mark.parametrize("case", range(len(ENGINE_CASES)))
def test_engine_extreme_values_plain_and_drafted_agree(tiny_llama, case):
    params = SamplingParams(seed=5, **ENGINE_CASES[case])
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plain = Engine(tiny_llama, []).generate(prompt, 30, sampling=params)
    corpus = Corpus.from_spans([prompt + plain.output_ids], vocab_size=tiny_llama.config.vocab_size)
    drafted = Engine(tiny_llama, [CorpusDrafter(corpus, k=8), NgramDrafter(k=8, min_n=1)], max_depth=8).generate(
        prompt, 30, sampling=params)
    assert drafted.output_ids == plain.output_ids
    assert drafted.forwards < plain.forwards  # the drafts were used
    if case in GREEDY_LIKE:
        greedy = Engine(tiny_llama, []).generate(
            prompt, 30, sampling=SamplingParams(repetition_penalty=params.repetition_penalty))
        assert plain.output_ids == greedy.output_ids


def test_vanishing_temperature_with_penalty_is_greedy_with_penalty(tiny_llama):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for penalty in (1e-300, 1.3, 1e300):
        want = Engine(tiny_llama, []).generate(prompt, 25, sampling=SamplingParams(repetition_penalty=penalty))
        got = Engine(tiny_llama, []).generate(prompt, 25, sampling=SamplingParams(
            temperature=1e-300, repetition_penalty=penalty, seed=9))
        assert got.output_ids == want.output_ids


def test_model_with_nan_logits_raises():
    model = build_tiny("llama", "eager", seed=4)
    with torch.no_grad():
        model.get_output_embeddings().weight[7] = float("nan")
    for params in (SamplingParams(), SamplingParams(temperature=0.8)):
        with pytest.raises(NonFiniteLogitsError, match="NaN logits for the token at position 3"):
            Engine(model, []).generate([1, 2, 3], 5, sampling=params)
