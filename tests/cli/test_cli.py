"""Command line: argument parsing, environment variables, prompt files, token logs, corpus policy, and
``redraft run`` / ``redraft freeze`` end to end (in-process) on a tiny saved model with a word-level tokenizer."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
from conftest import CLI_EOS, CLI_VOCAB, plain_greedy

from redraft.cli import build_parser, main
from redraft.cli.common import resolve_draft_args, use_policy
from redraft.corpus import CorpusError, load_corpus
from redraft.drafters.frozen_corpus import open_corpus
from redraft.io.freeze import PromptFileError, append_spans, parse_token_log, read_prompts

TOK_VOCAB = CLI_VOCAB
EOS = CLI_EOS
SPEC_RE = re.compile(r"^speculation: (\d+\.\d\d) tokens/forward \((\d+) forwards per (\d+) tokens\)$")
TOKENS_RE = re.compile(r"^\[TOKENS\] (\d+) generated: ?([\d ]*)$")
PROMPT_RE = re.compile(r"^\[PROMPT_TOKENS\] (\d+): ([\d ]*)$")
CORPUS_RE = re.compile(r"^corpus drafts: (\d+)% acceptance \((\d+)/(\d+) proposed from (\d+) frozen ids\)$")
ALL_ENV = ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS", "REDRAFT_CORPUS_K", "COLI_CORPUS_K",
           "REDRAFT_CORPUS_MINACC", "COLI_CORPUS_MINACC", "TOKENS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    # the cost-aware policy caches the cost curve it measures: never in the user's cache
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "cache"))


def words(ids) -> str:
    return " ".join(f"t{i:02d}" for i in ids)


def run_cli(capsys, *argv) -> tuple[int, str, list[str]]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def parse_report(err: list[str]) -> dict:
    rep = {}
    for line in err:
        for key, rx in (("spec", SPEC_RE), ("tokens", TOKENS_RE), ("prompt", PROMPT_RE), ("corpus", CORPUS_RE)):
            m = rx.match(line)
            if m:
                rep[key] = m.groups()
    return rep


# ---- argument parsing --------------------------------------------------------------------------------------------

def test_run_defaults():
    a = build_parser().parse_args(["run", "hello"])
    assert a.command == "run" and a.prompt == "hello"
    assert a.ngen == 128 and a.model is None and not a.no_chat
    assert a.corpus is None and a.k is None and a.minacc is None and not a.no_ngram and not a.tokens


def test_run_flags():
    a = build_parser().parse_args(["run", "--corpus", "c.txt", "--k", "16", "--minacc", "30", "--no-ngram",
                                   "--tokens", "--ngen", "5", "--no-chat", "--model", "m", "p"])
    assert (a.corpus, a.k, a.minacc, a.no_ngram, a.tokens, a.ngen, a.no_chat, a.model) == \
        ("c.txt", 16, 30.0, True, True, 5, True, "m")


def test_run_flags_take_effect(tiny_model_dir, capsys, tmp_path, engine_spy):
    """The same flags end to end: each one changes what `redraft run` does (the parse alone proves nothing)."""
    import shutil

    d, model = tiny_model_dir
    chat = tmp_path / "chat-model"  # the tiny model with a chat template, so --no-chat has something to turn off
    shutil.copytree(d, chat)
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "t02 {% for m in messages %}{{ m['content'] }}{% endfor %} t03"
    (chat / "tokenizer_config.json").write_text(json.dumps(cfg))
    want = plain_greedy(model, PROMPT, 40, eos=[EOS])
    c = tmp_path / "c.txt"
    append_spans(c, [PROMPT + want])

    base = ["run", "--model", str(chat), "--corpus", str(c), "--no-ngram", "--tokens"]
    rc, out, err = run_cli(capsys, *base, "--k", "16", "--minacc", "30", "--ngen", "5", "--no-chat", words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert [int(x) for x in rep["prompt"][1].split()] == PROMPT  # --no-chat: the words' ids, no template
    assert [int(x) for x in rep["tokens"][1].split()] == want[:5]  # --ngen 5, --tokens
    assert out.split() == [f"t{i:02d}" for i in want[:5] if i != EOS]
    engine = engine_spy["engine"]
    assert [dr.name for dr in engine.drafters] == ["corpus"]  # --no-ngram
    corpus = engine.drafters[0]
    assert corpus.k == 16 and corpus.guard.minacc == pytest.approx(0.30)  # --k 16, --minacc 30
    assert engine.policy is None  # a fixed --k turns the cost-aware policy off
    assert corpus.corpus.n_tokens == len(PROMPT) + len(want)  # --corpus

    # the opposite settings, same prompt: the template wraps the prompt, n-gram drafts join, the policy drafts
    rc, _, err = run_cli(capsys, "run", "--model", str(chat), "--corpus", str(c), "--ngen", "5", words(PROMPT))
    assert rc == 0 and "[TOKENS]" not in "\n".join(err)  # no --tokens: no id lines
    engine = engine_spy["engine"]
    assert [dr.name for dr in engine.drafters] == ["corpus", "ngram"] and engine.policy is not None
    assert engine_spy["res"].prompt_ids == [2] + PROMPT + [3]  # t02 ... t03: the chat template applied


@pytest.mark.parametrize("argv,msg", [
    (["run", "--ngen", "0", "p"], "at least 1"),
    (["run", "--ngen", "x", "p"], "not an integer"),
    (["run", "--minacc", "101", "p"], "outside 0..100"),
    (["run", "--minacc", "abc", "p"], "not a number"),
    (["run", "--k", "eight", "p"], "argument --k: 'eight' is not an integer"),
    ([], "required"),
    (["freeze"], "--out"),
])
def test_bad_arguments_exit_2(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err  # one line, no usage block
    assert err.startswith("redraft") and "--help)" in err


@pytest.mark.parametrize("argv,threads", [(["--threads", "2", "bench", "run"], 2), (["bench", "run", "--threads", "3"], 3),
                                          (["--threads", "2", "bench", "cost"], 2), (["--threads", "4", "run", "p"], 4),
                                          (["run", "--threads", "3", "p"], 3), (["freeze", "--out", "c", "--threads", "2"], 2),
                                          (["--threads", "2", "run", "p"], 2), (["run", "p"], None),
                                          (["bench", "run"], None)])
def test_threads_flag_of_a_subcommand_keeps_the_top_level_one(argv, threads):
    """`redraft --threads 2 bench run` used to lose its 2 to bench's own --threads default."""
    assert getattr(build_parser().parse_args(argv), "threads", None) == threads


def test_bench_minacc_is_a_checked_percentage(capsys):
    assert build_parser().parse_args(["bench", "run", "--minacc", "30"]).minacc == 30.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "run", "--minacc", "150"])
    assert "outside 0..100" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: redraft ")
    assert "byte-identical to plain greedy decoding" in " ".join(out.split())
    # one row per command in the COMMAND table: name, then its help text
    rows = dict(re.findall(r"^ {4}([a-z]+) +(\S.*)$", out, re.M))
    for cmd in ("run", "freeze", "demo", "oracle", "glide", "corpus", "bench"):
        assert cmd in rows, (cmd, rows)
    assert rows["run"].startswith("generate a reply to one prompt")


def test_serve_help_names_every_route(capsys):
    from redraft.server.app import ENDPOINTS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for route in (*ENDPOINTS, "/openapi.json"):
        assert route in out, route
    assert "--minacc PCT" in out  # the metavar the help text speaks of


def test_run_help_documents_prompts_files_and_new_corpus_format(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "'turns' list, whose first turn is used" in out  # the field the prompts-file error names
    assert "a missing file is created: text for a .txt name, binary otherwise" in out


# ---- environment: corpus, K, MINACC ------------------------------------------------------------------------------

def _args(*argv):
    return build_parser().parse_args(["run", *argv, "p"])


def test_resolve_defaults():
    assert resolve_draft_args(_args()) == (None, 8, 0.5)


def test_resolve_redraft_env_beats_coli(monkeypatch):
    monkeypatch.setenv("COLI_DRAFT_CORPUS", "coli.txt")
    monkeypatch.setenv("COLI_CORPUS_K", "5")
    monkeypatch.setenv("COLI_CORPUS_MINACC", "20")
    assert resolve_draft_args(_args()) == ("coli.txt", 5, 0.2)
    monkeypatch.setenv("REDRAFT_DRAFT_CORPUS", "redraft.txt")
    monkeypatch.setenv("REDRAFT_CORPUS_K", "12")
    monkeypatch.setenv("REDRAFT_CORPUS_MINACC", "75")
    assert resolve_draft_args(_args()) == ("redraft.txt", 12, 0.75)


def test_resolve_flags_beat_env(monkeypatch):
    monkeypatch.setenv("REDRAFT_DRAFT_CORPUS", "env.txt")
    monkeypatch.setenv("REDRAFT_CORPUS_K", "12")
    monkeypatch.setenv("REDRAFT_CORPUS_MINACC", "75")
    assert resolve_draft_args(_args("--corpus", "flag.txt", "--k", "3", "--minacc", "10")) == ("flag.txt", 3, 0.1)
    assert resolve_draft_args(_args("--minacc", "0"))[2] == 0.0


def test_resolve_empty_env_falls_through(monkeypatch):
    monkeypatch.setenv("REDRAFT_DRAFT_CORPUS", "")
    monkeypatch.setenv("COLI_DRAFT_CORPUS", "coli.txt")
    monkeypatch.setenv("REDRAFT_CORPUS_K", "")
    assert resolve_draft_args(_args()) == ("coli.txt", 8, 0.5)


@pytest.mark.parametrize("name,value,msg", [
    ("REDRAFT_CORPUS_K", "lots", "not an integer"),
    ("COLI_CORPUS_K", "8.5", "not an integer"),
    ("COLI_CORPUS_MINACC", "150", "outside 0..100"),
    ("REDRAFT_CORPUS_MINACC", "half", "not a number"),
])
def test_resolve_bad_env_values(monkeypatch, name, value, msg):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        resolve_draft_args(_args())
    assert msg in str(e.value.code) and "redraft: error" in str(e.value.code)


# ---- prompts files -----------------------------------------------------------------------------------------------

def test_read_prompts_lines_and_jsonl(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("first prompt\n\n   \n  second  \n"
                 '{"prompt": "third"}\n'
                 '{"question_id": 81, "turns": ["fourth", "follow-up"]}\n', encoding="utf-8")
    assert read_prompts(p) == ["first prompt", "second", "third", "fourth"]


def test_read_prompts_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": "unterminated\n', encoding="utf-8")
    with pytest.raises(PromptFileError, match=re.escape(f"{p}:2: invalid JSON")):
        read_prompts(p)


@pytest.mark.parametrize("line", ['{"text": "x"}', '{"turns": []}', '{"prompt": 5}', '{"turns": [3]}'])
def test_read_prompts_object_without_prompt(tmp_path, line):
    p = tmp_path / "q.jsonl"
    p.write_text('{"prompt": "ok"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(PromptFileError, match=re.escape(f"{p}:3: expected")):
        read_prompts(p)


def test_read_prompts_unreadable(tmp_path):
    with pytest.raises(PromptFileError, match="cannot read prompts"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(PromptFileError, match="latin1.txt"):
        read_prompts(tmp_path / "latin1.txt")


# ---- token logs and append_spans ---------------------------------------------------------------------------------

def test_parse_token_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("some output text\n"
                   "[PROMPT_TOKENS] 3: 1 2 3\n"
                   "speculation: 2.00 tokens/forward (2 forwards per 4 tokens)\n"
                   "[TOKENS] 4 generated: 10 11 12 13\n"
                   "[TOKENS] 2 generated: 20 21\n"          # no prompt line before it
                   "noise [PROMPT_TOKENS] 1: 7\n"           # prefixed lines are found too
                   "[TOKENS] 0 generated:\n", encoding="utf-8")
    assert parse_token_log(log) == [[1, 2, 3, 10, 11, 12, 13], [20, 21], [7]]


def test_parse_token_log_count_mismatch_names_line(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[PROMPT_TOKENS] 2: 1 2\n[TOKENS] 3 generated: 10 11\n", encoding="utf-8")
    with pytest.raises(PromptFileError, match=re.escape(f"{log}:2: line says 3 ids but has 2")):
        parse_token_log(log)


def test_parse_token_log_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="cannot read log"):
        parse_token_log(tmp_path / "nope.log")


def test_append_spans_format_and_round_trip(tmp_path):
    c = tmp_path / "sub" / "corpus.txt"
    assert append_spans(c, [[1, 2, 3], [4, 5]]) == 2
    assert c.read_text() == "1 2 3\n-1\n4 5\n"
    assert append_spans(c, [[6]]) == 1
    assert c.read_text() == "1 2 3\n-1\n4 5\n-1\n6\n"
    corpus = load_corpus(str(c), vocab_size=10)
    assert [s.tolist() for s in corpus.span_list()] == [[1, 2, 3], [4, 5], [6]]


def test_append_spans_after_trailing_separator(tmp_path):
    c = tmp_path / "c.txt"
    c.write_text("1 2 3 -1\n")
    append_spans(c, [[4, 5]])
    assert c.read_text() == "1 2 3 -1\n4 5\n"
    assert append_spans(c, []) == 0 and c.read_text() == "1 2 3 -1\n4 5\n"


@pytest.mark.parametrize("existing", ["5 6 7", "5 6 7\n-1"])
def test_append_spans_to_file_without_trailing_newline(tmp_path, existing):
    c = tmp_path / "c.txt"
    c.write_text(existing)
    append_spans(c, [[8, 9]])
    assert [s.tolist() for s in load_corpus(str(c), vocab_size=10).span_list()] == [[5, 6, 7], [8, 9]]


# ---- open_corpus policy ------------------------------------------------------------------------------------------

def test_open_corpus_missing_file_warns_once(tmp_path, capsys):
    assert open_corpus(str(tmp_path / "missing.txt"), vocab_size=100) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "missing.txt" in err[0] and "no such file" in err[0]


def test_open_corpus_directory_warns(tmp_path, capsys):
    assert open_corpus(str(tmp_path), vocab_size=100) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable file" in err[0]


def test_open_corpus_non_integer_token(tmp_path):
    c = tmp_path / "c.txt"
    c.write_text("1 2 3\n-1\n4 five 6\n")
    with pytest.raises(CorpusError) as e:
        open_corpus(str(c), vocab_size=100)
    msg = str(e.value)
    assert str(c) in msg and ":3:" in msg and "'five'" in msg


def test_open_corpus_id_outside_vocab(tmp_path):
    c = tmp_path / "c.txt"
    c.write_text("1 2 3 -1\n4 150 6\n")
    with pytest.raises(CorpusError) as e:
        open_corpus(str(c), vocab_size=100)
    msg = str(e.value)
    assert "150" in msg and "position" in msg and str(c) in msg


def test_open_corpus_empty_is_a_note(tmp_path, capsys):
    c = tmp_path / "empty.txt"
    c.write_text("")
    corpus = open_corpus(str(c), vocab_size=100)
    assert corpus is not None and corpus.n_tokens == 0
    err = capsys.readouterr().err
    assert "note" in err and "empty" in err and "warning" not in err


def test_open_corpus_good_file(tmp_path, capsys):
    c = tmp_path / "c.txt"
    c.write_text("1 2 3 -1\n4 5 6\n")
    corpus = open_corpus(str(c), vocab_size=100)
    assert corpus.n_tokens == 6 and capsys.readouterr().err == ""


# ---- redraft run, end to end on a tiny model ---------------------------------------------------------------------

PROMPT = [5, 6, 7, 5, 6, 7, 9, 10]


def test_run_tokens_report(tiny_model_dir, capsys):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 12, eos=[EOS])
    rc, out, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "12", "--tokens", words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert rep["prompt"] == (str(len(PROMPT)), " ".join(map(str, PROMPT)))
    n, ids = rep["tokens"]
    assert [int(x) for x in ids.split()] == want and int(n) == len(want)
    tpf, fwd, tok = rep["spec"]
    assert int(tok) == len(want) and float(tpf) == pytest.approx(int(tok) / int(fwd), abs=0.006)
    assert "corpus" not in rep
    assert any(line.startswith("speed: ") for line in err)
    from transformers import AutoTokenizer
    assert out == AutoTokenizer.from_pretrained(str(d)).decode(want, skip_special_tokens=True) + "\n"


def test_run_tokens_env_and_stdin(tiny_model_dir, capsys, monkeypatch):
    d, model = tiny_model_dir
    monkeypatch.setenv("TOKENS", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO(words(PROMPT)))
    rc, out, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "6", "-")
    assert rc == 0
    rep = parse_report(err)
    assert rep["prompt"][1] == " ".join(map(str, PROMPT))
    assert [int(x) for x in rep["tokens"][1].split()] == plain_greedy(model, PROMPT, 6, eos=[EOS])


def test_run_without_tokens_flag_prints_no_token_lines(tiny_model_dir, capsys):
    d, _ = tiny_model_dir
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "4", words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert "spec" in rep and "tokens" not in rep and "prompt" not in rep


def test_run_missing_corpus_warns_once_and_succeeds(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    missing = tmp_path / "nope.txt"
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "8", "--tokens",
                         "--corpus", str(missing), words(PROMPT))
    assert rc == 0
    warns = [line for line in err if "warning" in line]
    assert len(warns) == 1 and str(missing) in warns[0]
    assert [int(x) for x in parse_report(err)["tokens"][1].split()] == plain_greedy(model, PROMPT, 8, eos=[EOS])


def test_run_corpus_from_env_replays(tiny_model_dir, capsys, tmp_path, monkeypatch):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 30, eos=[EOS])
    c = tmp_path / "c.txt"
    append_spans(c, [PROMPT + want])
    monkeypatch.setenv("COLI_DRAFT_CORPUS", str(c))
    monkeypatch.setenv("REDRAFT_CORPUS_K", "6")
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "30", "--tokens", "--no-ngram",
                         words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert [int(x) for x in rep["tokens"][1].split()] == want
    pct, acc, prop, frozen = map(int, rep["corpus"])
    assert frozen == len(PROMPT) + len(want) and acc > 0 and prop >= acc
    assert pct == round(100 * acc / prop)
    tpf, fwd, tok = rep["spec"]
    assert len(want) == 30 and int(fwd) <= 30 // 3


@pytest.fixture
def engine_spy(monkeypatch):
    """Records, for `redraft run` in-process, the Engine that generated, its result, the exact mode in effect and
    whether each verify forward carried a tree attention mask (a branched token tree) or not (a chain)."""
    from redraft.decoding.engine import Engine
    from redraft.runtimes.transformers.target import HFTarget

    seen: dict = {"masks": []}
    generate, forward = Engine.generate, HFTarget.forward

    def spy_generate(self, *args, **kw):
        seen["masks"] = []  # this generation's forwards only
        res = generate(self, *args, **kw)
        seen.update(engine=self, res=res, exact=self.exact if kw.get("exact") is None else kw["exact"])
        return res

    def spy_forward(self, ids, positions=None, mask=None, n_logits=1):
        seen["masks"].append(mask is not None)
        return forward(self, ids, positions, mask, n_logits)

    monkeypatch.setattr(Engine, "generate", spy_generate)
    monkeypatch.setattr(HFTarget, "forward", spy_forward)
    return seen


@pytest.mark.parametrize("flags,tree,exact,budget,depth,sources", [
    (["--tree", "3"], True, True, 32, 48, {"corpus", "ngram"}),  # the policy (the default) drafts up to 48
    (["--no-exact"], False, False, 48, 48, {"corpus", "ngram"}),
    (["--tree", "2", "--tree-budget", "5", "--k", "4"], True, True, 5, 4, {"corpus", "ngram"}),
    (["--no-ngram", "--minacc", "100"], False, True, 32, 8, {"corpus"}),
])
def test_run_draft_flags_keep_output_identical(tiny_model_dir, capsys, tmp_path, engine_spy, flags, tree, exact,
                                               budget, depth, sources):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 30, eos=[EOS])
    c = tmp_path / "c.txt"
    perturbed = PROMPT + want
    perturbed[len(PROMPT) + 12] = (perturbed[len(PROMPT) + 12] + 1) % TOK_VOCAB
    append_spans(c, [PROMPT + want[:20], perturbed])
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "30", "--tokens", "--corpus", str(c),
                         *flags, words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert [int(x) for x in rep["tokens"][1].split()] == want
    assert int(rep["spec"][1]) < 30
    engine, res = engine_spy["engine"], engine_spy["res"]
    assert res.output_ids == want and len(engine_spy["masks"]) == res.forwards == int(rep["spec"][1])
    assert any(engine_spy["masks"]) == tree  # --tree: some forward verified a branched token tree; else chains only
    assert engine.merge == tree and engine_spy["exact"] == exact
    assert (engine.policy is None) == ("--k" in flags or "--minacc" in flags)  # a fixed setting turns it off
    assert max(res.drafted_per_forward) <= budget and max(res.accepted_per_forward) <= depth
    assert set(res.sources) == sources
    if "--minacc" in flags:
        assert engine.drafters[0].guard.minacc == 1.0


@pytest.mark.parametrize("argv,env,on", [
    ([], {}, True), (["--no-policy"], {}, False), (["--k", "8"], {}, False), (["--minacc", "50"], {}, False),
    (["--k-max", "32"], {}, False), ([], {"COLI_CORPUS_K": "8"}, False), ([], {"REDRAFT_CORPUS_K": "8"}, False),
    ([], {"COLI_CORPUS_MINACC": "50"}, False), ([], {"REDRAFT_CORPUS_MINACC": "50"}, False),
    ([], {"COLI_CORPUS_K": ""}, True)])
def test_policy_is_the_default_unless_a_fixed_setting_is_given(monkeypatch, argv, env, on):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert use_policy(build_parser().parse_args(["run", *argv, "hello"])) is on


def test_run_with_the_policy_replays_and_caches_its_cost_curve(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 40, eos=[EOS])
    c = tmp_path / "c.txt"
    append_spans(c, [PROMPT + want])
    for _ in range(2):  # the second run reads the curve the first measured
        rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "40", "--tokens", "--corpus",
                             str(c), words(PROMPT))
        assert rc == 0
        rep = parse_report(err)
        assert [int(x) for x in rep["tokens"][1].split()] == want
        assert int(rep["spec"][1]) < len(want) // 4  # deep drafts: far fewer forwards than tokens
    assert len(list((tmp_path / "cache" / "cost-curves").glob("*.json"))) == 1


def test_run_k_from_the_environment_out_of_range_warns(tiny_model_dir, capsys, monkeypatch):
    """--k 99 is refused by the parser (test_cli_badinput.py); a K from the environment cannot be, so it is clamped
    as Colibri does, with one warning naming the variable."""
    d, _ = tiny_model_dir
    monkeypatch.setenv("COLI_CORPUS_K", "99")
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "3", words(PROMPT))
    assert rc == 0
    assert [line for line in err if "warning" in line] == [
        "redraft: warning: COLI_CORPUS_K=99 is outside 1..48 (a draft depth in tokens); using 48"]


def test_run_malformed_corpus_is_refused(tiny_model_dir, capsys, tmp_path):
    d, _ = tiny_model_dir
    c = tmp_path / "bad.txt"
    c.write_text("1 2 3\nx 4\n")
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(d), "--no-chat", "--ngen", "3", "--corpus", str(c), words(PROMPT)])
    msg = str(e.value.code)
    assert "corpus refused" in msg and f"{c}:2" in msg
    c.write_text(f"1 2 {TOK_VOCAB}\n")
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(d), "--no-chat", "--ngen", "3", "--corpus", str(c), words(PROMPT)])
    assert "corpus refused" in str(e.value.code) and str(TOK_VOCAB) in str(e.value.code)


def test_run_bad_model_path(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path / "none"), "hi"])
    assert "redraft: error" in str(e.value.code) and "no such file or directory" in str(e.value.code)
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + b"\0" * 10)
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path / "x.gguf"), "hi"])
    assert "not a GGUF file" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path), "hi"])
    assert "no config.json" in str(e.value.code)


# ---- redraft freeze ----------------------------------------------------------------------------------------------

def test_freeze_prompts_appends_prompt_plus_generation(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    prompts = [[5, 6, 7], [20, 21, 22, 23]]
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(words(p) for p in prompts) + "\n")
    out = tmp_path / "corpus.txt"
    rc, _, err = run_cli(capsys, "freeze", "--model", str(d), "--no-chat", "--ngen", "10", "--prompts", str(pf),
                         "--out", str(out))
    assert rc == 0
    want = [p + plain_greedy(model, p, 10, eos=[EOS]) for p in prompts]
    assert want[1][-1] == EOS and len(want[1]) < 4 + 10  # the second prompt's generation ends at EOS
    assert [s.tolist() for s in load_corpus(str(out), vocab_size=TOK_VOCAB).span_list()] == want
    assert any(f"froze 2 spans ({sum(map(len, want))} ids)" in line for line in err)


def test_freeze_from_log_round_trip(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "9", "--tokens", words(PROMPT))
    log = tmp_path / "run.log"
    log.write_text("\n".join(err) + "\n")
    out = tmp_path / "c.txt"
    rc, _, err2 = run_cli(capsys, "freeze", "--from-log", str(log), str(log), "--out", str(out))
    assert rc == 0
    span = PROMPT + plain_greedy(model, PROMPT, 9, eos=[EOS])
    assert [s.tolist() for s in load_corpus(str(out)).span_list()] == [span, span]
    assert any("froze 2 spans" in line for line in err2)


def test_freeze_needs_exactly_one_source(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["freeze", "--out", str(tmp_path / "c.txt")])
    assert "exactly one of" in str(e.value.code)
    (tmp_path / "p.txt").write_text("x\n")
    (tmp_path / "l.log").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["freeze", "--prompts", str(tmp_path / "p.txt"), "--from-log", str(tmp_path / "l.log"),
              "--out", str(tmp_path / "c.txt")])
    assert "exactly one of" in str(e.value.code)


def test_freeze_log_without_tokens_lines(tmp_path):
    log = tmp_path / "l.log"
    log.write_text("nothing here\n")
    with pytest.raises(SystemExit) as e:
        main(["freeze", "--from-log", str(log), "--out", str(tmp_path / "c.txt")])
    assert "no [TOKENS] lines" in str(e.value.code)
    assert not (tmp_path / "c.txt").exists()


def test_freeze_bad_prompts_file(tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text("{broken\n")
    with pytest.raises(SystemExit) as e:
        main(["freeze", "--prompts", str(pf), "--out", str(tmp_path / "c.txt")])
    assert f"{pf}:1" in str(e.value.code)
    pf.write_text("\n\n")
    with pytest.raises(SystemExit) as e:
        main(["freeze", "--prompts", str(pf), "--out", str(tmp_path / "c.txt")])
    assert "has no prompts" in str(e.value.code)


def test_demo_end_to_end_on_a_tiny_model(tiny_model_dir, capsys, tmp_path):
    """`redraft demo` on a tiny saved model: both tables, a total row, the legend of their columns, every output
    identical to plain greedy decoding (the JSON's counts), the corpus written where asked. Its stderr is not a
    terminal here (as in `make demo > log`): no progress bar redraws, a start line and a summary line per phase."""
    from redraft.cli.demo import LEGEND

    d, _ = tiny_model_dir
    rc = main(["demo", "--model", str(d), "--questions", "2", "--other", "1", "--ngen", "6",
               "--corpus-out", str(tmp_path / "c.txt"), "--json", str(tmp_path / "demo.json")])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "\r" not in err, repr(err)
    phases = [line for line in err.splitlines() if re.match(r"\d/3 ", line)]
    names = ("1/3 plain greedy: 2 questions", "2/3 replay: 2 questions", "3/3 other questions: 1 question")
    assert [re.sub(r", \d+\.\d s$", "", line) for line in phases] == [
        line for name in names for line in (f"{name} ...", name)], phases
    assert "Replay: 2 questions frozen in the corpus" in out and "Other questions: 1 not in the corpus" in out
    assert out.rstrip().endswith(LEGEND) and all(f"{k}:" in LEGEND for k in ("fwd", "fwd+d", "tok/s+d", "same"))
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["replay"]["total"]["identical"] == 2 and report["other"]["total"]["identical"] == 1
    assert (tmp_path / "c.txt").stat().st_size > 0
