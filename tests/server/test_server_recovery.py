"""A server's learned corpus on disk: it survives a restart and a ``kill -9``, and a damaged journal (truncated
mid-record, a flipped byte) is skipped with a warning while the server starts and serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serverkit import live_server, serve_args

REPO = Path(__file__).resolve().parents[2]
P1, P2 = [10, 20, 30, 40], [50, 41, 32, 23]


def ask(srv, prompt, n=40):
    r = srv.client().completions.create(model=srv.server.model_id, prompt=prompt, max_tokens=n)
    return r.choices[0].text, r.model_extra["redraft"]


def learned_spans(srv) -> list[list[int]]:
    return [s.tolist() for s in srv.server.generator.corpora.get("default").corpus.span_list()]


def test_learned_spans_survive_a_restart(model_dir, loaded, tmp_path):
    args = serve_args(model_dir, "--no-ngram", "--corpus-dir", str(tmp_path / "c"))
    with live_server(args, loaded) as srv:
        text, first = ask(srv, P1)
        spans = learned_spans(srv)
    with live_server(args, loaded) as srv:
        assert learned_spans(srv) == spans
        again, replay = ask(srv, P1)
    assert again == text and replay["sources"]["corpus"]["accepted"] > 0
    assert replay["forwards"] < first["forwards"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_journal_is_skipped_with_a_warning(model_dir, loaded, tmp_path, capfd, damage):
    cdir = tmp_path / "c"
    args = serve_args(model_dir, "--no-ngram", "--corpus-dir", str(cdir))
    with live_server(args, loaded) as srv:
        ask(srv, P1)
        ask(srv, P2)
        spans = learned_spans(srv)
    assert len(spans) == 2
    journal = next((cdir / "default").glob("journal-*.rdj"))
    data = bytearray(journal.read_bytes())
    if damage == "truncate":
        data = data[:-5]  # the second record loses its end
        kept, text = spans[:1], "torn tail"
    else:
        data[20] ^= 0x10  # inside the first record's payload
        kept, text = spans[1:], "corrupt record"
    journal.write_bytes(bytes(data))
    capfd.readouterr()
    with live_server(args, loaded) as srv:
        assert learned_spans(srv) == kept
        _, replay = ask(srv, P1 if damage == "truncate" else P2)
        assert replay["sources"]["corpus"]["accepted"] > 0  # the intact span still drafts
        assert httpx.get(f"{srv.base}/health", timeout=10).json()["status"] == "ok"
    err = capfd.readouterr().err
    assert text in err and "redraft: warning" in err


def test_corpus_dir_of_another_tokenizer_is_refused(model_dir, loaded, tmp_path):
    from redraft.cli.serve import build_server

    (tmp_path / "meta.json").write_text('{"fingerprint": "other", "vocab_size": 64}')
    with pytest.raises(SystemExit) as e:
        build_server(serve_args(model_dir, "--corpus-dir", str(tmp_path)), loaded)
    assert "another tokenizer" in str(e.value) and "\n" not in str(e.value)


def start_process(model_dir, cdir, log):
    """`python -m redraft serve` in a subprocess on a free port; returns (process, base url)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "redraft", "serve", "--model", str(model_dir), "--port", "0",
                             "--no-ngram", "--corpus-dir", str(cdir)], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", Path(log).read_text())
        if m:
            base = m.group(1)
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {Path(log).read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start in time")


@pytest.mark.slow  # two server processes: ~20 s of imports on this machine
def test_kill_9_loses_at_most_the_span_in_flight(model_dir, tmp_path):
    cdir = tmp_path / "c"
    proc, base = start_process(model_dir, cdir, tmp_path / "log1")
    try:
        done = []
        for prompt in ([3, 4, 5], [6, 7, 8], [9, 10, 11]):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 30}, timeout=60)
            assert r.status_code == 200
            done.append(r.json()["redraft"]["learned"])
        body = {"prompt": [12, 13, 14], "max_tokens": 600, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    os.kill(proc.pid, signal.SIGKILL)  # mid-generation
                    break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sum(done) >= 1
    proc, base = start_process(model_dir, cdir, tmp_path / "log2")
    try:
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        m = re.search(r'redraft:corpus_spans\{model_name="[^"]*",tenant="default"\} (\S+)', metrics)
        assert m and float(m.group(1)) == sum(done)  # every completed answer, not the one in flight
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
