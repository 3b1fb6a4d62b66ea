"""Bad input to every command: one error line naming the flag, file or field and what was expected, a non-zero
exit, no traceback; and wherever the input can be checked without the model, before the model loads (the
``no_load`` fixture fails a test that loads it) and before torch is imported (checked in a fresh process).

Also: ``--stop``, ``--k-max`` and ``--force`` end to end, and ``freeze`` into a binary corpus failing midway."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import plain_greedy
from test_cli import (  # noqa: F401 (clean_env: the autouse fixture)
    EOS,
    PROMPT,
    TOK_VOCAB,
    clean_env,
    parse_report,
    run_cli,
    words,
)

from redraft.cli import main
from redraft.corpus import Corpus, load_corpus


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: a refusal seen under this fixture came before the model loaded."""
    import redraft.cli.common as common

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(common, "load_target", refuse)


def refusal(capsys, argv) -> tuple[int, str]:
    """Run ``redraft ARGV`` in-process; assert a non-zero exit, exactly one ``error:`` line and no traceback;
    return (exit status, that line)."""
    text = ""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc, text = (1, e.code) if isinstance(e.code, str) else (e.code, "")
    err = capsys.readouterr().err
    assert rc != 0, err
    assert "\n" not in text and "Traceback" not in err, text + err
    errors = [line for line in (text + "\n" + err).splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return rc, errors[0]


@pytest.fixture
def bad(tmp_path):
    """Bad inputs, by name: corpora (a text one with a non-integer token, binaries with random bytes, cut short,
    a damaged token stream, ids beyond the tiny vocabulary), prompts files (empty, broken JSON, an empty prompt),
    an existing plain file and an empty directory."""
    d = tmp_path
    (d / "bad.txt").write_text("1 2 3\n4 x 5\n")
    (d / "random.bin").write_bytes(b"RDCORPUS" + os.urandom(600))
    Corpus.from_spans([list(range(2, 40))], vocab_size=TOK_VOCAB).save(d / "good.bin")
    data = (d / "good.bin").read_bytes()
    (d / "truncated.bin").write_bytes(data[:-7])
    (d / "damaged.bin").write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    Corpus.from_spans([[2, 3, 4, TOK_VOCAB + 5]]).save(d / "beyond.bin")  # a valid v2 file, max_id >= vocab
    (d / "empty_prompts.txt").write_text("\n\n")
    (d / "broken.jsonl").write_text('{"prompt": "t05 t06"}\n{broken\n')
    (d / "blank.jsonl").write_text('{"prompt": "   "}\n')
    (d / "afile").write_text("x")
    (d / "emptydir").mkdir()
    return d


# ---- refused before the model loads --------------------------------------------------------------------------------

M = "{model}"  # replaced by the tiny model directory: a model that would load, so only no_load stops it
BEFORE_LOAD = [
    # run
    (["run", "--model", M, "--no-chat", ""], "redraft run: error: PROMPT is empty"),
    (["run", "--model", M, "   "], "redraft run: error: PROMPT is empty"),
    (["run", "--model", M, "--corpus", "{d}/bad.txt", "p"], "corpus refused: {d}/bad.txt:2: token 'x' is not an"),
    (["run", "--model", M, "--corpus", "{d}/random.bin", "p"], "corpus refused: {d}/random.bin:"),
    (["run", "--model", M, "--corpus", "{d}/truncated.bin", "p"], "{d}/truncated.bin: truncated binary corpus"),
    (["run", "--model", M, "--corpus", "{d}/damaged.bin", "p"], "the token stream section"),
    (["run", "--model", "{d}/nope", "p"], "--model {d}/nope: no such file or directory"),
    (["run", "--model", "{d}/afile", "p"], "{d}/afile: not a GGUF file"),
    (["run", "--model", M, "--draft", "glide", "--draft-model", "{d}/nope", "p"],
     "--draft-model {d}/nope: not a GliDe draft checkpoint (no such directory"),
    (["run", "--model", M, "--draft", "glide", "--draft-model", "{d}/emptydir", "p"], "(no glide.json in it"),
    # freeze
    (["freeze", "--model", M, "--prompts", "{d}/empty_prompts.txt", "--out", "{d}/c.txt"], "has no prompts"),
    (["freeze", "--model", M, "--prompts", "{d}/broken.jsonl", "--out", "{d}/c.txt"], "{d}/broken.jsonl:2: invalid JSON"),
    (["freeze", "--model", M, "--prompts", "{d}/blank.jsonl", "--out", "{d}/c.txt"], "{d}/blank.jsonl:1: the prompt is empty"),
    (["freeze", "--model", M, "--prompts", "{d}/missing.txt", "--out", "{d}/c.txt"], "cannot read prompts"),
    (["freeze", "--model", M, "--prompts", "{d}/broken.jsonl", "--out", "{d}/bad.txt"], "invalid JSON"),
    (["freeze", "--model", M, "--prompts", "{d}/blank.jsonl", "--out", "{d}/bad.txt"], "the prompt is empty"),
    (["freeze", "--model", M, "--prompts", "{d}/bad.txt", "--out", "{d}/bad.txt"], "refusing to extend {d}/bad.txt"),
    (["freeze", "--model", M, "--prompts", "{d}/bad.txt", "--out", "{d}/damaged.bin"], "fails its checksum"),
    # demo, oracle
    (["demo", "--model", M, "--questions", "475", "--other", "10"], "questions 0..484 asked, but only 480"),
    (["demo", "--model", "{d}/nope"], "--model {d}/nope: no such file"),
    (["oracle", "--model", M, "--questions", "10000"], "redraft oracle: error: questions 0..9999 asked"),
    (["oracle", "--model", M, "--offset", "470", "--questions", "20"], "questions 470..489 asked"),
    # glide
    (["glide", "train", "--out", "{d}/emptydir", "--resume"], "--resume: no checkpoint to resume in {d}/emptydir"),
    (["glide", "train", "--out", "{d}/afile"], "--out {d}/afile is not a directory"),
    (["glide", "eval", "--draft-model", "{d}/emptydir"], "not a GliDe draft checkpoint (no glide.json"),
    # bench
    (["bench", "run", "--model", M, "--workloads", "nope"], "redraft bench run: error:"),
    (["bench", "run", "--model", M, "--methods", "plain,nope"], "redraft bench run: error:"),
    (["bench", "run", "--model", "{d}/nope"], "--model {d}/nope: no such file"),
    (["bench", "cost", "--model", "{d}/nope"], "--model {d}/nope: no such file"),
]


@pytest.mark.parametrize("argv,msg", BEFORE_LOAD)
def test_refused_before_the_model_loads(tiny_model_dir, bad, no_load, capsys, argv, msg):
    fill = {"model": str(tiny_model_dir[0]), "d": str(bad)}
    rc, line = refusal(capsys, [a.format(**fill) for a in argv])
    assert msg.format(**fill) in line, line
    assert not (bad / "c.txt").exists()  # nothing written


def test_empty_prompt_on_stdin_is_refused(tiny_model_dir, no_load, capsys, monkeypatch):
    for text in ("", "  \n"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        _, line = refusal(capsys, ["run", "--model", tiny_model_dir[0], "-"])
        assert line == "redraft run: error: PROMPT is empty"


# ---- refused by the parser: exit 2, the flag named ------------------------------------------------------------------

PARSER = [
    (["run", "--temperature", "-1", "p"], "argument --temperature: -1 must be >= 0"),
    (["run", "--temperature", "nan", "p"], "argument --temperature: nan is not a finite number"),
    (["run", "--top-p", "0", "p"], "argument --top-p: 0 is outside (0, 1]"),
    (["run", "--top-p", "2", "p"], "argument --top-p: 2 is outside (0, 1]"),
    (["run", "--top-k", "-1", "p"], "argument --top-k: -1 must be at least 0"),
    (["run", "--repetition-penalty", "0", "p"], "argument --repetition-penalty: 0 must be > 0"),
    (["run", "--k", "0", "p"], "argument --k: 0 is outside 1..48"),
    (["run", "--k", "49", "p"], "argument --k: 49 is outside 1..48"),
    (["run", "--k-max", "0", "p"], "argument --k-max: 0 is outside 1..48"),
    (["run", "--stop", "", "p"], "argument --stop: a stop string cannot be empty"),
    (["run", "--ngen", "0", "p"], "argument --ngen: 0 must be at least 1"),
    (["freeze", "--prompts", "p.txt", "--out", "{d}/no/c.txt"], "argument --out: {d}/no/c.txt: directory"),
    (["freeze", "--prompts", "p.txt", "--out", "{d}"], "argument --out: {d} is a directory"),
    (["demo", "--k", "0"], "argument --k: 0 is outside 1..48"),
    (["demo", "--json", "{d}/no/x.json"], "argument --json"),
    (["oracle", "--top-p", "2"], "argument --top-p: 2 is outside (0, 1]"),
    (["oracle", "--offset", "-1"], "argument --offset: -1 must be at least 0"),
    (["oracle", "--k", "0,8"], "argument --k: '0,8': draft depths must be in 1..48"),
    (["oracle", "--json", "{d}"], "argument --json: {d} is a directory"),
    (["glide", "train", "--out", "o", "--max-steps", "0"], "argument --max-steps: 0 must be at least 1"),
    (["glide", "eval", "--draft-model", "g", "--json", "{d}/no/x.json"], "argument --json"),
    (["bench", "run", "--out", "{d}/afile"], "argument --out: {d}/afile exists and is not a directory"),
    (["bench", "run", "--out", "{d}/afile/sub"], "argument --out: {d}/afile/sub: {d}/afile is not a directory"),
    (["bench", "run", "--json", "{d}/no/r.json"], "argument --json"),
    (["bench", "run", "--k", "0"], "argument --k: 0 is outside 1..48"),
    (["bench", "run", "--k", "1000"], "argument --k: 1000 is outside 1..48"),
    (["bench", "cost", "--out", "{d}/afile"], "argument --out: {d}/afile exists and is not a directory"),
    (["bench", "cost", "--max-s", "0"], "argument --max-s: 0 must be at least 1"),
    (["bench", "corpus", "--lookups", "0", "--sizes", "1e3"], "argument --lookups: 0 must be at least 1"),
    (["bench", "corpus", "--workdir", "{d}/nodir"], "argument --workdir: directory {d}/nodir does not exist"),
    (["bench", "corpus", "-k", "0"], "argument -k: 0 is outside 1..48"),
    (["bench", "corpus", "--sizes", "10"], "each size must be at least 100 tokens"),
    (["bench", "corpus", "--json", "{d}/no/x.json"], "argument --json"),
    (["corpus"], "the following arguments are required: COMMAND"),
    (["corpus", "build", "--out", "{d}/no/c.rdc", "in.txt"], "argument --out/-o: {d}/no/c.rdc: directory"),
    (["corpus", "convert", "in.txt", "--out", "o.txt", "--to", "csv"], "argument --to: invalid choice: 'csv'"),
    (["corpus", "stats", "c.rdc", "--top", "-1"], "argument --top: -1 must be at least 0"),
    (["corpus", "verify", "c.rdc", "--vocab-size", "0"], "argument --vocab-size: 0 must be at least 1"),
]


@pytest.mark.parametrize("argv,line", [
    (["run", "--bogus", "p"], "redraft run: error: unrecognized arguments: --bogus (see redraft run --help)"),
    (["corpus", "stats", "c.rdc", "--bogus", "x"],
     "redraft corpus stats: error: unrecognized arguments: --bogus x (see redraft corpus stats --help)"),
    (["bench", "run", "--bogus"], "redraft bench run: error: unrecognized arguments: --bogus (see redraft bench run --help)"),
    (["--bogus", "run", "p"], "redraft: error: unrecognized arguments: --bogus (see redraft --help)"),
])
def test_an_unknown_option_names_the_command_that_refused_it(no_load, capsys, argv, line):
    """A sub-command's unknown option is that sub-command's error, pointing at its own --help (where its options
    are listed); one before the sub-command is still the top-level parser's."""
    assert refusal(capsys, argv) == (2, line)


@pytest.mark.parametrize("argv,msg", PARSER)
def test_refused_by_the_parser(tmp_path, no_load, capsys, argv, msg):
    (tmp_path / "afile").write_text("x")
    rc, line = refusal(capsys, [a.format(d=tmp_path) for a in argv])
    assert rc == 2 and msg.format(d=tmp_path) in line, line


# ---- corpus tools: exit 2, one line naming the file -----------------------------------------------------------------

@pytest.mark.parametrize("argv,msg", [
    (["build", "{d}/missing.txt", "--out", "{d}/o.rdc"], "{d}/missing.txt: cannot read"),
    (["build", "{d}/bad.txt", "--out", "{d}/o.rdc"], "{d}/bad.txt:2: token 'x' is not an integer"),
    (["build", "{d}/good.bin", "--out", "{d}/o.rdc", "--vocab-size", "10"], "is out of range (vocab size 10"),
    (["append", "{d}/bad.txt", "{d}/good.bin"], "{d}/bad.txt:2: token 'x'"),
    (["append", "{d}/good.bin", "{d}/damaged.bin"], "{d}/damaged.bin: damaged binary corpus"),
    (["merge", "{d}/good.bin", "{d}/truncated.bin", "--out", "{d}/o.rdc"], "{d}/truncated.bin: truncated"),
    (["stats", "{d}/random.bin"], "{d}/random.bin:"),
    (["convert", "{d}/damaged.bin", "--out", "{d}/o.txt", "--to", "text"], "fails its checksum"),
    (["compact", "{d}/truncated.bin"], "{d}/truncated.bin: truncated"),
    (["verify", "{d}/damaged.bin"], "{d}/damaged.bin: damaged binary corpus"),
])
def test_corpus_tools_refuse_bad_files(bad, capsys, argv, msg):
    rc, line = refusal(capsys, ["corpus"] + [a.format(d=bad) for a in argv])
    assert rc == 2 and line.startswith("redraft corpus: error: ") and msg.format(d=bad) in line, line
    assert not (bad / "o.rdc").exists() and not (bad / "o.txt").exists()


def test_corpus_build_reads_stdin_and_pipes_once(tmp_path, capsys, monkeypatch):
    """`cat ids.txt | redraft corpus build --out c.bin /dev/stdin` used to build 0 tokens: the kind was detected
    from the pipe's head, which the second read then missed. '-' and pipes are read once."""
    import redraft

    text = " ".join(map(str, range(1, 3000))) + "\n-1\n7 8 9\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["corpus", "build", "-q", "--out", str(tmp_path / "a.rdc"), "-"]) == 0
    # the reported command itself: a real pipe on stdin, named /dev/stdin
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(redraft.__file__)))
    proc = subprocess.run([sys.executable, "-m", "redraft", "corpus", "build", "-q", "--out", str(tmp_path / "b.rdc"),
                           "/dev/stdin"], input=text, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    want = [list(range(1, 3000)), [7, 8, 9]]
    for name in ("a.rdc", "b.rdc"):
        assert [s.tolist() for s in load_corpus(tmp_path / name).span_list()] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"1 2 x\n")))
    capsys.readouterr()
    _, line = refusal(capsys, ["corpus", "build", "--out", tmp_path / "c.rdc", "-"])
    assert line.startswith("redraft corpus: error: stdin:1: token 'x'"), line  # named as given, not the copy


def test_corpus_library_refuses_a_device_or_pipe():
    """read_spans reads a file twice (kind, then content): a device or pipe is refused, not read as empty."""
    from redraft.corpus import CorpusError
    from redraft.corpus.sources import read_spans

    with pytest.raises(CorpusError, match="/dev/null: not a regular file"):
        read_spans("/dev/null")


# ---- refused after the model loads (they need its tokenizer or vocabulary): still one line --------------------------

def test_prompt_longer_than_the_context(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    long = [5] * model.config.max_position_embeddings
    _, line = refusal(capsys, ["run", "--model", d, "--no-chat", words(long)])
    assert line == "redraft run: error: PROMPT is 128 tokens; the model's context holds 128, prompt and answer together"
    (tmp_path / "p.txt").write_text(words(PROMPT) + "\n" + words(long) + "\n")
    _, line = refusal(capsys, ["freeze", "--model", d, "--no-chat", "--prompts", tmp_path / "p.txt",
                               "--out", tmp_path / "c.txt"])
    assert f"{tmp_path / 'p.txt'}: prompt 2 is 128 tokens" in line
    assert not (tmp_path / "c.txt").exists()  # refused before the first prompt was answered


def test_corpus_ids_beyond_the_vocabulary(tiny_model_dir, bad, capsys):
    """A binary corpus that passes every checksum but holds ids the model does not have (max_id in its header) is
    refused like a text one, by run and by freeze."""
    d, _ = tiny_model_dir
    _, line = refusal(capsys, ["run", "--model", d, "--no-chat", "--corpus", bad / "beyond.bin", words(PROMPT)])
    assert f"corpus refused: {bad / 'beyond.bin'}: id {TOK_VOCAB + 5} is out of range (vocab size {TOK_VOCAB}" in line
    (bad / "p.txt").write_text(words(PROMPT) + "\n")
    _, line = refusal(capsys, ["freeze", "--model", d, "--no-chat", "--prompts", bad / "p.txt",
                               "--out", bad / "beyond.bin"])
    assert f"refusing to extend {bad / 'beyond.bin'}: {bad / 'beyond.bin'}: id {TOK_VOCAB + 5}" in line


def test_non_finite_logits_are_one_line(tiny_model_dir, capsys, monkeypatch):
    from redraft.decoding.engine import Engine
    from redraft.decoding.sampling import NonFiniteLogitsError

    def overflow(self, *args, **kwargs):
        raise NonFiniteLogitsError("the target model returned NaN logits for the token at position 9")

    monkeypatch.setattr(Engine, "generate", overflow)
    rc, line = refusal(capsys, ["run", "--model", tiny_model_dir[0], "--no-chat", words(PROMPT)])
    assert rc == 1 and line == "redraft: error: the target model returned NaN logits for the token at position 9"


def test_a_file_error_while_writing_is_one_line(bad, capsys, monkeypatch):
    """Output paths are checked by the parser; a write that still fails (full disk, permissions) names the file in
    one line instead of a traceback."""
    import redraft.cli.corpus as corpus_cli

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(bad / "out.json"))

    monkeypatch.setattr(corpus_cli, "corpus_stats", full)
    rc, line = refusal(capsys, ["corpus", "stats", bad / "good.bin"])
    assert rc == 1 and line == f"redraft: error: {bad / 'out.json'}: No space left on device"


# ---- --force, --k-max and --stop end to end -------------------------------------------------------------------------

def test_force_uses_a_corpus_of_another_tokenizer(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 20, eos=[EOS])
    path = tmp_path / "other.bin"
    Corpus.from_spans([PROMPT + want], vocab_size=TOK_VOCAB, fingerprint="sha256:another-tokenizer").save(path)
    argv = ["run", "--model", str(d), "--no-chat", "--ngen", "20", "--tokens", "--corpus", str(path), words(PROMPT)]
    _, line = refusal(capsys, argv)
    assert "tokenizer fingerprint mismatch" in line and "sha256:another-tokenizer" in line
    rc, _, err = run_cli(capsys, *argv[:1], "--force", *argv[1:])
    rep = parse_report(err)
    assert rc == 0 and [int(x) for x in rep["tokens"][1].split()] == want
    assert int(rep["corpus"][1]) > 0  # the corpus drafted and was accepted


def test_k_max_deepens_accepted_drafts(tiny_model_dir, capsys, tmp_path):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 40, eos=[EOS])
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(map(str, PROMPT + want)) + "\n")
    forwards = {}
    for flags in ((), ("--k-max", "16")):
        rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "40", "--tokens", "--no-ngram",
                             "--corpus", str(corpus), "--k", "2", *flags, words(PROMPT))
        rep = parse_report(err)
        assert rc == 0 and [int(x) for x in rep["tokens"][1].split()] == want
        forwards[flags] = int(rep["spec"][1])
    assert forwards[("--k-max", "16")] < forwards[()]  # 2, 4, 8, 16-token drafts instead of 2-token ones


def test_stop_string_ends_the_output_before_it(tiny_model_dir, capsys):
    d, model = tiny_model_dir
    want = plain_greedy(model, PROMPT, 20, eos=[EOS])
    j = next(i for i in range(3, len(want)) if want[i] not in want[:i])  # a first occurrence past the start
    rc, out, _ = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "20", "--stop", words([want[j]]),
                         words(PROMPT))
    assert rc == 0 and out.split() == words(want[:j]).split()


# ---- freeze into a binary corpus is atomic ---------------------------------------------------------------------------

def test_freeze_into_a_binary_corpus_failing_midway_keeps_it(tiny_model_dir, capsys, tmp_path, monkeypatch):
    from atomickit import fail_corpus_writes, leftovers

    d, _ = tiny_model_dir
    path = tmp_path / "c.rdc"
    Corpus.from_spans([PROMPT], vocab_size=TOK_VOCAB).save(path)
    before = path.read_bytes()
    (tmp_path / "p.txt").write_text(words(PROMPT) + "\n")
    fail_corpus_writes(monkeypatch)
    _, line = refusal(capsys, ["freeze", "--model", d, "--no-chat", "--ngen", "8", "--prompts", tmp_path / "p.txt",
                               "--out", path])
    assert "cannot write corpus" in line
    assert path.read_bytes() == before and leftovers(tmp_path) == []


# ---- before torch is imported ----------------------------------------------------------------------------------------

def test_refusals_need_no_torch(tiny_model_dir, tmp_path):
    """The refusals that need no model come in milliseconds: in a fresh process none of them imports torch."""
    (tmp_path / "bad.txt").write_text("1 x\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "emptydir").mkdir()
    m, t = str(tiny_model_dir[0]), str(tmp_path)
    cases = [["run", "--model", m, "--no-chat", ""], ["run", "--model", f"{t}/nope", "p"],
             ["run", "--model", m, "--corpus", f"{t}/bad.txt", "p"],
             ["run", "--model", m, "--draft", "glide", "--draft-model", f"{t}/nope", "p"],
             ["run", "--temperature", "-1", "p"],
             ["freeze", "--model", m, "--prompts", f"{t}/empty.txt", "--out", f"{t}/c.txt"],
             ["freeze", "--model", m, "--prompts", f"{t}/bad.txt", "--out", f"{t}/bad.txt"],
             ["oracle", "--model", m, "--questions", "10000"], ["demo", "--model", m, "--questions", "1000"],
             ["glide", "train", "--out", f"{t}/emptydir", "--resume"], ["bench", "run", "--out", f"{t}/afile"],
             ["bench", "run", "--model", f"{t}/nope"]]
    probe = ("import json, sys\nimport redraft.cli.common as common\nfrom redraft.cli import main\n"
             "common.load_target = lambda *a, **k: sys.exit('the model was loaded')\nout = []\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    try:\n        rc = main(argv)\n    except SystemExit as e:\n        rc = e.code\n"
             "    out.append([argv, rc, 'torch' in sys.modules])\nprint(json.dumps(out))\n")
    import redraft

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(redraft.__file__)))
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for argv, rc, torch_loaded in results:
        assert rc not in (0, None), argv
        assert not torch_loaded, f"{argv} imported torch before refusing"
    assert "Traceback" not in proc.stderr


# ---- help text -------------------------------------------------------------------------------------------------------

def _subparsers(parser, path=("redraft",)):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, path + (name,))


def test_every_argument_has_help_and_no_internal_references(capsys):
    """Each positional and option says what it is; help and descriptions carry no issue numbers or Sphinx roles;
    --threads is documented once, on `redraft` itself."""
    import argparse

    from redraft.cli import build_parser

    for path, parser in _subparsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if action.dest == "threads" and len(path) > 1:
                assert action.help == argparse.SUPPRESS, path  # accepted after the sub-command, not repeated
                continue
            assert action.help and action.help != argparse.SUPPRESS, (" ".join(path), action.option_strings
                                                                      or action.dest)
        text = parser.format_help()
        assert not re.search(r"\bissues?\b", text, re.IGNORECASE), " ".join(path)  # product text, not the tracker
        assert ":func:" not in text and ":mod:" not in text, " ".join(path)
    usage = {" ".join(path): parser.format_help() for path, parser in _subparsers(build_parser())}
    assert [name for name, text in usage.items() if "--threads" in text] == ["redraft"]
    assert "greedy reply" not in usage["redraft run"]
