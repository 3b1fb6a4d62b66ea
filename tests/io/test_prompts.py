"""One prompt, the same ids through every command path (issue 11 item 4), and the normalisation itself.

The tiny saved model here has a tokenizer in which a space is a token of its own (id 63), so surrounding
whitespace changes the prompt ids, as it does for real BPE tokenizers; it also has a chat template.
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import build_tiny, plain_greedy

from redraft.bench.workloads import ChatEncoder
from redraft.cli import main
from redraft.corpus import load_corpus
from redraft.io.prompts import encode_prompt, normalize_prompt

VOCAB, SPACE, EOS = 64, 63, 1
PROMPT_RE = re.compile(r"^\[PROMPT_TOKENS\] (\d+): ([\d ]*)$")
SPEC_RE = re.compile(r"^speculation: (\d+\.\d\d) tokens/forward \((\d+) forwards per (\d+) tokens\)$")
TEMPLATE = ("{% for m in messages %}t02 {{ m['content'] }} t03 {% endfor %}"
            "{% if add_generation_prompt %}t04 {% endif %}")
TEXT = "t08 t09 t10 t11 t12 t13"
PADDED = f"  {TEXT}  "


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    # `redraft run` measures and caches the cost-aware policy's cost curve: never in the user's cache
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def spaced_model_dir(tmp_path_factory):
    """A saved tiny Llama with a word-level tokenizer: "t00".."t62" are ids 0..62, " " is id 63, "t01" is EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("spaced-model")
    vocab = {f"t{i:02d}": i for i in range(SPACE)} | {" ": SPACE}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t00"))
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t00", eos_token="t01")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    model = build_tiny("llama", "sdpa", seed=11, vocab_size=VOCAB, eos_token_id=EOS)
    model.save_pretrained(d)
    return d, model, tok


def cli(capsys, *argv) -> list[str]:
    assert main([str(a) for a in argv]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def prompt_ids(err: list[str]) -> list[int]:
    return next([int(x) for x in m.group(2).split()] for m in map(PROMPT_RE.match, err) if m)


def test_surrounding_whitespace_matters_to_this_tokenizer(spaced_model_dir):
    _, _, tok = spaced_model_dir
    assert tok(PADDED)["input_ids"] != tok(TEXT)["input_ids"]  # else the tests below could not fail


@pytest.mark.parametrize("chat", [False, True])
def test_one_prompt_same_ids_through_every_command(spaced_model_dir, capsys, tmp_path, monkeypatch, chat):
    """run (argument and stdin), freeze (plain and JSONL prompt files), the bench encoder and encode_prompt (demo,
    oracle, glide) all encode "  TEXT  " as TEXT."""
    d, model, tok = spaced_model_dir
    flags = [] if chat else ["--no-chat"]
    want = encode_prompt(tok, TEXT, chat=chat)
    assert (SPACE in want) and want[0] != SPACE and (want[-1] != SPACE or chat)

    from_arg = prompt_ids(cli(capsys, "run", "--model", d, *flags, "--ngen", "2", "--tokens", PADDED))
    monkeypatch.setattr(sys, "stdin", io.StringIO(PADDED + "\n"))
    from_stdin = prompt_ids(cli(capsys, "run", "--model", d, *flags, "--ngen", "2", "--tokens", "-"))

    spans = []
    for name, line in (("q.txt", PADDED), ("q.jsonl", json.dumps({"prompt": PADDED}))):
        (tmp_path / name).write_text(line + "\n", encoding="utf-8")
        out = tmp_path / f"{name}.corpus"
        cli(capsys, "freeze", "--model", d, *flags, "--ngen", "2", "--prompts", tmp_path / name, "--out", out)
        spans += [s.tolist() for s in load_corpus(str(out), vocab_size=VOCAB).span_list()]

    bench = ChatEncoder(tok, chat=chat).encode([{"role": "user", "content": PADDED}])
    assert from_arg == from_stdin == bench == want
    assert [s[:len(want)] for s in spans] == [want, want]


@pytest.mark.parametrize("chat", [False, True])
def test_server_encodes_the_padded_prompt_as_every_command(spaced_model_dir, chat):
    """redraft serve: chat messages are encoded as every command encodes them; a completions prompt is tokenized
    exactly as sent (OpenAI's wire convention: "...Answer: " keeps its space), so its padding stays."""
    from redraft.cli import build_parser
    from redraft.cli.serve import build_server
    from redraft.server.schemas import parse_request

    d, _, tok = spaced_model_dir
    server = build_server(build_parser().parse_args(["serve", "--model", str(d), "--port", "0"]))
    try:
        body = {"messages": [{"role": "user", "content": PADDED}]} if chat else {"prompt": PADDED}
        ids = server.work(parse_request(body, "chat" if chat else "completion")).prompt_ids
    finally:
        server.generator.corpora.close()
    if chat:
        assert ids == encode_prompt(tok, TEXT, chat=True)
    else:
        assert ids == tok(PADDED)["input_ids"] != encode_prompt(tok, TEXT, chat=False)


def test_freeze_then_run_replays_the_padded_prompt(spaced_model_dir, capsys, tmp_path):
    """Issue 11 item 4: freeze a prompts-file line, run the same string (spaces included) against the corpus."""
    d, model, tok = spaced_model_dir
    (tmp_path / "q.txt").write_text(PADDED + "\n", encoding="utf-8")
    corpus = tmp_path / "c.txt"
    cli(capsys, "freeze", "--model", d, "--no-chat", "--ngen", "30", "--prompts", tmp_path / "q.txt", "--out", corpus)
    err = cli(capsys, "run", "--model", d, "--no-chat", "--ngen", "30", "--no-ngram", "--k", "8",
              "--corpus", corpus, PADDED)
    _, fwd, tokens = next(m.groups() for m in map(SPEC_RE.match, err) if m)
    ids = encode_prompt(tok, TEXT, chat=False)
    assert int(tokens) == len(plain_greedy(model, ids, 30, eos=[EOS]))
    assert int(tokens) == 30 and int(fwd) <= 30 // 3  # replayed several tokens a forward, not token by token


@pytest.mark.parametrize("text,norm", [("  a b  ", "a b"), ("\ta\n", "a"), ("a  b", "a  b"), ("", ""), (" \n ", "")])
def test_normalize_prompt_strips_only_the_ends(text, norm):
    assert normalize_prompt(text) == norm


def test_messages_are_normalised_each(spaced_model_dir):
    _, _, tok = spaced_model_dir
    msgs = [{"role": "user", "content": " t05 "}, {"role": "assistant", "content": "t06\n"},
            {"role": "user", "content": "t07"}]
    tidy = [dict(m, content=m["content"].strip()) for m in msgs]
    assert encode_prompt(tok, msgs, chat=True) == encode_prompt(tok, tidy, chat=True)
    assert encode_prompt(tok, msgs, chat=False) == tok("t05\n\nt06\n\nt07")["input_ids"]


def test_only_one_module_applies_chat_templates():
    """Every prompt goes through redraft.io.prompts: no other module calls the tokenizer's chat template."""
    root = Path(__file__).resolve().parents[2] / "redraft"
    users = sorted(str(f.relative_to(root)) for f in root.rglob("*.py") if "apply_chat_template" in f.read_text())
    assert users == ["io/prompts.py"]
