"""Continuous batching (redraft.runtimes.transformers.batching, redraft.runtimes.transformers.packing): several sequences' rows in one forward.

Checked: packed attention keeps sequences apart (a change to one sequence's cache never reaches another's logits)
and leaves the model's own forward bit for bit, a
lone sequence runs its target's own forward, N sequences decoded in one step loop (drafters, trees, planted near-ties,
random arrival orders, prompts longer than a chunk) give exactly plain greedy decoding's ids, a long prompt is
chunked so running sequences wait at most one chunk's forward, a cancelled sequence leaves the batch at once, and the
policy's draft depth follows the rows a step carries for other sequences.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import VOCAB, ConstantDrafter, SequenceDrafter, build_tiny, draw_planted_case, plain_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.compose import build_policy
from redraft.compose.build import batched_policy
from redraft.corpus import Corpus
from redraft.decoding.engine import Engine
from redraft.decoding.exact_mode import ExactMode
from redraft.decoding.sampling import GREEDY, TokenChooser
from redraft.decoding.step import Draft, Step
from redraft.decoding.verify import tree_attention_mask, tree_positions
from redraft.drafters import AcceptanceGuard, CorpusDrafter, NgramDrafter
from redraft.pricing import CostCurve
from redraft.pricing.stepcost import StepCostFit, key_weight
from redraft.runtimes.sequence import Sequence, forward
from redraft.runtimes.transformers.batching import SequenceCancelled, StepBatcher, run_together
from redraft.runtimes.transformers.packing import (
    Block,
    causal_positions,
    enable_packed_attention,
    own_mask,
    packed_forward,
)
from redraft.runtimes.transformers.target import HFTarget
from redraft.tree import TokenTree


@pytest.fixture(scope="module")
def model():
    return build_tiny("llama", "sdpa", seed=0)


@pytest.fixture(scope="module")
def eager():
    return build_tiny("llama", "eager", seed=0)


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run_concurrently(batcher: StepBatcher, jobs, starts=None) -> list:
    """Run the step functions ``jobs[i](target)`` (each on a new target of the batcher) in one step loop; job i starts
    once the batcher has run ``starts[i]`` steps. Returns the results; re-raises the first job error."""
    seqs = run_together(batcher, [job(batcher.new_target()) for job in jobs], starts)
    for s in seqs:
        if s.error is not None:
            raise s.error
    return [s.result for s in seqs]


# ---- the mask and the packed forward ------------------------------------------------------------------------------

def test_own_mask_keeps_the_sequence_tree_mask_and_makes_causal_rows_causal():
    tree = TokenTree()
    a = tree.add_node(-1, 5, "t")
    tree.add_node(-1, 6, "t")
    tree.add_node(a, 7, "t")
    own = tree_attention_mask(tree, 3, 1, torch.float32)  # [1, 1, 4, 7]: 3 cached, root + 3 nodes
    assert torch.equal(own_mask(Block(3, tree_positions(tree, 3, 1)[0], own), torch.float32), own)
    causal = own_mask(Block(2, causal_positions(2, 3)), torch.float32)[0, 0]  # 2 cached, 3 new rows
    assert causal.shape == (3, 5)
    assert torch.equal(causal == 0, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert own_mask(Block(4, causal_positions(4, 1)), torch.float32) is None  # one row sees everything


def test_packed_attention_leaves_the_model_own_forward_bit_for_bit():
    """Wrapping the attention changes nothing outside packed forwards (sdpa and eager, GQA heads)."""
    for attn in ("sdpa", "eager"):
        m = build_tiny("llama", attn, seed=3)
        before = _cached(m, [3, 9, 27, 50, 11]).forward([4, 5, 6], n_logits=3)
        enable_packed_attention(m)
        enable_packed_attention(m)  # idempotent
        assert m.config._attn_implementation == "redraft_packed_" + attn
        after = _cached(m, [3, 9, 27, 50, 11]).forward([4, 5, 6], n_logits=3)
        assert torch.equal(before, after)


def test_packed_forward_needs_the_wrapped_attention():
    m = build_tiny("llama", "sdpa", seed=4)
    t = _cached(m, [1, 2, 3])
    with pytest.raises(ValueError, match="enable_packed_attention"):
        packed_forward(m, [t.cache], [Block(3, causal_positions(3, 1))], [[4]], [range(1)],
                       cache_kwarg=t.cache_kwarg)


def _cached(model, ids) -> HFTarget:
    t = HFTarget(model)
    t.reset()
    t.forward(list(ids))
    return t


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rows_of_other_sequences_never_attend_to_each_other(model, eager, attn):
    """Change one sequence's cached values: the other sequence's packed logits stay the same bit for bit."""
    m = model if attn == "sdpa" else eager
    enable_packed_attention(m)
    prompts = [[3, 9, 27, 81 % VOCAB, 50], [11, 12, 13]]

    def packed(perturb: bool):
        ts = [_cached(m, p) for p in prompts]
        if perturb:
            for layer in ts[1].cache.layers:
                layer.values = layer.values + torch.randn_like(layer.values)
                layer.keys = layer.keys + torch.randn_like(layer.keys)
        blocks = [Block(t.length, causal_positions(t.length, 2)) for t in ts]
        out = packed_forward(m, [t.cache for t in ts], blocks, [[4, 5], [6, 7]], [range(2), range(2)],
                             cache_kwarg=ts[0].cache_kwarg)
        return out, ts

    (a0, b0), _ = packed(False)
    (a1, b1), ts = packed(True)
    assert torch.equal(a0, a1)
    assert not torch.allclose(b0, b1)
    assert [t.cache.layers[0].keys.shape[-2] for t in ts] == [7, 5]  # the new rows went to each own cache
    # and the packed rows are each sequence's own rows, up to rounding
    solo = _cached(m, prompts[0]).forward([4, 5], n_logits=2)
    torch.testing.assert_close(a0, solo, atol=1e-4, rtol=0)


def test_a_lone_sequence_runs_its_target_forward_bit_for_bit(model):
    b = StepBatcher(model)
    t, ref = b.new_target(), HFTarget(model)
    ref.reset()

    def steps():
        for ids in ([4, 8, 15, 16, 23, 42], [7], [1, 2, 3]):
            got = yield from forward(t, ids, n_logits=len(ids))
            assert torch.equal(got, ref.forward(ids, n_logits=len(ids)))
            assert t.last_forward_plain and t.carried_rows == 1 and t.length == ref.length
        return "done"

    [seq] = run_together(b, [steps()])
    assert seq.error is None and seq.result == "done" and b.steps == 3 and b.active == 0


def test_a_lone_engine_is_unchanged_with_drafts(model):
    prompt = [7, 21, 3, 88, 40, 12, 7, 21, 3]
    want = plain_greedy(model, prompt, 40)
    ref = Engine(model, [SequenceDrafter(prompt + want)], max_depth=8).generate(prompt, 40)
    b = StepBatcher(model)
    [got] = run_concurrently(b, [lambda t: Engine(t, [SequenceDrafter(prompt + want)], max_depth=8)
                                 .steps(prompt, 40)])
    assert got.output_ids == ref.output_ids == want
    assert got.forwards == ref.forwards and got.accepted_per_forward == ref.accepted_per_forward


def test_a_chunked_tree_forward_gives_its_rows_across_chunks(model):
    """A verify forward (tree mask, tree positions) longer than a chunk: its logits rows span several chunks and come
    back in order, each within rounding of the unchunked forward; the cache holds the same entries."""
    tree = TokenTree()
    parent = -1
    for i, tok in enumerate([5, 9, 13, 17, 21]):
        node = tree.add_node(parent, tok, "t")
        tree.add_node(parent, (tok + 1) % VOCAB, "t")  # a sibling at every depth
        parent = node if i % 2 == 0 else parent
    prompt = [3, 1, 4, 1, 5]
    ref = HFTarget(model)
    ref.reset()
    ref.forward(prompt)
    pos, mask = tree_positions(tree, ref.length, 1), tree_attention_mask(tree, ref.length, 1, ref.dtype)
    want = ref.forward([2] + tree.tokens, pos, mask, n_logits=len(tree) + 1)
    b = StepBatcher(model, max_batch_tokens=3, min_chunk=2)
    b.cost_fit = StepCostFit(0.0)  # chunks of max_batch_tokens rows at any depth
    t, got, finished = b.new_target(), [], []

    def main():
        yield from forward(t, prompt)
        assert t.last_forward_plain  # 5 rows > 3, but the only sequence: whole, its target's own forward
        got.append((yield from forward(t, [2] + tree.tokens, pos, mask, n_logits=len(tree) + 1)))
        assert not t.last_forward_plain
        finished.append(True)

    def other(o):  # another running sequence (from the second step): long forwards are chunked now
        while not finished:
            yield from forward(o, [7])

    seqs = run_together(b, [main(), other(b.new_target())], starts=[0, 1])
    assert all(s.error is None for s in seqs)
    assert got[0].shape == want.shape
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)
    mine = [r for step in list(b.step_log)[1:] for n, r in step if n == b.number(t)]
    assert sum(mine) == 11 and len(mine) >= 4 and max(mine) <= 3  # 11 rows in chunks of at most 3
    for a, theirs in zip(t.cache.layers, ref.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, theirs.keys, atol=1e-4, rtol=0)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="max_batch_tokens"):
        StepBatcher(model, max_batch_tokens=0)
    with pytest.raises(ValueError, match="min_chunk"):
        StepBatcher(model, min_chunk=0)


# ---- exactness under batching ------------------------------------------------------------------------------------

def _drafters(kind: str, prompt, want):
    full = list(prompt) + list(want)
    if kind == "oracle":
        return [SequenceDrafter(full)], False
    if kind == "garbage":
        return [ConstantDrafter([1, 2, 3, 4, 5, 6])], False
    if kind == "tree":  # the right chain merged with a wrong one: a token tree with siblings
        return [SequenceDrafter(full, "wrong", shift=1), SequenceDrafter(full)], True
    if kind == "ngram":
        return [NgramDrafter(k=6, min_n=1)], False
    return [], False


def _job(prompt, n, kind, want, margin=None, eos=()):
    def job(t):
        drafters, merge = _drafters(kind, prompt, want)
        return Engine(t, drafters, max_depth=8, merge=merge, exact=True, exact_margin=margin,
                      eos_token_ids=eos).steps(prompt, n)
    return job


@pytest.mark.parametrize("margin", [None, 1.0])
def test_concurrent_sequences_decode_exactly_as_plain_greedy_alone(model, margin):
    """margin 1.0 makes many rows near-ties: their recomputes and cache rebuilds run as solo forwards."""
    prompts = [[5, 17, 33, 2], [9, 9, 9, 40, 41, 42, 9, 9, 9], list(range(20, 50)), [61], [3, 1, 4, 1, 5, 9, 2, 6]]
    kinds = ["oracle", "garbage", "tree", "ngram", "plain"]
    n = 36
    wants = [plain_greedy(model, p, n) for p in prompts]
    b = StepBatcher(model, max_batch_tokens=24, min_chunk=4)
    got = run_concurrently(b, [_job(p, n, k, w, margin) for p, k, w in zip(prompts, kinds, wants, strict=True)])
    for p, r, w in zip(prompts, got, wants, strict=True):
        assert r.output_ids == w, p
    assert max(len(s) for s in b.step_log) >= 3, "the sequences were never batched together"
    # a packed step carries at most max_batch_tokens rows, plus at most one min_chunk (a chunk is never smaller);
    # only solo forwards (exact mode's rebuild of a whole prompt) run unchunked
    assert all(sum(r for _, r in s) <= 24 + 4 for s in b.step_log if len(s) > 1)
    if margin is not None:
        assert sum(r.settle_forwards for r in got) > 0


@_settings(12)
@given(data=st.data())
def test_random_arrival_orders_prompt_lengths_and_budgets_decode_exactly(model, data):
    k = data.draw(st.integers(2, 4), label="sequences")
    prompts, ns, kinds, starts = [], [], [], []
    for i in range(k):
        size = data.draw(st.integers(1, 30), label=f"prompt {i} length")  # up to 30 > the 12-row chunk
        prompts.append(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size), label="prompt"))
        ns.append(data.draw(st.integers(1, 24), label="max_new_tokens"))
        kinds.append(data.draw(st.sampled_from(["oracle", "garbage", "tree", "ngram", "plain"]), label="drafter"))
        starts.append(data.draw(st.integers(0, 6), label="start step"))
    margin = data.draw(st.sampled_from([None, 1e-3, 1.0]), label="exact margin")
    wants = [plain_greedy(model, p, n) for p, n in zip(prompts, ns, strict=True)]
    b = StepBatcher(model, max_batch_tokens=12, min_chunk=4)
    got = run_concurrently(b, [_job(p, n, kd, w, margin)
                               for p, n, kd, w in zip(prompts, ns, kinds, wants, strict=True)], starts)
    for r, w in zip(got, wants, strict=True):
        assert r.output_ids == w
    assert b.active == 0 and b.in_progress == 0


@_settings(10)
@given(data=st.data())
def test_planted_near_ties_under_batching(model, data):
    cases = [draw_planted_case(data, model, 24) for _ in range(3)]
    margin = data.draw(st.sampled_from([None, 1e-3, 1.0]), label="exact margin")
    k = data.draw(st.sampled_from([2, 8, 16]), label="K")

    def job(case):
        prompt, n, eos, _, span = case

        def run(t):
            corpus = Corpus.from_spans([span], vocab_size=VOCAB)
            return Engine(t, [CorpusDrafter(corpus, k=k, guard=AcceptanceGuard(0.0)), NgramDrafter(k=k, min_n=1)],
                          eos_token_ids=eos, max_depth=k, exact=True, exact_margin=margin).steps(prompt, n)
        return run

    b = StepBatcher(model, max_batch_tokens=16, min_chunk=4)
    got = run_concurrently(b, [job(c) for c in cases])
    for (_, _, _, want, _), r in zip(cases, got, strict=True):
        assert r.output_ids == want


def test_a_packed_draft_free_row_is_judged_like_a_verify_row():
    """A row computed beside other sequences is not plain decoding's: judged by the verify threshold, it never
    advances plain_len, and a near-tie on it is recomputed (solo) rather than rebuilt when its gap allows."""

    class Packed:
        dtype = torch.float32
        last_forward_plain = False

    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 1] = 10.0, 9.5
    step = Step(Draft(), [1, 2, 3], 0, logits, [3], None, [0], torch.tensor([0.5]), [], [0], [0])
    ex = ExactMode(Packed(), margin=1.0)
    assert ex.judge(step, TokenChooser(GREEDY, VOCAB)) == 0 and ex.settling and ex.plain_len == 0
    ex = ExactMode(Packed(), margin=0.1)
    assert ex.judge(step, TokenChooser(GREEDY, VOCAB)) == 1 and ex.plain_len == 0
    Packed.last_forward_plain = True
    ex = ExactMode(Packed(), margin=1.0)
    assert ex.judge(step, TokenChooser(GREEDY, VOCAB)) == 1 and ex.plain_len == 3  # plain rows: ties trusted


# ---- chunked prefill and cancellation ------------------------------------------------------------------------------

def test_a_long_prompt_is_chunked_beside_running_sequences(model):
    budget, chunk = 16, 4
    short = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    long_prompt = [(7 * i + 3) % VOCAB for i in range(100)]
    n_short, n_long = 60, 8
    wants = [plain_greedy(model, p, n_short) for p in short] + [plain_greedy(model, long_prompt, n_long)]
    jobs = [_job(p, n_short, "plain", w) for p, w in zip(short, wants[:3], strict=True)]
    jobs.append(_job(long_prompt, n_long, "plain", wants[-1]))
    b = StepBatcher(model, max_batch_tokens=budget, min_chunk=chunk)  # every thread makes each step
    b.cost_fit = StepCostFit(0.0)  # chunks of the budget at any depth (the shrinking deeper in: the next test)
    got = run_concurrently(b, jobs, starts=[0, 0, 0, 4])
    assert [r.output_ids for r in got] == wants
    log = list(b.step_log)
    long_no = max(n for s in log for n, _ in s)  # the last sequence registered
    chunked = [s for s in log if any(n == long_no and r > 1 for n, r in s)]
    assert len(chunked) >= 100 // budget
    for s in chunked:
        assert sum(r for _, r in s) <= budget  # one bounded chunk beside the decode rows
        assert sum(1 for n, _ in s if n != long_no) == 3  # the running sequences went on in every chunk's step
    assert sum(r for s in chunked for n, r in s if n == long_no) == len(long_prompt)


def test_deeper_chunks_of_a_long_prompt_get_fewer_rows(model):
    """With the model's own key weight (large for a tiny model: a cached key costs a row ~1% of its matrix
    products), a long prompt beside a running sequence is cut into chunks that shrink as its cache grows; all its
    rows go through, and the output is plain decoding's."""
    long_prompt = [(5 * i + 1) % VOCAB for i in range(120)]
    wants = [plain_greedy(model, [3, 4, 5], 40), plain_greedy(model, long_prompt, 4)]
    b = StepBatcher(model, max_batch_tokens=32, min_chunk=2)
    assert b.cost_fit.prior > 0
    got = run_concurrently(b, [_job([3, 4, 5], 40, "plain", wants[0]), _job(long_prompt, 4, "plain", wants[1])],
                           starts=[0, 3])
    assert [r.output_ids for r in got] == wants
    log = list(b.step_log)
    long_no = max(n for s in log for n, _ in s)
    rows = [r for s in log for n, r in s if n == long_no][:-3]  # its prefill (the last 3 steps decode)
    assert sum(rows) == len(long_prompt) and rows[0] > rows[-2]
    assert all(a >= b for a, b in zip(rows[:-2], rows[1:-1], strict=True))  # non-increasing but the last


class SlowDrafter:
    """Proposes nothing, after ``seconds`` of work (a drafter's time between two forwards of its sequence)."""

    name, guard = "slow", None

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def bind(self, target) -> None:
        pass

    def begin(self, prompt) -> None:
        pass

    def propose(self, context, max_depth):
        time.sleep(self.seconds)
        return None

    def observe(self, proposed, accepted, emitted) -> None:
        pass


def test_running_sequences_join_every_chunk_step_of_a_long_prefill(model):
    """Running sequences that draft between their forwards join every one of the long prompt's chunk steps (each
    stalls them by at most one chunk): the step loop asks every sequence for its next forward before each step."""
    budget = 8  # 3 decode rows + a chunk of 5
    short = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    long_prompt = [(7 * i + 3) % VOCAB for i in range(110)]
    n_short = 60
    b = StepBatcher(model, max_batch_tokens=budget, min_chunk=4)

    def stream(p):
        return lambda t: Engine(t, [SlowDrafter(0.002)]).steps(p, n_short)

    jobs = [stream(p) for p in short] + [lambda t: Engine(t, []).steps(long_prompt, 2)]
    got = run_concurrently(b, jobs, starts=[0, 0, 0, 6])
    assert [r.output_ids for r in got[:3]] == [plain_greedy(model, p, n_short) for p in short]
    log = list(b.step_log)
    long_no = max(n for s in log for n, _ in s)
    chunked = [s for s in log if any(n == long_no and r > 1 for n, r in s)]
    assert len(chunked) >= len(long_prompt) // budget
    assert all(sum(1 for n, _ in s if n != long_no) == 3 for s in chunked), chunked


def test_a_cancelled_sequence_leaves_the_batch_mid_prefill(model):
    """A sequence failed with SequenceCancelled between two chunks of its prompt ends with that error where it waited;
    its rows never reach a step again and the other sequence goes on to plain decoding's answer."""
    b = StepBatcher(model, max_batch_tokens=8, min_chunk=4)
    other = Sequence(Engine(b.new_target(), []).steps([5, 6, 7], 30)).start()
    t = b.new_target()
    gone = Sequence(Engine(t, []).steps([(3 * i) % VOCAB for i in range(80)], 4)).start()
    for _ in range(100):
        if t.length >= 8:
            break
        b.step([other, gone])
    assert 8 <= t.length < 80 and not gone.done
    gone.fail(SequenceCancelled("the client left"))
    assert gone.done and isinstance(gone.error, SequenceCancelled) and gone.call is None
    steps = b.steps
    while not other.done:
        b.step([other, gone])
    assert all(n != b.number(t) for step in list(b.step_log)[steps:] for n, _ in step)
    assert other.error is None and other.result.output_ids == plain_greedy(model, [5, 6, 7], 30)


# ---- speculation priced at the step's load --------------------------------------------------------------------------

# cheap up to 8 rows, then steep (the vLLM proposer's test curve)
KNEE = CostCurve((0, 7, 15, 63), (1.0, 1.1, 3.0, 20.0))


class LoadedTarget(HFTarget):
    """An HFTarget reporting a synthetic load: ``carried_rows`` = loads(tokens cached)."""

    def __init__(self, model, loads) -> None:
        super().__init__(model)
        self.loads = loads

    @property
    def carried_rows(self) -> int:
        return self.loads(self.length)


def test_draft_depth_shrinks_as_the_batch_fills_and_grows_back(model):
    prompt = [7, 21, 3, 88, 40, 12, 7, 21, 3]
    n = 110
    want = plain_greedy(model, prompt, n)
    tenant = build_policy(curve=KNEE, max_nodes=16)
    policy = batched_policy(tenant)
    assert policy.tracker is tenant.tracker and batched_policy(tenant).pricing is policy.pricing

    def loads(length):
        return 64 if 45 <= length < 85 else 1

    target = LoadedTarget(model, loads)
    seen: list[int] = []
    orig = policy.at_load
    policy.at_load = lambda carried, share=None: seen.append(carried) or orig(carried, share)
    res = Engine(target, [SequenceDrafter(prompt + want)], max_depth=16, policy=policy).generate(prompt, n)
    assert res.output_ids == want
    ctx, by_region = len(prompt), {"before": [], "loaded": [], "after": []}
    for depth, acc in zip(res.draft_depth_per_forward, res.accepted_per_forward, strict=True):
        region = "before" if ctx < 45 else "loaded" if ctx < 85 else "after"
        by_region[region].append(depth)
        ctx += acc + 1
    assert 64 in seen and 1 in seen
    assert by_region["loaded"] and by_region["after"]
    assert max(by_region["loaded"]) <= 2 < min(max(by_region["before"]), max(by_region["after"]))


def test_carried_rows_count_the_other_sequences_rows(model):
    """Three sequences decoding one row each per step: each sees 2 other rows + its own root row."""
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    b = StepBatcher(model)
    loads: list[int] = []

    def job(p):
        def run(t):
            for _ in range(6):
                yield from forward(t, p if t.length == 0 else [1])
                loads.append(t.carried_rows)
        return run

    run_concurrently(b, [job(p) for p in prompts])
    assert loads.count(3) >= 6 and min(loads) >= 1  # the decode steps that carried all three


def test_a_sequence_starting_after_the_others_ended_is_priced_alone(model):
    """The last step's rows belong to sequences that have finished: the next sequence's first draft is priced at no
    load (a replayed answer drafted whole on its prompt's forward), not at that step's rows."""
    b = StepBatcher(model)

    def one(p):
        return lambda t: forward(t, p)

    run_concurrently(b, [one([1, 2, 3, 4]), one([5, 6, 7])])
    assert b.last_step_rows >= 3 and b.active == 0
    assert b.new_target().carried_rows == 1
    running = Sequence(forward(b.new_target(), [8, 9, 10])).start()
    waiting = Sequence(forward(b.new_target(), [11, 12])).start()
    b.step([running, waiting])
    assert running.done and waiting.done and b.active == 0
    still = Sequence(Engine(b.new_target(), []).steps([8, 9], 5)).start()
    b.step([still])
    assert b.active == 1 and b.new_target().carried_rows == b.last_step_rows + 1  # another sequence is running


def test_tenant_isolation_of_batched_policies():
    """A request's policy learns into its own tenant's tracker only."""
    a, b = build_policy(curve=KNEE, max_nodes=16), build_policy(curve=KNEE, max_nodes=16)
    pa, pb = batched_policy(a), batched_policy(b)
    assert pa.tracker is a.tracker and pb.tracker is b.tracker and pa.tracker is not pb.tracker
    before = [x.copy() for x in b.tracker.counts("s")]
    pa.observe("s", 4, 4)
    assert not all((x == y).all() for x, y in zip(a.tracker.counts("s"), before, strict=True))
    assert all((x == y).all() for x, y in zip(b.tracker.counts("s"), before, strict=True))


@pytest.mark.parametrize("kind,seed", [("mixtral", 1), ("qwen2", 2)])
def test_other_architectures_and_a_seeded_prefix_decode_exactly_batched(kind, seed):
    """MoE routing and q/k/v biases packed beside other sequences; one sequence starts from reused KV entries."""
    m = build_tiny(kind, "sdpa", seed=seed)
    shared = [4, 8, 15, 16, 23, 42, 4, 8]
    prompts = [shared + [1, 2], [30, 31, 32], shared + [77], [9] * 12]
    n = 24
    wants = [plain_greedy(m, p, n) for p in prompts]
    donor = HFTarget(m)
    donor.reset()
    donor.forward(shared)
    prefix = donor.snapshot(shared)

    def job(i):
        def run(t):
            drafters, merge = _drafters(["tree", "oracle", "ngram", "garbage"][i], prompts[i], wants[i])
            return Engine(t, drafters, max_depth=6, merge=merge).steps(
                prompts[i], n, prefix=prefix if i == 2 else None)
        return run

    b = StepBatcher(m, max_batch_tokens=10, min_chunk=4)
    got = run_concurrently(b, [job(i) for i in range(4)])
    assert [r.output_ids for r in got] == wants
    assert got[2].prefix_hit_tokens == len(shared)


def test_build_engine_on_batched_targets_with_the_default_config(model):
    """What a server builds per request: the composition point's default engine (n-gram drafts, the policy, exact
    mode) on a BatchedTarget, under the tenant's batched policy; ids == plain greedy."""
    from redraft.compose import SpeculationConfig, build_engine

    config = SpeculationConfig()
    tenant = build_policy(curve=KNEE, max_nodes=config.policy_nodes)
    prompts = [[9, 9, 9, 40, 41, 42, 9, 9, 9, 40], [1, 2, 3, 1, 2, 3, 1, 2], [50, 60]]
    wants = [plain_greedy(model, p, 30) for p in prompts]
    b = StepBatcher(model)
    got = run_concurrently(b, [lambda t, p=p: build_engine(t, config, policy=batched_policy(tenant))
                               .steps(p, 30) for p in prompts])
    assert [r.output_ids for r in got] == wants


def test_key_weight_follows_the_model_sizes(model):
    w = key_weight(model)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert w == pytest.approx(2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim / params)


def test_a_packed_forward_that_fails_part_way_leaves_every_cache_as_it_was(model):
    """An error in a middle layer (after the first layers appended their rows): each cache is cut back to its own
    length, every layer alike, and the error reaches the caller."""
    enable_packed_attention(model)
    ts = [_cached(model, [3, 9, 27]), _cached(model, [11, 12])]

    def boom(*args, **kwargs):
        raise RuntimeError("layer failed")

    hook = model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="layer failed"):
            packed_forward(model, [t.cache for t in ts], [Block(t.length, causal_positions(t.length, 2)) for t in ts],
                           [[4, 5], [6, 7]], [range(2), range(2)], cache_kwarg=ts[0].cache_kwarg)
    finally:
        hook.remove()
    assert [{layer.keys.shape[-2] for layer in t.cache.layers} for t in ts] == [{3}, {2}]


def _waiting(rows, depth, order):
    from types import SimpleNamespace

    return SimpleNamespace(rows_left=rows, n_cached=depth, done_rows=0, order=order, skipped=0)


def _plan_and_advance(pending, **kw):
    """One plan_step, then what the batcher does after it: rows done, skipped counts, finished requests gone."""
    from redraft.runtimes.transformers.batching import plan_step

    step = plan_step(pending, **kw)
    placed = {id(r) for r, _ in step}
    for r in pending:
        r.skipped = 0 if id(r) in placed else r.skipped + 1
    for r, rows in step:
        r.done_rows += rows
        r.rows_left -= rows
    pending[:] = [r for r in pending if r.rows_left > 0]
    return step


def test_a_verify_tree_beside_a_long_prefill_waits_one_step_at_most():
    """Deep streams priced at their depth leave a 56-row verify tree no room beside a long prompt's chunk: the next
    step's chunk goes to the tree (it waited), not to the prompt again."""
    kw = dict(weight=1.3e-3, extra=8.0, max_batch_tokens=512, min_chunk=32)
    prompt, tree = _waiting(4000, 0, 0), _waiting(56, 6000, 16)
    pending = [prompt, tree]
    got_place = None
    for step_no in range(6):
        streams = [_waiting(1, 6000, 1 + i) for i in range(15)]  # every stream's next row, each step
        step = _plan_and_advance(pending + streams, **kw)
        assert sum(rows for _, rows in step) <= 512 + 32
        if any(r is tree for r, _ in step):
            got_place = step_no
            break
    assert got_place is not None and got_place <= 1


def test_a_step_carries_at_most_max_batch_tokens_rows():
    """Small requests at depth 0 pay almost nothing for attention; rows still stop at max_batch_tokens (+ one
    chunk's minimum)."""
    for weight in (3.3e-4, 1.3e-3):
        pending = [_waiting(40, 0, i) for i in range(16)]
        step = _plan_and_advance(pending, weight=weight, extra=0.0, max_batch_tokens=512, min_chunk=32)
        assert 512 - 40 < sum(rows for _, rows in step) <= 512 + 32
