"""Requests admitted together that share a prompt prefix compute it once (redraft/server/shared_prefill.py).

Through the server's own Scheduler, Generator and StepBatcher on the tiny model: four requests of one tenant whose
prompts open with the same 24 tokens (and one of another tenant with the same opening) start together; the
shared part is computed once, the others start from it, and every answer equals plain greedy decoding. The roles
are also driven by hand: a follower waits while the part is computed and goes on alone when the leader is
cancelled; a part shorter than the minimum or of another tenant is not shared; batchers resume waiting sequences
without a forward.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import plain_greedy
from serverkit import EOS

from redraft.compose import SpeculationConfig
from redraft.decoding.sampling import SamplingParams
from redraft.pricing import CostCurve
from redraft.runtimes.sequence import NO_LOGITS, Sequence, wait_step
from redraft.runtimes.transformers.batching import SequenceCancelled, StepBatcher, run_together
from redraft.runtimes.transformers.target import HFTarget
from redraft.server.corpora import TenantCorpora
from redraft.server.generation import Generator, Work
from redraft.server.prefix_cache import PrefixCache
from redraft.server.scheduler import Job, Scheduler
from redraft.server.shared_prefill import SharedPrefill

CURVE = CostCurve((0, 1, 2, 4, 8), (1.0, 1.3, 1.5, 1.9, 2.6))
SHARED = [(7 * i) % 50 + 10 for i in range(24)]
TAILS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _job(loop, tenant: str, prompt: list[int], n: int) -> Job:
    async def make():  # the job's queue belongs to the loop it is made under
        return Job(tenant=tenant, payload=Work(prompt_ids=prompt, max_tokens=n, sampling=SamplingParams()),
                   loop=loop, kv_tokens=len(prompt) + n)
    return loop.run_until_complete(make())


def _outcome(loop, job: Job, timeout: float = 60.0):
    async def last():
        while True:
            kind, value = await asyncio.wait_for(job.events.get(), timeout)
            if kind != "delta":
                return kind, value
    return loop.run_until_complete(last())


def _serve_together(loaded, loop, jobs: list[Job], share: bool):
    corpora = TenantCorpora(["alice", "bob"], None, vocab_size=loaded.vocab_size, fingerprint=None,
                            cap_tokens=None, learn=False)
    cache = PrefixCache(10_000)
    gen = Generator(loaded, corpora, SpeculationConfig(), curve=CURVE, prefix_cache=cache,
                    batcher=StepBatcher(loaded.model))
    if not share:
        gen.sharing = None
    sched = Scheduler(gen, max_running=len(jobs), batcher=gen.batcher)
    for j in jobs:  # queued before the loop starts: admitted together, as a burst of clients is
        sched.submit(j)
    sched.start()
    try:
        outcomes = [_outcome(loop, j) for j in jobs]
    finally:
        sched.stop()
    return gen, cache, outcomes


@pytest.mark.parametrize("share", [True, False])
def test_a_burst_sharing_a_prompt_prefix_computes_it_once(loaded, loop, share):
    prompts = [SHARED + t for t in TAILS]
    jobs = [_job(loop, "alice", p, 12) for p in prompts] + [_job(loop, "bob", SHARED + [40, 41], 12)]
    gen, cache, outcomes = _serve_together(loaded, loop, jobs, share)
    for (kind, outcome), job in zip(outcomes, jobs, strict=True):
        assert kind == "done"
        assert outcome.result.output_ids == plain_greedy(loaded.model, job.payload.prompt_ids, 12, eos=[EOS])
    hits = [o.result.prefix_hit_tokens for _, o in outcomes]
    if share:  # alice's first request computed the 24 shared tokens (not a hit), her other three started from them
        assert gen.sharing.stats.leads == 1 and gen.sharing.stats.tokens == 24
        assert sorted(hits[:4]) == [0, 24, 24, 24] and gen.sharing.stats.waits >= 3
    else:
        assert hits[:4] == [0, 0, 0, 0]
    assert hits[4] == 0  # bob's prompt opens alike, but tenants never share


def test_the_servers_own_runner_announces_each_job_when_its_step_function_is_made(loaded, model_dir, loop):
    """Through ``redraft serve``'s Server (its runner counts metrics around the generator's step function): the
    jobs of a burst are announced when made, so the burst shares its prefix as with the generator alone."""
    from serverkit import serve_args

    from redraft.cli.serve import build_server

    server = build_server(serve_args(model_dir, "--max-running", "4", "--no-learn"), loaded)
    jobs = [_job(loop, "default", SHARED + t, 6) for t in TAILS]
    for j in jobs:
        server.scheduler.submit(j)
    server.scheduler.start()
    try:
        outcomes = [_outcome(loop, j) for j in jobs]
    finally:
        server.scheduler.stop()
    assert [kind for kind, _ in outcomes] == ["done"] * 4
    assert sorted(o.result.prefix_hit_tokens for _, o in outcomes) == [0, 24, 24, 24]
    for (_, o), j in zip(outcomes, jobs, strict=True):
        assert o.result.output_ids == plain_greedy(loaded.model, j.payload.prompt_ids, 6, eos=[EOS])


def test_a_follower_waits_for_the_part_and_goes_on_alone_when_the_leader_leaves(tiny_llama):
    sharing = SharedPrefill(PrefixCache(1000), min_tokens=8)
    a, b = SHARED + [1, 2], SHARED + [3]
    first, second = sharing.announce("t", a), sharing.announce("t", b)
    sharing.withdraw(first)
    lead = sharing.prefill("t", HFTarget(tiny_llama), a, None)
    call = next(lead)
    assert call.ids == SHARED and not call.is_wait  # only the part the second request shares
    sharing.withdraw(second)
    follow = sharing.prefill("t", HFTarget(tiny_llama), b, None)
    assert next(follow).is_wait
    with pytest.raises(SequenceCancelled):  # the leader's client left before its forward ran
        lead.throw(SequenceCancelled("gone"))
    with pytest.raises(StopIteration) as done:  # nothing is being computed now: the follower goes on alone
        follow.send(NO_LOGITS)
    assert done.value.value == (None, 0) and sharing.stats.leads == 0


def test_the_leader_stores_the_part_and_the_follower_starts_from_it(tiny_llama):
    cache = PrefixCache(1000)
    sharing = SharedPrefill(cache, min_tokens=8)
    a, b = SHARED + [1, 2], SHARED + [3]
    sharing.withdraw(sharing.announce("t", a))
    second = sharing.announce("t", b)
    target = HFTarget(tiny_llama)
    lead = sharing.prefill("t", target, a, None)
    call = next(lead)
    sharing.withdraw(second)
    follow = sharing.prefill("t", HFTarget(tiny_llama), b, None)
    assert next(follow).is_wait
    with pytest.raises(StopIteration) as led:
        lead.send(call.run_alone())
    part, own = led.value.value
    assert own == 24 and part.ids == tuple(SHARED) and target.length == 24 and cache.tokens == 24
    with pytest.raises(StopIteration) as followed:
        follow.send(NO_LOGITS)
    assert followed.value.value[0].ids == tuple(SHARED) and followed.value.value[1] == 0
    assert sharing.stats.leads == 1 and sharing.stats.tokens == 24 and sharing.stats.waits == 1


def test_no_lead_for_a_short_part_another_tenant_or_a_cache_hit_that_covers_it(tiny_llama):
    cache = PrefixCache(1000)
    sharing = SharedPrefill(cache, min_tokens=16)
    short = SHARED[:10]
    sharing.announce("t", short + [60, 61])
    sharing.announce("u", SHARED + [62])

    def first_yield(prompt, hit=None):
        steps = sharing.prefill("t", HFTarget(tiny_llama), prompt, hit)
        try:
            return next(steps)
        except StopIteration as end:
            return end.value[0]

    assert first_yield(short + [50, 51, 52]) is None  # 10 shared tokens: fewer than 16
    assert first_yield(SHARED + [50]) is None  # 24 shared, but with tenant u's request
    sharing.announce("t", SHARED + [63])
    held = HFTarget(tiny_llama)
    held.reset()
    held.forward(SHARED[:20])
    hit = held.snapshot(SHARED[:20])
    assert first_yield(SHARED + [50], hit) is hit  # the cache gives 20 of the 24: 4 more are not worth a lead
    assert not first_yield(SHARED + [50]).is_wait  # without that hit: a lead over the 24


def test_batchers_resume_waiting_sequences_without_a_forward(tiny_llama):
    batcher = StepBatcher(tiny_llama)
    got = []

    def waiter(n):
        t = HFTarget(tiny_llama)
        for _ in range(n):
            yield from wait_step(t)
            got.append(batcher.steps)
        return "waited"

    def decoder():
        t = HFTarget(tiny_llama)
        t.reset()
        logits = yield from _ask(t, [5, 6, 7])
        return int(logits[-1].argmax())

    seqs = run_together(batcher, [waiter(3), decoder()])
    assert [s.result for s in seqs][0] == "waited" and batcher.steps == 1  # the decoder's one forward
    assert got == [1, 1, 1]  # resumed after that step, then in steps without any forward
    only = Sequence(waiter(2)).start()
    batcher.step([only])
    assert batcher.steps == 1 and not only.done


def _ask(target, ids):
    from redraft.runtimes.sequence import forward

    return (yield from forward(target, ids, n_logits=1))


def test_a_lone_sequence_is_resumed_at_once_after_a_wait(tiny_llama):
    from redraft.runtimes.sequence import drive

    def steps():
        yield from wait_step(HFTarget(tiny_llama))
        return torch.tensor(1)

    assert int(drive(steps())) == 1
