"""``redraft run --prompts FILE``: many prompts in one process, one JSON line each; ``--learn`` grows the corpus file
(text or binary, atomically) so later prompts in the run and later runs replay the answers. Ids against plain
greedy decoding of the same model."""

from __future__ import annotations

import json

import pytest
from conftest import plain_greedy
from serverkit import EOS, save_tiny_model, words

from redraft.cli import main
from redraft.corpus import load_corpus
from redraft.corpus.format import sniff

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23], [40, 41, 42]]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS", "REDRAFT_CORPUS_K", "COLI_CORPUS_K",
                 "REDRAFT_CORPUS_MINACC", "COLI_CORPUS_MINACC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from redraft.io.loading import load_model

    d = save_tiny_model(tmp_path_factory.mktemp("run-prompts-model"))
    return d, load_model(d).model


def run_prompts(capsys, d, path, *flags) -> list[dict]:
    assert main(["run", "--model", str(d), "--no-chat", "--ngen", "30", "--prompts", str(path), *flags]) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("name", ["answers.txt", "answers.corpus"])  # text and binary corpora
def test_prompts_answered_learned_and_replayed(tiny, tmp_path, capsys, name):
    d, model = tiny
    plain = tmp_path / "prompts.txt"
    plain.write_text("\n".join(words(p) for p in PROMPTS) + "\n")
    jsonl = tmp_path / "prompts.jsonl"  # the same prompts as JSONL, the first one twice
    jsonl.write_text("\n".join(json.dumps({"prompt": words(p)}) for p in [PROMPTS[0]] + PROMPTS) + "\n")
    corpus = tmp_path / name
    want = [plain_greedy(model, p, 30, eos=[EOS]) for p in PROMPTS]

    first = run_prompts(capsys, d, plain, "--corpus", str(corpus), "--learn")
    assert [r["prompt"] for r in first] == [words(p) for p in PROMPTS]
    assert [r["ids"] for r in first] == want and [r["prompt_ids"] for r in first] == PROMPTS
    assert all(r["learned"] and r["tokens"] == len(r["ids"]) and r["forwards"] >= 1 for r in first)
    assert sniff(corpus) == ("text" if name.endswith(".txt") else "binary")
    assert load_corpus(str(corpus)).n_spans == len(PROMPTS)

    again = run_prompts(capsys, d, jsonl, "--corpus", str(corpus), "--learn")  # a later run replays every answer
    assert [r["ids"] for r in again] == [want[0]] + want
    assert not any(r["learned"] for r in again)  # nothing new: the corpus is unchanged
    assert all(r["forwards"] < f["forwards"] for r, f in zip(again[1:], first, strict=True) if len(f["ids"]) > 2)
    assert load_corpus(str(corpus)).n_spans == len(PROMPTS)


def test_a_repeated_prompt_replays_within_one_run(tiny, tmp_path, capsys):
    d, model = tiny
    f = tmp_path / "p.txt"
    f.write_text(f"{words(PROMPTS[1])}\n{words(PROMPTS[1])}\n")
    a, b = run_prompts(capsys, d, f, "--corpus", str(tmp_path / "new.corpus"), "--learn", "--no-ngram")
    assert a["ids"] == b["ids"] == plain_greedy(model, PROMPTS[1], 30, eos=[EOS])
    assert a["learned"] and not b["learned"] and b["forwards"] < a["forwards"]
    assert b["sources"]["corpus"]["accepted"] > 0


def test_prompts_without_learning_and_bad_input(tiny, tmp_path, capsys):
    d, model = tiny
    f = tmp_path / "p.txt"
    f.write_text(words(PROMPTS[2]) + "\n")
    (r,) = run_prompts(capsys, d, f)
    assert r["ids"] == plain_greedy(model, PROMPTS[2], 30, eos=[EOS]) and r["learned"] is False
    with pytest.raises(SystemExit, match="give a PROMPT or --prompts FILE, not both"):
        main(["run", "--model", str(d), "--prompts", str(f), "hello"])
    with pytest.raises(SystemExit, match=r"give a PROMPT or --prompts FILE$"):
        main(["run", "--model", str(d)])
    with pytest.raises(SystemExit, match="--learn: only used with a corpus"):
        main(["run", "--model", str(d), "--prompts", str(f), "--learn"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        main(["run", "--model", str(d), "--prompts", str(bad)])


def test_prefix_dir_starts_later_runs_from_the_prefix_on_disk(tiny, tmp_path, capsys):
    """``--prefix-dir``: the first run writes its prompts' KV entries; a later run (a new process's cache) starts
    from them, with plain greedy's ids; a directory of another tokenizer is refused by name."""
    import random

    d, model = tiny
    rng = random.Random(3)
    system = [rng.randrange(2, 64) for _ in range(150)]  # entries of >= 128 tokens go to disk
    prompts = [system + [5, 6, 7], system + [20, 21]]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(words(p) for p in prompts) + "\n")
    want = [plain_greedy(model, p, 30, eos=[EOS]) for p in prompts]
    pdir = tmp_path / "prefixes"
    first = run_prompts(capsys, d, path, "--prefix-dir", str(pdir))
    assert [r["ids"] for r in first] == want
    assert first[0]["prefix_hit_tokens"] == 0 and first[1]["prefix_hit_tokens"] >= len(system)  # in memory
    assert first[1]["prefix_disk_tokens"] == 0
    again = run_prompts(capsys, d, path, "--prefix-dir", str(pdir))
    assert [r["ids"] for r in again] == want
    assert again[0]["prefix_disk_tokens"] >= len(system)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text('{"fingerprint": null, "vocab_size": 5}')
    with pytest.raises(SystemExit, match="--prefix-dir .*another tokenizer"):
        main(["run", "--model", str(d), "--no-chat", "--prompts", str(path), "--prefix-dir", str(tmp_path / "other")])
