"""The vLLM proposer against vLLM's custom_class contract, without vLLM.

The fake batch below holds what vLLM 0.32's persistent batch hands the proposer (vllm/v1/worker/gpu_input_batch.py):
an int32 token table [max_num_reqs, max_model_len], int32 context lengths [max_num_reqs] that already include the
ids sampled this step, and per-row lists of sampled ids (accepted drafts + bonus, empty for a prefill chunk). Rows
are reused by new requests and condensed (a request moves to a lower row) as vLLM does. The "model" is a fixed
greedy continuation per request, so verification is: accept the draft's longest prefix that matches it, then the
bonus id.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from redraft.corpus import Corpus
from redraft.corpus.directory import read_directory
from redraft.decoding.planner import DraftPlanner
from redraft.integrations.planned import RequestDrafts
from redraft.integrations.vllm_proposer import ProposerConfigError, RedraftProposer
from redraft.tree import TokenTree

K, VOCAB, MAX_LEN, EOS = 8, 500, 400, 2


def vllm_config(k=K, max_model_len=MAX_LEN):
    """The fields of vLLM's VllmConfig the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", num_speculative_tokens=k,
                                           model="redraft.integrations.vllm_proposer.RedraftProposer"),
        model_config=SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: VOCAB, tokenizer=None,
                                     hf_config=SimpleNamespace(eos_token_id=EOS)))


class FakeBatch:
    """vLLM's input batch as the proposer sees it, with a fixed greedy output per request."""

    def __init__(self, max_num_reqs=4, max_model_len=MAX_LEN):
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.reqs: list = []  # per row: (prompt, greedy output) or None

    def add(self, row, prompt, output):
        while len(self.reqs) <= row:
            self.reqs.append(None)
        self.reqs[row] = (list(prompt), list(output))
        self.token_ids_cpu[row, :len(prompt)] = prompt
        self.num_tokens_no_spec[row] = len(prompt)

    def move(self, src, dst):
        """condense(): the request in row src slides down into the freed row dst."""
        n = int(self.num_tokens_no_spec[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        self.num_tokens_no_spec[dst] = n
        self.reqs[dst], self.reqs[src] = self.reqs[src], None
        while self.reqs and self.reqs[-1] is None:
            self.reqs.pop()

    def verify(self, drafts):
        """One target step: per row, the accepted draft prefix plus the bonus id, written like _bookkeeping_sync."""
        sampled = []
        for row, req in enumerate(self.reqs):
            d = drafts[row] if drafts else []
            prompt, out = req
            pos = int(self.num_tokens_no_spec[row]) - len(prompt)
            a = 0
            while a < len(d) and pos + a < len(out) and d[a] == out[pos + a]:
                a += 1
            ids = out[pos:pos + a + 1]
            n = int(self.num_tokens_no_spec[row])
            self.token_ids_cpu[row, n:n + len(ids)] = ids
            self.num_tokens_no_spec[row] = n + len(ids)
            sampled.append(list(ids))
        return sampled

    def context(self, row):
        return self.token_ids_cpu[row, :int(self.num_tokens_no_spec[row])]

    def done(self, row):
        prompt, out = self.reqs[row]
        return int(self.num_tokens_no_spec[row]) >= len(prompt) + len(out)


def step(proposer, batch, drafts):
    sampled = batch.verify(drafts)
    return sampled, proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)


def rng_ids(seed, n):
    return np.random.default_rng(seed).integers(10, VOCAB, size=n).tolist()


def make_proposer(tmp_path, spans=(), **env):
    """A proposer with the fixed semantics (depth K, Colibri's guards) unless ``redraft_policy=1`` is passed; the
    cost-aware policy's depths are tested in test_vllm_proposer_policy.py."""
    environ = {k.upper(): str(v) for k, v in env.items()}
    environ.setdefault("REDRAFT_POLICY", "0")
    if spans:
        path = tmp_path / "corpus.txt"
        path.write_text("\n-1\n".join(" ".join(map(str, s)) for s in spans) + "\n")
        environ.setdefault("REDRAFT_DRAFT_CORPUS", str(path))
    return RedraftProposer(vllm_config(), environ=environ)


def test_corpus_draft_is_corpus_propose(tmp_path):
    prompt, out = rng_ids(1, 20), rng_ids(2, 60)
    other = rng_ids(3, 50)
    prop = make_proposer(tmp_path, [other, prompt + out])
    corpus = Corpus.from_spans([other, prompt + out], vocab_size=VOCAB)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts, seen = None, 0
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
        n, ids = corpus.propose(batch.context(0), K)
        assert drafts[0] == ids[:K].tolist()
        seen += bool(drafts[0])
        assert all(isinstance(t, int) for t in drafts[0])
    assert seen >= 60 // (K + 1)
    assert prop.totals["accepted"] == prop.totals["proposed"] > 0  # a replay: every verified draft id accepted


def learned_spans(directory):
    """The spans a learning directory holds (as a restarted server or proposer reads them)."""
    if not (directory / "meta.json").exists():
        return []
    return [s.tolist() for s in read_directory(directory)[0].span_list()]


def brute_ngram(ctx, k, min_n=3, max_n=8):
    """Most recent earlier occurrence of the longest context suffix (n = max_n..min_n), what followed it."""
    ctx = list(ctx)
    L = len(ctx)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if ctx[start:start + n] == ctx[L - n:]:
                return ctx[start + n:start + n + k]
    return []


def test_ngram_fallback_over_live_context(tmp_path):
    prompt = rng_ids(4, 12)
    out = (rng_ids(5, 10) * 6)[:50]  # the answer repeats itself: only the live context can draft it
    prop = make_proposer(tmp_path)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts, drafted = None, 0
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
        assert drafts[0] == brute_ngram(batch.context(0), K)
        drafted += len(drafts[0])
    assert drafted > 0


def periodic_miss_request():
    """A request whose corpus drafts are always wrong: its answer cycles x y z, the corpus follows x y z with w's."""
    prompt = [11, 12, 13, 14]
    out = [21, 22, 23] * 30
    bad_span = [99, 21, 22, 23] + [30] * 12
    return prompt, out, bad_span


def test_guard_is_per_request(tmp_path):
    pa, oa = rng_ids(6, 16), rng_ids(7, 90)
    pb, ob, bad = periodic_miss_request()
    prop = make_proposer(tmp_path, [pa + oa, bad], redraft_ngram=0)
    batch = FakeBatch()
    batch.add(0, pa, oa)
    batch.add(1, pb, ob)
    drafts, b_drafts = None, []
    for _ in range(30):
        sampled, drafts = step(prop, batch, drafts)
        b_drafts.append(drafts[1])
        if not batch.done(0):
            assert drafts[0], "request A's replay drafts must not pause because request B's fail"
    wrong = [d for d in b_drafts if d]
    assert len(wrong) == 3 and all(d[0] == 30 for d in wrong)  # three 8-token misses = 24 tokens, then paused


def test_state_follows_the_request_not_the_row(tmp_path):
    pa, oa = rng_ids(8, 16), rng_ids(9, 40)
    pb, ob, bad = periodic_miss_request()
    pc, oc = rng_ids(10, 16), rng_ids(11, 40)
    prop = make_proposer(tmp_path, [pa + oa, bad, pc + oc], redraft_ngram=0)
    batch = FakeBatch()
    batch.add(0, pa, oa)
    batch.add(1, pb, ob)
    drafts = None
    for _ in range(12):  # B's guard trips (3 wrong drafts by step 9)
        sampled, drafts = step(prop, batch, drafts)
    # A finishes; vLLM condenses B down into row 0 and C takes row 1 (a reused slot)
    batch.move(1, 0)
    batch.add(1, pc, oc)
    drafts = [drafts[1], []]
    paused_b, fresh_c = [], []
    for _ in range(9):
        sampled, drafts = step(prop, batch, drafts)
        paused_b.append(drafts[0])
        fresh_c.append(drafts[1])
    assert not any(paused_b), "B's paused guard must follow it into row 0"
    assert fresh_c[0] == oc[1:1 + K], "C in B's old row must start with fresh state and draft at once"


def test_new_request_in_a_reused_row_starts_fresh(tmp_path):
    pb, ob, bad = periodic_miss_request()
    pc, oc = rng_ids(20, 16), rng_ids(21, 40)
    prop = make_proposer(tmp_path, [bad, pc + oc], redraft_ngram=0)
    batch = FakeBatch()
    batch.add(0, pb, ob)
    drafts = None
    for _ in range(12):
        sampled, drafts = step(prop, batch, drafts)
    assert not drafts[0]  # B's guard paused its corpus drafts
    batch.add(0, pc, oc)  # B finished; its row goes to a new request
    sampled, drafts = step(prop, batch, [])
    assert drafts[0] == oc[1:1 + K]


def test_rows_without_samples_and_model_length(tmp_path):
    prompt, out = rng_ids(12, 30), rng_ids(13, 40)
    prop = RedraftProposer(vllm_config(max_model_len=40), environ={})
    prop.corpus = None
    batch = FakeBatch(max_model_len=40)
    batch.add(0, prompt + out[:5], out[5:])
    batch.add(1, prompt + out[:5], out[5:])
    n = int(batch.num_tokens_no_spec[0])
    batch.token_ids_cpu[0, n:n + 2] = out[5:7]
    batch.num_tokens_no_spec[0] = n + 2
    # row 0: two sampled ids; row 1: a prefill chunk (nothing sampled)
    drafts = prop.propose([out[5:7], []], batch.num_tokens_no_spec, batch.token_ids_cpu)
    assert len(drafts) == 2 and drafts[1] == []
    assert len(drafts[0]) <= 40 - (n + 2)


def test_cut_short_draft_counts_only_what_was_verified():
    class Src:
        name, guard, seen = "s", None, []

        def propose(self, context, max_depth):
            return TokenTree.chain([5, 6, 7, 8], "s")

        def observe(self, p, a, e):
            self.seen.append((p, a, e))

    src = Src()
    r = RequestDrafts(DraftPlanner([src], chain_only=True))
    assert r.propose(np.zeros(3, dtype=np.int64), 8) == [5, 6, 7, 8]
    assert r.settle([5, 6, 7]) == (2, 2)  # the scheduler verified 2 ids; the bonus equals draft[2]
    assert r.propose(np.zeros(3, dtype=np.int64), 8) == [5, 6, 7, 8]
    assert r.settle([5, 9]) == (4, 1)  # a rejection at position 1
    assert src.seen == [(2, 2, 3), (4, 1, 2)]


@pytest.mark.parametrize("env, needle", [
    ({"REDRAFT_CORPUS_K": "x"}, "REDRAFT_CORPUS_K='x' is not an integer"),
    ({"REDRAFT_CORPUS_K": "9"}, "REDRAFT_CORPUS_K=9 is outside 1..8"),
    ({"COLI_CORPUS_K": "0"}, "COLI_CORPUS_K=0 is outside 1..8"),
    ({"REDRAFT_CORPUS_MINACC": "150"}, "REDRAFT_CORPUS_MINACC=150 is outside 0..100"),
    ({"REDRAFT_CORPUS_MINACC": "half"}, "is not a number"),
    ({"REDRAFT_NGRAM": "yes"}, "REDRAFT_NGRAM='yes': expected 0 or 1"),
    ({"REDRAFT_DRAFT_CORPUS": "/nonexistent/c.txt"}, "REDRAFT_DRAFT_CORPUS=/nonexistent/c.txt: no such file"),
    ({"REDRAFT_LEARN_CORPUS": "/nonexistent/dir/l.txt"}, "directory /nonexistent/dir does not exist"),
    ({"REDRAFT_LEARN_TENANT": "../x"}, "REDRAFT_LEARN_TENANT='../x': expected a tenant name"),
])
def test_bad_configuration_fails_at_construction(env, needle):
    with pytest.raises(ProposerConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        RedraftProposer(vllm_config(), environ=env)


@pytest.mark.parametrize("text, needle", [("1 2 abc\n", "abc"), (f"1 2 {VOCAB}\n", "out of range")])
def test_bad_corpus_fails_at_construction(tmp_path, text, needle):
    path = tmp_path / "c.txt"
    path.write_text(text)
    with pytest.raises(ProposerConfigError, match=f"REDRAFT_DRAFT_CORPUS: .*{needle}"):
        RedraftProposer(vllm_config(), environ={"REDRAFT_DRAFT_CORPUS": str(path)})


def test_binary_corpus_and_its_tokenizer_fingerprint(tmp_path, monkeypatch):
    import redraft.integrations.vllm_proposer as vp

    prompt, out = rng_ids(26, 12), rng_ids(27, 20)
    path = tmp_path / "c.rdc"
    Corpus.from_spans([prompt + out], vocab_size=VOCAB, fingerprint="sha256:aaaa").save(path)
    env = {"REDRAFT_DRAFT_CORPUS": str(path)}
    monkeypatch.setattr(vp, "_tokenizer_fingerprint", lambda tokenizer: "sha256:aaaa")
    prop = RedraftProposer(vllm_config(), environ=env)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    assert step(prop, batch, [])[1][0] == out[1:1 + K]
    monkeypatch.setattr(vp, "_tokenizer_fingerprint", lambda tokenizer: "sha256:bbbb")
    with pytest.raises(ProposerConfigError, match="REDRAFT_DRAFT_CORPUS: .*fingerprint mismatch"):
        RedraftProposer(vllm_config(), environ=env)
    RedraftProposer(vllm_config(), environ={**env, "REDRAFT_CORPUS_FORCE": "1"})
    with pytest.raises(ProposerConfigError, match="REDRAFT_LEARN_CORPUS=.* is a file; expected a corpus directory"):
        RedraftProposer(vllm_config(), environ={"REDRAFT_LEARN_CORPUS": str(path)})


def test_bad_speculative_tokens():
    with pytest.raises(ProposerConfigError, match="num_speculative_tokens"):
        RedraftProposer(vllm_config(k=0), environ={})


def test_learns_finished_requests_into_a_persisted_corpus(tmp_path):
    learn = tmp_path / "learned"
    prompt, out = rng_ids(14, 16), rng_ids(15, 30)
    prop = make_proposer(tmp_path, redraft_learn_corpus=learn, redraft_ngram=0)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts = None
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
        assert not drafts[0]  # nothing learned yet, no n-gram source
    prop.flush()
    assert learned_spans(learn) == [prompt + out]
    for fresh in (prop, make_proposer(tmp_path, redraft_learn_corpus=learn, redraft_ngram=0)):
        batch = FakeBatch()
        batch.add(0, prompt, out)
        sampled, drafts = step(fresh, batch, [])
        assert drafts[0] == out[1:1 + K]  # in memory at once, and from the file after a restart


def test_a_request_that_samples_eos_is_learned_at_once_and_cut_after_it(tmp_path):
    learn = tmp_path / "learned"
    prompt, answer = rng_ids(24, 12), rng_ids(25, 20) + [EOS]
    after_eos = [77, 78, 79]  # what the target would emit past EOS; vLLM accepts such draft ids, then drops them
    prop = make_proposer(tmp_path, [prompt + answer + after_eos], redraft_learn_corpus=learn)
    batch = FakeBatch()
    batch.add(0, prompt, answer + after_eos)
    drafts = None
    while not learned_spans(learn):
        sampled, drafts = step(prop, batch, drafts)
    assert EOS in sampled[0] and sampled[0][-1] != EOS  # the EOS came inside an accepted draft
    assert learned_spans(learn) == [prompt + answer]
    prop.flush()
    assert learned_spans(learn) == [prompt + answer]  # not learned twice


def test_departed_request_is_learned_after_the_park_window(tmp_path):
    learn = tmp_path / "learned"
    prop = make_proposer(tmp_path, redraft_learn_corpus=learn, redraft_ngram=0)
    prop.tracker.park_calls = 2
    batch = FakeBatch()
    batch.add(0, rng_ids(16, 10), rng_ids(17, 5))
    step(prop, batch, [])
    batch.add(0, rng_ids(18, 10), rng_ids(19, 50))  # a new request takes the row; the first one is parked
    for _ in range(2):  # missing from 2 calls: still parked (it may be preempted)
        step(prop, batch, [])
        assert not learned_spans(learn)
    step(prop, batch, [])  # the third call without it: expired, learned
    assert sum(map(len, learned_spans(learn))) == 11  # prompt + the one id it had when it left


def test_no_torch_or_transformers_import():
    code = ("import sys, redraft.integrations.vllm_proposer; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllm_check_fits_the_step_curve_through_noisy_differences():
    from redraft.pricing import CostCurve
    from redraft.pricing.fit import fit_step_curve

    rows = [1, 2, 4, 8, 16, 32, 64, 128]
    noisy = [0.05 + 0.002 * t + e for t, e in zip(rows, [0.01, -0.06, 0.0, 0.02, -0.01, 0.0, 0.01, -0.02],
                                                    strict=True)]
    fit = fit_step_curve(rows, noisy)
    assert fit["fit"]["a_seconds"] == pytest.approx(0.05, abs=0.02)
    assert fit["fit"]["b_seconds_per_row"] == pytest.approx(0.002, rel=0.2)
    curve = CostCurve.from_dict({k: fit[k] for k in ("sizes", "costs")})  # a valid curve: c(0) = 1, ascending
    assert curve.costs == tuple(sorted(curve.costs)) and curve.sizes[0] == 0
    assert fit_step_curve(rows, [-0.1] * 8)["costs"] == [1.0] * 8  # nothing measurable: flat
    slowed = fit_step_curve(rows, [0.05 + 0.002 * t for t in rows[:-1]] + [2.0])  # the last step slowed by a job
    assert slowed["fit"]["a_seconds"] == pytest.approx(0.05, rel=0.05)
    assert slowed["fit"]["b_seconds_per_row"] == pytest.approx(0.002, rel=0.05)
    assert fit_step_curve(rows, [0.001 * t for t in rows])["costs"][-1] == pytest.approx(128.0)


ALIVE: list = []  # what vLLM's model runner does: it holds the proposer until the process ends


def _serve_one_request_and_exit(learn, prompt, out):
    prop = RedraftProposer(vllm_config(), environ={"REDRAFT_LEARN_CORPUS": str(learn)})
    ALIVE.append(prop)
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts = None
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
    # no flush(): the process ends with the request still tracked, as a vLLM worker does at shutdown


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_requests_still_tracked_are_learned_when_the_worker_process_exits(tmp_path, how):
    import multiprocessing

    learn = tmp_path / "learned"
    prompt, out = rng_ids(22, 12), rng_ids(23, 20)
    proc = multiprocessing.get_context(how).Process(target=_serve_one_request_and_exit, args=(learn, prompt, out))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert learned_spans(learn) == [prompt + out]


@pytest.mark.parametrize("k_max", [None, 16])
def test_depth_cap_drafts_adaptively_as_the_engine_does(tmp_path, k_max):
    """REDRAFT_CORPUS_K_MAX is the CLI's --k-max: the proposer's corpus drafts are, step by step, those of the
    corpus drafter the engine path builds from SpeculationConfig(k=2, k_max=...) (deeper while accepted whole)."""
    from redraft.compose import SpeculationConfig, drafters_for

    prompt, out = rng_ids(40, 20), rng_ids(41, 120)
    corpus = Corpus.from_spans([rng_ids(42, 30), prompt + out], vocab_size=VOCAB)
    path = tmp_path / "corpus.txt"
    path.write_text("\n-1\n".join(" ".join(map(str, s)) for s in corpus.span_list()) + "\n")
    environ = {"REDRAFT_DRAFT_CORPUS": str(path), "REDRAFT_CORPUS_K": "2", "REDRAFT_NGRAM": "0"}
    if k_max is not None:
        environ["REDRAFT_CORPUS_K_MAX"] = str(k_max)
    prop = RedraftProposer(vllm_config(k=32), environ=environ)
    engine_side = drafters_for(SpeculationConfig(k=2, k_max=k_max, ngram=False), corpus)[0]
    engine_side.begin(np.asarray(prompt))
    batch = FakeBatch()
    batch.add(0, prompt, out)
    drafts, lengths = None, []
    while not batch.done(0):
        sampled, drafts = step(prop, batch, drafts)
        if lengths and lengths[-1]:  # the engine feeds its drafter what the target accepted of its last draft
            engine_side.observe(lengths[-1], len(sampled[0]) - 1, len(sampled[0]))
        cap = min(32, MAX_LEN - int(batch.num_tokens_no_spec[0]))
        want = engine_side.propose(batch.context(0), cap)
        assert drafts[0] == (want.tokens if want is not None else [])
        lengths.append(len(drafts[0]))
    assert max(lengths) == (k_max or 2)


def test_a_length_cut_replay_carrying_ids_past_the_cut_is_not_stored_again():
    from redraft.corpus.online import OnlineCorpus
    from redraft.integrations.learning import SpanLearner

    rng = np.random.default_rng(3)
    answer = rng.integers(10, VOCAB, 60).tolist()  # another writer's answer, cut by max_tokens
    beyond = rng.integers(10, VOCAB, K + 2).tolist()  # ids vLLM's last step accepted past the cut
    oc = OnlineCorpus(None, vocab_size=VOCAB)
    oc.learn(answer)
    learner = SpanLearner(oc, overshoot=K + 1)
    learner.learn([np.array(answer + beyond[:K + 1])], [False])  # the same answer replayed: up to K + 1 ids past it
    assert oc.n_spans == 1 and learner.spans == 0
    learner.learn([np.array(answer + beyond[:K + 1])], [True])  # ended in EOS: no overshoot, a longer answer
    assert oc.n_spans == 2 and learner.spans == 1
    learner.learn([np.array(answer[:30] + beyond)], [False])  # not held up to its last K + 1 ids: a new answer
    assert oc.n_spans == 3
