"""One on-disk corpus: `redraft serve --corpus-dir D` and the vLLM proposer (REDRAFT_LEARN_CORPUS=D) draft from each
other's learned spans, survive a torn journal tail written by either, and `redraft corpus` reads and compacts D."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
from conftest import plain_greedy
from serverkit import EOS, VOCAB, live_server, serve_args

from redraft.corpus.directory import read_directory
from redraft.integrations.vllm_proposer import RedraftProposer
from redraft.server.corpora import TenantCorpora

K = 8


def vllm_config(tokenizer=None):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", num_speculative_tokens=K,
                                           model="redraft.integrations.vllm_proposer.RedraftProposer"),
        model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: VOCAB, tokenizer=tokenizer,
                                     hf_config=SimpleNamespace(eos_token_id=EOS)))


def proposer(d, tokenizer=None):
    return RedraftProposer(vllm_config(tokenizer), environ={"REDRAFT_LEARN_CORPUS": str(d), "REDRAFT_NGRAM": "0"})


def serve_request(prop, prompt, out):
    """vLLM's loop for one request whose greedy output is ``out``: returns the first draft and the drafts made."""
    table = np.zeros((1, 512), dtype=np.int32)
    table[0, :len(prompt)] = prompt
    n = np.array([len(prompt)], dtype=np.int32)
    first, drafts, pos = None, [], 0
    draft: list[int] = []
    while pos < len(out):
        a = 0
        while a < len(draft) and pos + a < len(out) and draft[a] == out[pos + a]:
            a += 1
        ids = out[pos:pos + a + 1]
        table[0, n[0]:n[0] + len(ids)] = ids
        n[0] += len(ids)
        pos += len(ids)
        draft = prop.propose([list(ids)], n, table)[0]
        first = draft if first is None else first
        drafts.append(draft)
    prop.flush()
    return first, drafts


def spans_of(d):
    return [s.tolist() for s in read_directory(d)[0].span_list()]


def answer(loaded, prompt, n=30):
    """The tiny model's greedy answer, cut before EOS (the server stops there; the proposer learns ids as given)."""
    out = plain_greedy(loaded.model, prompt, n, eos=[EOS])
    return out[:-1] if out and out[-1] == EOS else out


def journal_of(d):
    """The one journal of ``d``'s default tenant (one writer wrote it)."""
    (journal,) = (d / "default").glob("journal-*.rdj")
    return journal


def test_server_and_proposer_draft_from_each_others_spans(model_dir, loaded, tmp_path):
    d = tmp_path / "corpora"
    p1, p2 = [5, 9, 14, 20, 33, 41], [7, 8, 12, 19, 30, 44]
    o1, o2 = answer(loaded, p1), answer(loaded, p2)
    # the proposer learns first (it creates D with meta.json made for the server's tokenizer)
    prop = proposer(d, tokenizer=str(model_dir))
    assert serve_request(prop, p1, o1)[0] == []  # nothing learned yet
    assert spans_of(d) == [p1 + o1]
    with live_server(serve_args(model_dir, "--no-ngram", "--corpus-dir", str(d)), loaded) as srv:
        client = srv.client()
        r1 = client.completions.create(model=srv.server.model_id, prompt=p1, max_tokens=len(o1))
        assert r1.model_extra["redraft"]["sources"]["corpus"]["accepted"] > 0  # drafted from the proposer's span
        assert not r1.model_extra["redraft"]["learned"]  # and held already
        r2 = client.completions.create(model=srv.server.model_id, prompt=p2, max_tokens=len(o2))
        assert r2.model_extra["redraft"]["learned"]
    assert sorted(spans_of(d)) == sorted([p1 + o1, p2 + o2])  # two writers' journals, read in name order
    first, drafts = serve_request(proposer(d, tokenizer=str(model_dir)), p2, o2)
    assert first == o2[1:1 + K]  # the proposer drafts the server's span at once
    assert sorted(spans_of(d)) == sorted([p1 + o1, p2 + o2])  # and does not store it again


def test_torn_tail_written_by_the_proposer_is_skipped_by_the_server(tmp_path):
    d = tmp_path / "corpora"
    a, b = list(range(10, 40)), list(range(40, 60))
    prop = proposer(d)
    serve_request(prop, a[:6], a[6:])
    serve_request(prop, b[:6], b[6:])
    prop.learned.close()  # the proposer's engine is gone (its journal no longer has a live writer)
    journal = journal_of(d)
    journal.write_bytes(journal.read_bytes()[:-7])  # a crash inside the second record's write
    warnings: list[str] = []
    corpora = TenantCorpora(["default"], str(d), vocab_size=VOCAB, fingerprint=None, cap_tokens=None,
                            warn=warnings.append)
    assert any("torn tail" in w for w in warnings)
    assert corpora.get("default").propose(a[:10], 8)[1].tolist() == a[10:18]
    assert [s.tolist() for s in corpora.get("default").corpus.span_list()] == [a]
    assert corpora.learn_span("default", b)  # appends after the valid records
    corpora.close()
    assert sorted(spans_of(d)) == [a, b]  # two writers: journals in name order


def test_torn_tail_written_by_the_server_is_skipped_by_the_proposer(tmp_path):
    d = tmp_path / "corpora"
    a, b = list(range(10, 40)), list(range(40, 60))
    corpora = TenantCorpora(["default"], str(d), vocab_size=VOCAB, fingerprint=None, cap_tokens=None)
    assert corpora.learn_span("default", a) and corpora.learn_span("default", b)
    corpora.close()
    journal = journal_of(d)
    journal.write_bytes(journal.read_bytes()[:-3])
    prop = proposer(d)
    assert spans_of(d) == [a]  # the torn record is never read
    first, _ = serve_request(prop, a[:6], a[6:])
    assert first == a[7:7 + K]


def test_corpus_tools_read_verify_and_compact_a_directory(tmp_path, capsys):
    from redraft.cli import main

    d = tmp_path / "corpora"
    a, b = list(range(10, 40)), list(range(40, 60))
    corpora = TenantCorpora(["default"], str(d), vocab_size=VOCAB, fingerprint=None, cap_tokens=None)
    corpora.learn_span("default", a)
    corpora.learn_span("default", b)
    corpora.close()
    journal = journal_of(d)
    journal.write_bytes(journal.read_bytes()[:-3])
    assert main(["corpus", "stats", str(d)]) == 0
    out = capsys.readouterr().out
    assert "30 in 1 spans" in out and "damaged:       1 region" in out
    assert main(["corpus", "verify", str(d)]) == 2
    assert "torn tail" in capsys.readouterr().err
    assert main(["corpus", "compact", str(d)]) == 0
    assert main(["corpus", "verify", str(d)]) == 0
    assert "ok" in capsys.readouterr().out
    assert sorted(p.name for p in (d / "default").iterdir()) == [
        "base-000001.bin", "generation-000001.json", journal.name + ".damaged"]
    out = tmp_path / "c.rdc"
    assert main(["corpus", "build", str(d), "-o", str(out), "-q"]) == 0  # a directory as an INPUT
    assert [s.tolist() for s in read_directory(d)[0].span_list()] == [a]
    from redraft.corpus import load_corpus

    assert [s.tolist() for s in load_corpus(out).span_list()] == [a]


def test_a_live_server_and_a_live_proposer_learn_from_each_other(model_dir, loaded, tmp_path):
    """Both open on one directory at once (two writers): each drafts the other's new span within the follow
    delay, and neither stores the other's span again."""
    d = tmp_path / "corpora"
    p1, p2 = [6, 10, 15, 21, 34, 42], [8, 9, 13, 18, 31, 45]
    o1, o2 = answer(loaded, p1), answer(loaded, p2)
    prop = proposer(d, tokenizer=str(model_dir))
    with live_server(serve_args(model_dir, "--no-ngram", "--no-answer-cache", "--corpus-dir", str(d)), loaded) as srv:
        client = srv.client()
        r1 = client.completions.create(model=srv.server.model_id, prompt=p1, max_tokens=len(o1))
        assert r1.model_extra["redraft"]["learned"]
        deadline = time.monotonic() + 2.0
        while prop.learned.n_spans < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        first, _ = serve_request(prop, p1, o1)
        assert first == o1[1:1 + K]  # the proposer drafts the server's span (followed, not stored again)
        serve_request(prop, p2, o2)  # the proposer learns a new one
        deadline = time.monotonic() + 2.0
        corpus = srv.server.generator.corpora.get("default")
        while not corpus.corpus.holds(p2 + o2) and time.monotonic() < deadline:
            time.sleep(0.02)
        r2 = client.completions.create(model=srv.server.model_id, prompt=p2, max_tokens=len(o2))
        assert r2.model_extra["redraft"]["sources"]["corpus"]["accepted"] > 0 and not r2.model_extra["redraft"]["learned"]
    prop.learned.close()
    assert sorted(spans_of(d)) == sorted([p1 + o1, p2 + o2])
