"""Engine.generate: lossless output (identical ids to plain greedy and to HF generate) under every kind of draft.

Exactness is checked on tiny random-weight Llama (eager and sdpa), Mixtral (MoE) and Qwen2 models. Corpora are
planted from the model's own greedy output, partly perturbed, so drafts really get accepted and also rejected;
each exactness test also asserts that drafts were accepted (otherwise it would prove nothing).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    MAX_POS,
    VOCAB,
    ConstantDrafter,
    RecordingTarget,
    SequenceDrafter,
    build_tiny,
    ceil_div,
    draw_planted_case,
    first_diff,
    generate_tracking,
    hf_greedy,
    plain_greedy,
    top2_gap,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.compose import build_drafters
from redraft.corpus import Corpus
from redraft.decoding.engine import MAX_DRAFT_DEPTH, Engine, GenerationResult
from redraft.decoding.exactness import near_tie_threshold
from redraft.decoding.runstats import speculation_line
from redraft.defaults import EXACT_SAFETY
from redraft.drafters import AcceptanceGuard, CorpusDrafter, NgramDrafter
from redraft.tree import TokenTree

DEPTHS = [1, 2, 5, 8, 16, 48]
PROMPT = [7, 21, 3, 88, 40, 12, 7, 21, 3]
N = 40


def _settings(n: int):
    # derandomize: the examples are the same on every run, so an fp32 near-tie can never make the suite flaky
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _explain(model, prompt, got, want) -> str:
    i = first_diff(got, want)
    if i < 0 or i >= len(want):
        return f"got {got}\nwant {want}"
    _, logits = hf_greedy(model, prompt, i + 1, scores=True)
    return (f"first difference at output position {i}: got {got[i:i + 5]}, want {want[i:i + 5]}; "
            f"top-2 logit gap there {top2_gap(logits[i]).item():.2e} (a gap < ~1e-5 would be an fp near-tie)")


# ---- the fixtures themselves -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa", "qwen2-sdpa"])
def test_tiny_models_have_clear_greedy_margins(tiny_models, name):
    """Greedy is deterministic and its top-2 logit gaps dwarf the ~5e-6 verify/sequential difference.

    They also clear exact mode's default near-tie threshold for verify rows, so near-tie settling (extra
    draft-free forwards) does not disturb the forward counts that the oracle tests assert.
    """
    model = tiny_models[name]
    for prompt in (PROMPT, [1], [50, 51, 52, 53]):
        ids, logits = hf_greedy(model, prompt, N, scores=True)
        assert plain_greedy(model, prompt, N) == ids == plain_greedy(model, prompt, N)
        assert (top2_gap(logits) > near_tie_threshold(logits, torch.float32, EXACT_SAFETY)).all()
    assert torch.finfo(next(model.parameters()).dtype).bits == 32 and not model.training


def test_eager_and_sdpa_share_weights(tiny_llama, tiny_llama_sdpa):
    assert tiny_llama.config._attn_implementation == "eager"
    assert tiny_llama_sdpa.config._attn_implementation == "sdpa"
    assert plain_greedy(tiny_llama, PROMPT, N) == plain_greedy(tiny_llama_sdpa, PROMPT, N)


# ---- exactness: hypothesis over prompts, planted corpora, depths ------------------------------------------------

def _exactness_property(model, max_examples: int):
    stats = {"runs": 0, "accepted": 0, "rejected": 0, "runs_accepting": 0, "depths": set(), "eos_runs": 0,
             "trees": 0}

    @_settings(max_examples)
    @given(data=st.data())
    def prop(data):
        # a corpus planted with the model's own output, perturbed in places; EOS none or an output token
        prompt, n, eos, want, span = draw_planted_case(data, model, 32)
        spans = [span]
        if data.draw(st.booleans(), label="clean copy first"):
            spans.insert(0, prompt + plain_greedy(model, prompt, n))
        if data.draw(st.booleans(), label="noise span"):
            spans.append(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), label="noise"))
        corpus = Corpus.from_spans(spans, vocab_size=VOCAB)
        k = data.draw(st.sampled_from(DEPTHS), label="K")
        minacc = data.draw(st.sampled_from([0.0, 0.5, 0.9]), label="minacc")
        drafters = [CorpusDrafter(corpus, k=k, guard=AcceptanceGuard(minacc))]
        if data.draw(st.booleans(), label="ngram"):
            drafters.append(NgramDrafter(k=k, min_n=data.draw(st.integers(1, 3), label="ngram min_n")))
        merge = data.draw(st.booleans(), label="merge")
        # exact mode settles near-tie rows with a draft-free forward; a large margin makes many rows "near-ties"
        exact = data.draw(st.sampled_from([(True, 1e-3), (True, 1.0), (True, 1e9), (False, 1e-3)]), label="exact")
        target = RecordingTarget(model)
        res = Engine(target, drafters, eos_token_ids=eos, max_depth=k, merge=merge, exact=exact[0],
                     exact_margin=exact[1]).generate(prompt, n)

        assert res.output_ids == want, _explain(model, prompt, res.output_ids, want)
        hf = hf_greedy(model, prompt, n, eos=eos[0] if eos else None)
        assert hf == want, "HF generate disagrees with plain greedy"
        assert res.stop_reason == ("eos" if eos and want[-1] == eos[0] else "length")
        assert res.forwards == len(res.accepted_per_forward) == len(target.log)
        if not eos and exact == (False, 1e-3):
            assert sum(res.accepted_per_forward) + res.forwards == len(res.output_ids)
        acc = sum(s.accepted for s in res.sources.values())
        prop_ = sum(s.proposed for s in res.sources.values())
        stats["runs"] += 1
        stats["accepted"] += acc
        stats["rejected"] += prop_ - acc
        stats["runs_accepting"] += acc > 0
        stats["depths"].add(k)
        stats["eos_runs"] += bool(eos)
        stats["trees"] += any(m for _, m, _ in target.log)

    prop()
    return stats


def test_exact_llama_hypothesis(tiny_llama):
    s = _exactness_property(tiny_llama, 150)
    assert s["runs"] >= 130
    assert s["accepted"] > 0 and s["runs_accepting"] >= s["runs"] // 4, s
    assert s["rejected"] > 0, s
    assert s["eos_runs"] > 0 and len(s["depths"]) >= 4, s
    assert s["trees"] > 0, s  # some steps verified a branched token tree (merge=True, corpus + n-gram)


def test_exact_mixtral_hypothesis(tiny_mixtral):
    s = _exactness_property(tiny_mixtral, 60)
    assert s["runs"] >= 50
    assert s["accepted"] > 0 and s["runs_accepting"] >= s["runs"] // 4, s
    assert s["rejected"] > 0, s


# ---- exactness: every depth on every model, deterministic --------------------------------------------------------

@pytest.fixture(scope="module")
def references(tiny_models):
    """Plain greedy output of PROMPT for each tiny model, checked once against HF generate."""
    refs = {}
    for name, model in tiny_models.items():
        ids = plain_greedy(model, PROMPT, N)
        assert ids == hf_greedy(model, PROMPT, N), name
        refs[name] = ids
    return refs


@pytest.mark.parametrize("k", DEPTHS)
@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "mixtral-sdpa", "qwen2-sdpa"])
def test_exact_every_depth_planted_corpus(tiny_models, references, name, k):
    model, want = tiny_models[name], references[name]
    # the output is in the corpus but with two ids changed: drafts are accepted up to each change, then rejected
    span = PROMPT + want
    bad = list(span)
    for i in (len(PROMPT) + 6, len(PROMPT) + 23):
        bad[i] = (bad[i] + 1) % VOCAB
    corpus = Corpus.from_spans([bad], vocab_size=VOCAB)
    res = Engine(model, build_drafters(corpus, k=k, minacc=0.0), max_depth=k).generate(PROMPT, N)
    assert res.output_ids == want, _explain(model, PROMPT, res.output_ids, want)
    c = res.sources["corpus"]
    assert c.accepted > 0, "no corpus draft was accepted"
    assert c.proposed > c.accepted, "no corpus draft was rejected"
    assert res.forwards < N
    assert max(res.accepted_per_forward) <= k


# ---- oracle and garbage drafters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 11))
def test_oracle_k4_exact_token_count(tiny_llama, references, n):
    want = references["llama-eager"]
    oracle = SequenceDrafter(PROMPT + want)
    res = Engine(tiny_llama, [oracle], max_depth=4).generate(PROMPT, n)
    assert res.output_ids == want[:n]
    assert len(res.output_ids) == n and res.stop_reason == "length"
    assert res.forwards == ceil_div(n, 5)
    assert res.tokens_per_forward == pytest.approx(n / ceil_div(n, 5))
    # every step asks for no more than fits the remaining budget
    assert all(d <= min(4, n - 1) for _, d in oracle.calls)


def test_oracle_tokens_per_forward_near_k_plus_1(tiny_llama, references):
    want = references["llama-eager"]
    res = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)], max_depth=4).generate(PROMPT, 40)
    assert res.output_ids == want
    assert res.forwards == 8 and res.tokens_per_forward == pytest.approx(5.0)
    assert res.accepted_per_forward == [4] * 8
    assert res.sources["oracle"].acceptance == 1.0


def test_oracle_deep_draft(tiny_llama):
    prompt = [9, 8, 7]
    want = plain_greedy(tiny_llama, prompt, 110)
    res = Engine(tiny_llama, [SequenceDrafter(prompt + want)], max_depth=48).generate(prompt, 110)
    assert res.output_ids == want
    assert res.forwards == ceil_div(110, 49)
    assert speculation_line(res) == f"speculation: {110 / 3:.2f} tokens/forward (3 forwards per 110 tokens)"


def test_max_depth_is_capped_at_48(tiny_llama):
    e = Engine(tiny_llama, [], max_depth=1000)
    assert e.max_depth == MAX_DRAFT_DEPTH == 48
    assert Engine(tiny_llama, [], max_depth=0).max_depth == 1


@pytest.mark.parametrize("name", ["llama-eager", "mixtral-sdpa"])
def test_wrong_drafter_costs_one_forward_per_token(tiny_models, references, name):
    model, want = tiny_models[name], references[name]
    wrong = SequenceDrafter(PROMPT + want + [0] * 50, "wrong", shift=1)
    res = Engine(model, [wrong], max_depth=8).generate(PROMPT, N)
    assert res.output_ids == want
    assert res.forwards == len(res.output_ids) == N
    st = res.sources["wrong"]
    assert st.accepted == 0 and st.proposed > N  # it proposed at every step and nothing stuck
    assert all(a == 0 for _, a, _ in wrong.observed)


def test_garbage_constant_drafter(tiny_qwen2, references):
    """A drafter proposing the same unrelated ids every step: plain greedy's ids, and exactly the forwards and
    accepted counts that its proposals earn against those ids (one forward per token where nothing matches)."""
    want = references["qwen2-sdpa"]
    garbage = [0, 1, 2, 3, 4, 5]
    target = RecordingTarget(tiny_qwen2)
    res = Engine(target, [ConstantDrafter(garbage)], max_depth=6).generate(PROMPT, N)
    assert res.output_ids == want
    emitted, accepted = 0, []
    while emitted < N:  # each forward: the matching prefix of the garbage draft, plus the bonus token
        depth = min(len(garbage), N - emitted - 1)
        n = next((i for i in range(depth) if garbage[i] != want[emitted + i]), depth)
        accepted.append(n)
        emitted += n + 1
    assert res.accepted_per_forward == accepted
    assert res.forwards == len(target.log) == len(accepted) == N - sum(accepted)
    assert res.sources["garbage"].accepted == sum(accepted) < res.sources["garbage"].proposed


def test_drafter_ignoring_max_depth_is_clamped(tiny_llama, references):
    want = references["llama-eager"]
    greedy_drafter = SequenceDrafter(PROMPT + want + [0] * 100, depth=100)
    target = RecordingTarget(tiny_llama)
    res = Engine(target, [greedy_drafter], max_depth=5).generate(PROMPT, 23)
    assert res.output_ids == want[:23]
    assert len(res.output_ids) == 23
    first, *rest = target.log
    assert first[0] == len(PROMPT) + 5 and all(n <= 1 + 5 for n, _, _ in rest)
    assert max(res.accepted_per_forward) <= 5


def test_observe_reports_each_step(tiny_llama, references):
    want = references["llama-eager"]
    d = SequenceDrafter(PROMPT + want, limit=3)
    res = Engine(tiny_llama, [d], max_depth=8).generate(PROMPT, 20)
    assert d.begun == 1
    assert len(d.observed) == res.forwards
    assert sum(e for _, _, e in d.observed) == 20
    assert sum(p for p, _, _ in d.observed) == res.sources["oracle"].proposed
    assert sum(a for _, a, _ in d.observed) == res.sources["oracle"].accepted == sum(res.accepted_per_forward)


def test_draft_depth_and_source_recorded_per_forward(tiny_llama, references):
    want = references["llama-eager"]
    oracle = SequenceDrafter(PROMPT + want, limit=3)
    garbage = ConstantDrafter([0, 1], "garbage")
    res = Engine(tiny_llama, [oracle, garbage], max_depth=8, merge=True).generate(PROMPT, 20)
    assert res.output_ids == want[:20]
    assert len(res.draft_depth_per_forward) == len(res.source_per_forward) == res.forwards
    assert all(a <= d for a, d in zip(res.accepted_per_forward, res.draft_depth_per_forward, strict=True))
    # both proposed at every step (merged, priority order); the oracle's 3-token chain sets the depth
    left = [20 - sum(a + 1 for a in res.accepted_per_forward[:i]) for i in range(res.forwards)]
    assert res.draft_depth_per_forward == [min(3, n - 1) for n in left]
    assert res.source_per_forward == [("oracle", "garbage") if n > 1 else () for n in left]
    solo = Engine(tiny_llama, [garbage, oracle], max_depth=8).generate(PROMPT, 20)  # first proposal wins
    # depth = the 2-token proposal, cut to what still fits the token budget (nothing when one token is left)
    left = [20 - sum(a + 1 for a in solo.accepted_per_forward[:i]) for i in range(solo.forwards)]
    assert solo.draft_depth_per_forward == [min(2, n - 1) for n in left]
    assert solo.source_per_forward == [("garbage",) if n > 1 else () for n in left]
    plain = Engine(tiny_llama, []).generate(PROMPT, 5)
    assert plain.draft_depth_per_forward == [0] * 5 and plain.source_per_forward == [()] * 5


def test_engine_binds_its_target_before_every_generation(tiny_llama, references):
    class Binding(SequenceDrafter):
        def bind(self, target):
            self.bound = getattr(self, "bound", []) + [target]

    d = Binding(PROMPT + references["llama-eager"])
    first, second = Engine(tiny_llama, [d]), Engine(tiny_llama, [d])
    first.generate(PROMPT, 3)
    second.generate(PROMPT, 3)
    first.generate(PROMPT, 3)
    assert d.bound == [first.target, second.target, first.target]  # a shared drafter follows the engine in use


# ---- EOS ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "mixtral-sdpa"])
def test_eos_inside_accepted_draft(tiny_models, name):
    model = tiny_models[name]
    prompt = [4, 5, 6]
    full = plain_greedy(model, prompt, 30)
    # an output token at position j (1 <= j <= 5) that does not occur earlier becomes the EOS id
    j = next(i for i in range(1, 6) if full[i] not in full[:i])
    eos = full[j]
    oracle = SequenceDrafter(prompt + full)  # proposes straight through the EOS
    streamed: list[list[int]] = []
    res = Engine(model, [oracle], eos_token_ids=[eos], max_depth=8).generate(prompt, 30, on_tokens=streamed.append)
    assert res.output_ids == full[:j + 1]
    assert res.output_ids[-1] == eos and eos not in res.output_ids[:-1]
    assert res.stop_reason == "eos"
    assert [t for s in streamed for t in s] == res.output_ids  # nothing after EOS was streamed either
    assert res.forwards == 1 and oracle.calls[0][1] > j + 1  # drafted through the EOS and beyond it
    assert res.accepted_per_forward == [j + 1]  # the EOS was an accepted draft token; nothing after it counts
    assert hf_greedy(model, prompt, 30, eos=eos) == res.output_ids


def test_eos_as_bonus_token_and_in_prompt(tiny_llama):
    prompt = [4, 5, 6]
    full = plain_greedy(tiny_llama, prompt, 30)
    j = next(i for i in range(3, 20) if full[i] not in full[:i])
    eos = full[j]
    # no drafts: the EOS is a bonus token
    res = Engine(tiny_llama, [], eos_token_ids=[eos, 1000]).generate(prompt, 30)
    assert res.output_ids == full[:j + 1] and res.stop_reason == "eos"
    # an EOS id inside the prompt does not stop anything
    p2 = [eos] + prompt
    want = plain_greedy(tiny_llama, p2, 12)
    res2 = Engine(tiny_llama, [NgramDrafter(k=4, min_n=1)], eos_token_ids=[999]).generate(p2, 12)
    assert res2.output_ids == want and len(want) == 12


def test_max_new_tokens_cut_inside_accepted_draft(tiny_llama, references):
    want = references["llama-eager"]
    streamed = []
    res = Engine(tiny_llama, [SequenceDrafter(PROMPT + want)], max_depth=16).generate(PROMPT, 7, on_tokens=streamed.extend)
    assert res.output_ids == want[:7] == streamed and res.forwards == 1


# ---- edge cases --------------------------------------------------------------------------------------------------

def test_one_token_prompt(tiny_llama, tiny_mixtral):
    for model in (tiny_llama, tiny_mixtral):
        want = plain_greedy(model, [17], 30)
        assert hf_greedy(model, [17], 30) == want
        drafters = [NgramDrafter(k=8, min_n=1), SequenceDrafter([17] + want, limit=3)]
        res = Engine(model, drafters, max_depth=8, merge=True).generate([17], 30)
        assert res.output_ids == want
        assert res.forwards < 30


def test_model_without_eos():
    model = build_tiny("llama", "sdpa", seed=5)
    assert model.config.eos_token_id is None
    want = hf_greedy(model, [3, 4], 50)
    assert len(want) == 50
    res = Engine(model, [NgramDrafter(k=8, min_n=1)], eos_token_ids=()).generate([3, 4], 50)
    assert res.output_ids == want and res.stop_reason == "length"


def test_max_new_tokens_zero(tiny_llama):
    res = Engine(tiny_llama, [NgramDrafter()]).generate([1, 2, 3], 0)
    assert res.output_ids == [] and res.forwards == 0 and res.tokens_per_forward == 0.0


def test_empty_prompt_raises(tiny_llama):
    with pytest.raises(ValueError, match="at least one token"):
        Engine(tiny_llama).generate([], 5)


@pytest.mark.parametrize("merge", [False, True])
def test_prompt_two_short_of_context(tiny_llama, merge):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, MAX_POS - 2).tolist()
    prompt[-20:] = prompt[-40:-20]  # a repeat, so the n-gram drafter proposes at the context edge
    want = hf_greedy(tiny_llama, prompt, 2)
    deep = SequenceDrafter(prompt + want + [5] * 60, depth=48)  # ignores max_depth: the engine must clamp
    drafters = [deep, NgramDrafter(k=48, min_n=1), ConstantDrafter(list(range(48)))]
    target = RecordingTarget(tiny_llama)
    res = Engine(target, drafters, max_depth=48, merge=merge).generate(prompt, 50)
    assert res.output_ids == want and len(res.output_ids) == 2
    assert res.stop_reason == "context"
    assert deep.calls[0][1] == 1  # only one draft token can still fit
    assert plain_greedy(tiny_llama, prompt, 50) == want
    # one short of the context: one token
    res1 = Engine(tiny_llama, drafters, max_depth=48, merge=merge).generate(prompt + [want[0]], 50)
    assert res1.output_ids == [want[1]] and res1.stop_reason == "context"


@pytest.mark.parametrize("extra", [0, 1, 30])
def test_prompt_filling_context_raises(tiny_llama, extra):
    with pytest.raises(ValueError, match="context"):
        Engine(tiny_llama, [NgramDrafter()]).generate([1] * (MAX_POS + extra), 5)


def test_engine_reuse_across_prompts(tiny_llama):
    """One Engine (and its drafters' state) serves several generations; each equals its own plain greedy."""
    engine = Engine(tiny_llama, [NgramDrafter(k=8, min_n=1)], max_depth=8)
    for prompt in ([1, 2, 3, 1, 2, 3], [60, 61], [1, 2, 3, 1, 2, 3], [5]):
        assert engine.generate(prompt, 25).output_ids == plain_greedy(tiny_llama, prompt, 25)


def test_result_fields(tiny_llama, references):
    res = Engine(tiny_llama, [SequenceDrafter(PROMPT + references["llama-eager"])], max_depth=4).generate(PROMPT, 10)
    assert isinstance(res, GenerationResult)
    assert res.prompt_ids == PROMPT
    assert res.seconds > 0 and res.tokens_per_second > 0
    assert set(res.sources) == {"oracle"}


# ---- guard in the loop: an unrelated corpus costs nothing --------------------------------------------------------

def _always_wrong_corpus(context: list[int], k: int) -> Corpus:
    """A corpus that matches every 8-id suffix of ``context`` (from length 8 on) and always continues it wrongly.

    Span i is context[i-8:i] followed by k ids that occur nowhere in ``context``: a lookup at context length i finds
    its 8-id suffix (the longest tried) and proposes k tokens, the first of which the target never emits.
    """
    unused = [t for t in range(VOCAB) if t not in set(context)][:k]
    assert len(unused) == k
    return Corpus.from_spans([context[i - 8:i] + unused for i in range(8, len(context))], vocab_size=VOCAB)


def test_unrelated_corpus_costs_no_extra_forwards(tiny_llama):
    prompt = [31, 32, 33, 34, 35, 36, 37, 38]
    want = plain_greedy(tiny_llama, prompt, 60)
    corpus = _always_wrong_corpus(prompt + want, 8)
    res = Engine(tiny_llama, build_drafters(corpus, k=8, ngram=False), max_depth=8).generate(prompt, 60)
    assert res.output_ids == want
    assert res.forwards == 60  # what plain greedy costs
    c = res.sources["corpus"]
    assert c.accepted == 0
    # the guard judged the first three 8-token drafts (its 24-token window), then paused for the rest of the run
    assert c.paused == 1 and c.proposed == 24 and c.steps == 3
    assert res.drafted_per_forward == [8, 8, 8] + [0] * 57


class LoggingGuard(AcceptanceGuard):
    """An AcceptanceGuard that logs, after each step's record(), whether its source is armed."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.log: list[bool] = []

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        super().record(proposed, accepted, emitted)
        self.log.append(self.active)


def _assert_pauses_and_rearms(res: GenerationResult, guard: LoggingGuard, name: str, matches_from: int = 0) -> int:
    """The source drafted in no forward where its guard was paused and in every forward where it was armed (from
    forward ``matches_from`` on, where it always has a match; the last forward may have no depth left); every pause
    lasted exactly ``guard.pause`` forwards (one token each: nothing else drafts) and ended with a new draft.
    Returns the number of complete pause-and-re-arm cycles."""
    assert len(guard.log) == res.forwards == len(res.drafted_per_forward)
    armed = [True] + guard.log[:-1]  # the state each forward's propose() saw
    for f, (on, drafted) in enumerate(zip(armed, res.drafted_per_forward, strict=True)):
        if not on:
            assert drafted == 0, (f, armed, res.drafted_per_forward)
        elif matches_from <= f < res.forwards - 1:
            assert drafted > 0, (f, armed, res.drafted_per_forward)
    streaks, f = [], 0
    while f < res.forwards:
        if armed[f]:
            f += 1
            continue
        start = f
        while f < res.forwards and not armed[f]:
            f += 1
        streaks.append((start, f - start, f < res.forwards))
    complete = [(s, n) for s, n, ended in streaks if ended]
    assert complete, f"{name}: no pause ended inside the run: {streaks}"
    assert all(n == guard.pause for _, n in complete), streaks
    assert all(res.drafted_per_forward[s + n] > 0 for s, n in complete)  # re-armed: it proposes again
    assert res.sources[name].paused == len(streaks) == guard.pauses
    return len(complete)


def test_corpus_guard_pauses_and_rearms_in_the_loop(tiny_llama):
    """Always-wrong corpus drafts: 2 drafts of 4 fill the 8-token window at 0% -> silent for 10 tokens -> again."""
    prompt = [31, 32, 33, 34, 35, 36, 37, 38]
    want = plain_greedy(tiny_llama, prompt, 60)
    guard = LoggingGuard(0.5, window=8, pause=10)
    res = Engine(tiny_llama, [CorpusDrafter(_always_wrong_corpus(prompt + want, 4), k=4, guard=guard)],
                 max_depth=4).generate(prompt, 60)
    assert res.output_ids == want and res.forwards == 60
    assert res.drafted_per_forward == ([4, 4] + [0] * 10) * 5
    assert _assert_pauses_and_rearms(res, guard, "corpus") == 4


def test_ngram_guard_pauses_and_rearms_in_the_loop(tiny_llama):
    """Every id occurs once in the prompt, so after the prefill the unigram lookup always has a draft; the guard
    alone silences it."""
    prompt = np.random.default_rng(2).permutation(VOCAB).tolist()
    want = plain_greedy(tiny_llama, prompt, 30)
    guard = LoggingGuard(1.0, window=6, pause=5)  # any rejection in the window pauses
    res = Engine(tiny_llama, [NgramDrafter(k=3, min_n=1, max_n=2, guard=guard)], max_depth=3).generate(prompt, 30)
    assert res.output_ids == want
    assert res.sources["ngram"].proposed > res.sources["ngram"].accepted
    assert _assert_pauses_and_rearms(res, guard, "ngram", matches_from=1) >= 2


# ---- exact mode: near-tie rows settled by draft-free forwards ---------------------------------------------------

@pytest.mark.parametrize("name", ["llama-eager", "mixtral-sdpa", "qwen2-sdpa"])
@pytest.mark.parametrize("merge", [False, True])
def test_exact_mode_every_row_a_near_tie(tiny_models, references, name, merge):
    """exact_margin=1e9 makes every verify row a near-tie: each is recomputed the plain way (prefill included)."""
    model, want = tiny_models[name], references[name]
    seq = PROMPT + want
    drafters = [SequenceDrafter(seq, "oracle", limit=3), SequenceDrafter(seq, "wrong", shift=1)]
    target = RecordingTarget(model)
    res = Engine(target, drafters, max_depth=8, merge=merge, exact_margin=1e9).generate(PROMPT, 25)
    assert res.output_ids == want[:25]
    assert res.forwards > 25  # the drafted forwards were all thrown away
    assert target.log[1][0] == len(PROMPT)  # the root row of the prefill was tied: the whole prompt is fed again
    assert sum(res.accepted_per_forward) == 0


def _draft_free_tokens(model, want, **engine_kw) -> tuple[GenerationResult, list[int]]:
    """Oracle run; returns the result and the output positions emitted by a forward that verified no draft."""
    target = RecordingTarget(model)
    engine = Engine(target, [SequenceDrafter(PROMPT + want)], max_depth=6, **engine_kw)
    res, emitted_by = generate_tracking(engine, target, PROMPT, N, record_margins=True)
    assert res.output_ids == want
    return res, [i for i, f in enumerate(emitted_by) if res.drafted_per_forward[f] == 0]


@pytest.mark.parametrize("margin", [0.3, 1.0, 3.0])
def test_exact_mode_some_rows_near_ties(tiny_llama, references, margin, monkeypatch):
    """Every token whose top-2 gap is under exact_margin is settled by draft-free forwards, and only those.

    Exact mode's payoff pause is off here (it would stop drafting where most rows are near-ties); a settling row
    still under the margin on a cache drafting wrote is recomputed after replaying the cache, so every draft-free
    forward is a settling one (but the last token's, with no room left for a draft)."""
    monkeypatch.setattr("redraft.decoding.exact_mode.EXACT_PAY_PAUSE", 0)
    want = references["llama-eager"]
    _, logits = hf_greedy(tiny_llama, PROMPT, N, scores=True)
    tied = [i for i, gap in enumerate(top2_gap(logits).tolist()) if gap < margin]
    assert tied, "no planted near-tie: the test would prove nothing"
    res, settled = _draft_free_tokens(tiny_llama, want, exact_margin=margin)
    assert settled == tied
    # each tied token was found in a row exact mode did not trust, but the last one: its forward carries no draft
    # (no room left), and on a cache plain decoding built that row is plain decoding's own, trusted as is
    assert res.near_ties >= len([i for i in tied if i < N - 1])
    # no draft-free forward but settling ones, and perhaps the last token's (no room left for a draft)
    assert res.drafted_per_forward.count(0) - res.settle_forwards in (0, 1)
    assert sum(res.accepted_per_forward) > 0
    assert np.allclose(res.margins, top2_gap(logits).numpy(), atol=1e-4)
    off, off_settled = _draft_free_tokens(tiny_llama, want, exact=False)
    assert off_settled == [] and off.forwards < res.forwards  # without exact mode the near-ties stay in verify rows


def test_record_margins_match_hf_scores(tiny_mixtral, references):
    want = references["mixtral-sdpa"]
    _, logits = hf_greedy(tiny_mixtral, PROMPT, N, scores=True)
    res = Engine(tiny_mixtral, [SequenceDrafter(PROMPT + want)], max_depth=5).generate(PROMPT, N, record_margins=True)
    assert res.output_ids == want
    assert len(res.margins) == N
    assert np.allclose(res.margins, top2_gap(logits).numpy(), atol=1e-4)


# ---- regressions: bugs found by this suite (fixed in 2c517d0) --------------------------------------------------

class TreeDrafter:
    """Proposes a fixed token tree (tokens, parents) below the root."""

    guard = None  # never pauses itself

    def __init__(self, tokens, parents, name="tree"):
        self.tokens, self.parents, self.name = list(tokens), list(parents), name

    def bind(self, target) -> None:
        pass

    def begin(self, prompt):
        pass

    def propose(self, context, max_depth):
        return TokenTree.from_parents(self.tokens, self.parents, self.name)

    def observe(self, proposed, accepted, emitted):
        pass


@pytest.mark.parametrize("kind,seed,overrides", [
    ("mistral", 3, dict(sliding_window=8)),
    ("qwen2", 4, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),  # mixed full/sliding layers
])
@pytest.mark.parametrize("merge", [False, True])
def test_sliding_window_models_are_exact(kind, seed, overrides, merge):
    """Was: HFTarget.crop raised on DynamicSlidingWindowLayer once the context passed the window."""
    model = build_tiny(kind, "sdpa", seed=seed, **overrides)
    assert Engine(model).target.sliding_window == 8
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]
    n = 60  # context far beyond the 8-token window
    want = hf_greedy(model, prompt, n)
    assert plain_greedy(model, prompt, n) == want
    # planted corpus with changes (accepted and rejected drafts) + n-gram + a garbage tree proposal
    span = prompt + want
    bad = list(span)
    for i in (15, 30, 45):
        bad[i] = (bad[i] + 1) % VOCAB
    drafters = build_drafters(Corpus.from_spans([bad], vocab_size=VOCAB), k=6, minacc=0.0) + \
        [TreeDrafter([1, 2, 3, 4], [-1, -1, 0, 1])]
    target = RecordingTarget(model)
    res = Engine(target, drafters, max_depth=6, merge=merge).generate(prompt, n)
    assert res.output_ids == want
    assert res.sources["corpus"].accepted > 0
    assert sum(st.proposed - st.accepted for st in res.sources.values()) > 0  # and some drafts were rejected
    assert not any(m for _, m, _ in target.log)  # chains only on sliding-window models


def test_out_of_vocab_draft_ids_do_not_crash(tiny_llama):
    """Was: an id outside the vocabulary (corpus built without vocab_size) crashed the embedding lookup."""
    prompt = [31, 32, 33, 34, 35]
    want = plain_greedy(tiny_llama, prompt, 10)
    corpus = Corpus.from_spans([[33, 34, 35, want[0], VOCAB + 7, 2]])  # no vocab_size: not checked
    res = Engine(tiny_llama, build_drafters(corpus, ngram=False)).generate(prompt, 10)
    assert res.output_ids == want
    assert res.sources["corpus"].accepted >= 1  # the valid head of the draft was still verified


@pytest.mark.parametrize("merge", [False, True])
def test_out_of_vocab_ids_in_tree_proposals(tiny_llama, merge):
    prompt = [31, 32, 33, 34, 35]
    want = plain_greedy(tiny_llama, prompt, 12)
    # root children: want[0] (ok), -3 (bad, with a child), VOCAB (bad); want[1] below want[0]; 7 below -3
    tree = TreeDrafter([want[0], -3, VOCAB, want[1], 7], [-1, -1, -1, 0, 1])
    target = RecordingTarget(tiny_llama)
    res = Engine(target, [tree, ConstantDrafter([VOCAB * 3])], max_depth=4, merge=merge).generate(prompt, 12)
    assert res.output_ids == want
    assert res.accepted_per_forward[0] == 2  # want[0], want[1] accepted from the cleaned tree
    assert target.log[0][0] == len(prompt) + 2  # only the two valid nodes were verified
