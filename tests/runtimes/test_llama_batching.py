"""Several sequences in one llama.cpp context (redraft.runtimes.llamacpp.batching): each request a sequence id, one
``llama_decode`` per step over all of them.

Every sequence's output is checked against redraft's plain decoding of the same prompt on a llama.cpp context of
one sequence (itself llama.cpp's own greedy decoding: test_llama_target.py), and a multi-sequence batch's logits
against each sequence's rows computed alone, bit for bit on the batch-invariant build. Skipped without the ``llama``
extra; the batcher's planning runs everywhere on stand-ins.
"""

from __future__ import annotations

import pytest
import torch
from llamakit import SKIP_REASON, has_llama, needs_llama

from redraft.compose import SpeculationConfig, build_engine, build_policy, load_target, plain_engine

N_CTX, THREADS, SEQS, N = 1024, 1, 3, 40
PROMPTS = ["The capital of France is", "Write a Python function that reverses a string.",
           "List three primary colors and explain why they are called primary.",
           "Name the planets of the solar system in order."]


@pytest.fixture(scope="module")
def single():
    if not has_llama():
        pytest.skip(SKIP_REASON)
    return load_target(None, runtime="llama.cpp", n_ctx=N_CTX, threads=THREADS, quiet=True)


@pytest.fixture(scope="module")
def multi():
    if not has_llama():
        pytest.skip(SKIP_REASON)
    return load_target(None, runtime="llama.cpp", n_ctx=N_CTX, threads=THREADS, quiet=True, sequences=SEQS)


@pytest.fixture(scope="module")
def prompts(single):
    from redraft.io.prompts import encode_prompt

    return [encode_prompt(single.tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(single, prompts):
    engine = plain_engine(single.model, eos_token_ids=sorted(single.eos_token_ids))
    return [engine.generate(ids, N).output_ids for ids in prompts]


@needs_llama
def test_each_sequence_of_a_shared_context_decodes_as_a_context_of_its_own(multi, prompts, reference):
    target = multi.model
    assert target.n_seq_max == SEQS and target.max_length == N_CTX
    views = [target.view(s) for s in range(SEQS)]
    for view, ids, ref in zip(views, prompts, reference, strict=False):
        engine = plain_engine(view, eos_token_ids=sorted(multi.eos_token_ids))
        assert engine.generate(ids, N).output_ids == ref
    # each sequence still holds its own tokens after the others decoded
    assert [v.length for v in views] == [len(p) + len(r) - 1 for p, r in zip(prompts[:SEQS], reference, strict=False)]
    assert all(v.ids[:len(p)] == list(p) for v, p in zip(views, prompts, strict=False))
    for v in views:
        v.release()
    with pytest.raises(ValueError, match="outside 0..2"):
        target.view(SEQS)


@needs_llama
def test_a_multi_sequence_batch_gives_each_sequence_its_own_rows(multi, prompts, reference):
    """Rows of two sequences decoded in one batch (a 1-row decode beside a 6-row verify) against the same rows of
    each decoded alone: bit for bit on the batch-invariant build, within rounding otherwise."""
    from redraft.runtimes.llamacpp.target import decode_together

    a, b = multi.model.view(0), multi.model.view(1)
    for v, ids in ((a, prompts[0]), (b, prompts[1])):
        v.forward(ids)
    tail_a, tail_b = reference[0][:1], reference[1][:6]
    together = decode_together([(a, tail_a, 1), (b, tail_b, 6)])
    assert [t.shape for t in together] == [(1, multi.model.vocab_size), (6, multi.model.vocab_size)]
    assert (a.length, b.length) == (len(prompts[0]) + 1, len(prompts[1]) + 6)
    a.crop(len(prompts[0]))
    b.crop(len(prompts[1]))
    alone = [a.forward(tail_a), b.forward(tail_b, n_logits=6)]
    for got, want in zip(together, alone, strict=True):
        if multi.model.invariant:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=2.0)
    # the parts in either order: each gets its own rows (the batch lays them out by sequence id)
    a.crop(len(prompts[0]))
    b.crop(len(prompts[1]))
    swapped = decode_together([(b, tail_b, 6), (a, tail_a, 1)])
    assert torch.equal(swapped[0], together[1]) and torch.equal(swapped[1], together[0])
    with pytest.raises(ValueError, match="distinct sequences"):
        decode_together([(a, [1], 1), (a, [2], 1)])
    with pytest.raises(ValueError, match="exceed the batch"):
        decode_together([(a, [1] * 300, 1), (b, [1] * 300, 1)])
    a.release()
    b.release()


@needs_llama
def test_batched_requests_equal_plain_decoding(multi, prompts, reference):
    """Four requests through three sequences (the fourth starts when one ends), with the policy, n-gram drafts and
    staggered starts: every output is plain decoding's; steps carried several sequences; ids were handed back."""
    from redraft.compose.build import batched_policy
    from redraft.runtimes.llamacpp.batching import LlamaStepBatcher
    from redraft.runtimes.sequence import Sequence

    batcher = LlamaStepBatcher(multi.model)
    eos = sorted(multi.eos_token_ids)
    shared_policy = build_policy(multi.model)

    def request(ids):
        target = batcher.new_target()
        try:
            engine = build_engine(target, SpeculationConfig(), eos_token_ids=eos,
                                  policy=batched_policy(shared_policy))
            return (yield from engine.steps(ids, N))
        finally:
            target.release()

    waiting = list(enumerate(prompts))
    running: list[tuple[int, Sequence]] = []
    done: dict[int, list[int]] = {}
    while waiting or running:
        while waiting and len(running) < SEQS and (not running or batcher.steps % 3 == 0):
            i, ids = waiting.pop(0)
            running.append((i, Sequence(request(ids)).start()))
        batcher.step([s for _, s in running])
        for i, s in [(i, s) for i, s in running if s.done]:
            assert s.error is None, s.error
            done[i] = s.result.output_ids
        running = [(i, s) for i, s in running if not s.done]
    assert [done[i] for i in range(len(prompts))] == reference
    assert batcher.packed_steps > 0 and sorted(batcher.free) == list(range(SEQS))


# ---- planning, on stand-ins (no llama.cpp) ----------------------------------------------------------------------------

class _Call:
    def __init__(self, rows: int, solo: bool = False) -> None:
        self.ids, self.solo, self.n_logits = [0] * rows, solo, 1


class _Seq:
    def __init__(self, rows: int, solo: bool = False) -> None:
        self.call, self.done = _Call(rows, solo), False


def _batcher(max_batch_tokens: int = 64):
    from redraft.runtimes.llamacpp.batching import LlamaStepBatcher

    b = object.__new__(LlamaStepBatcher)  # the planner only: no context
    b.max_batch_tokens, b._waited = max_batch_tokens, {}
    return b


def test_plan_takes_the_smallest_that_fit_then_what_waited_first():
    b = _batcher(64)
    small, mid, big = _Seq(2), _Seq(30), _Seq(40)
    assert b._plan([big, mid, small]) == [small, mid]  # 2 + 30 fit, 40 more would not
    assert b._plan([big, mid, small]) == [big, small]  # it waited a step: first now
    huge = _Seq(500)
    assert b._plan([small, huge]) == [small]
    assert b._plan([small, huge]) == [huge]  # more rows than a step holds: alone, in its own batches
    solo = _Seq(3, solo=True)
    assert b._plan([small, solo, mid]) == [solo]


@needs_llama
def test_batcher_hands_out_each_sequence_once(multi):
    from redraft.runtimes.llamacpp.batching import LlamaStepBatcher

    batcher = LlamaStepBatcher(multi.model, max_batch_tokens=10_000)
    assert batcher.max_batch_tokens == multi.model.n_batch
    views = [batcher.new_target() for _ in range(SEQS)]
    assert sorted(v.seq for v in views) == list(range(SEQS)) and batcher.free == []
    with pytest.raises(RuntimeError, match="all 3 llama.cpp sequences are in use"):
        batcher.new_target()
    views[1].release()
    views[1].release()  # once only: the id is handed back once
    from redraft.runtimes.llamacpp.target import LlamaCppError

    with pytest.raises(LlamaCppError, match="sequence 1 was released"):
        views[1].forward([1, 2])  # its id may serve another request now
    again = batcher.new_target()
    assert again.seq == 1 and batcher.free == []
    for v in [*views, again]:
        v.release()
    assert sorted(batcher.free) == list(range(SEQS))


def test_batcher_refuses_a_context_of_one_sequence():
    from redraft.runtimes.llamacpp.batching import LlamaStepBatcher

    class One:
        n_seq_max, n_batch = 1, 512

    with pytest.raises(ValueError, match="n_seq_max > 1"):
        LlamaStepBatcher(One())
