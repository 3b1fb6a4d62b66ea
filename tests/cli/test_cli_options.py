"""Command line (issue 17): the model's generation_config through ``redraft run`` (the start-up line, flag
overrides, ``--no-generation-config``), and options that would have no effect are refused or warned about in one
line, before the model loads."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import hf_greedy
from test_cli import EOS, clean_env, parse_report, run_cli, words  # noqa: F401 (clean_env: the autouse fixture)

from redraft.cli import main

PROMPT = [5, 6, 7, 5, 6, 7, 9, 10]
NGEN = 30
SETTINGS = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}
LINE_RE = re.compile(r"^redraft: generation_config: (.*) \(from (.*); --no-generation-config to ignore\)(.*)$")
NOWHERE = "/nonexistent/model-dir"  # a model that cannot load: a refusal that names the flag came before loading


@pytest.fixture(scope="module")
def configured_dir(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model directory whose generation_config.json adds SETTINGS and sampling settings."""
    src, _ = tiny_model_dir
    d = tmp_path_factory.mktemp("configured") / "model"
    shutil.copytree(src, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc.update(SETTINGS, do_sample=True, temperature=0.6)
    (d / "generation_config.json").write_text(json.dumps(gc))
    return d


def hf_reference(model, **settings) -> list[int]:
    """HF generate(do_sample=False) on the tiny model with these generation_config settings."""
    saved = {k: getattr(model.generation_config, k) for k in settings}
    for k, v in settings.items():
        setattr(model.generation_config, k, v)
    try:
        return hf_greedy(model, PROMPT, NGEN, EOS)
    finally:
        for k, v in saved.items():
            setattr(model.generation_config, k, v)


def run_ids(capsys, *argv) -> tuple[list[int], list[str]]:
    rc, _, err = run_cli(capsys, "run", "--no-chat", "--ngen", str(NGEN), "--tokens", *argv, words(PROMPT))
    assert rc == 0
    rep = parse_report(err)
    assert rep["prompt"][1] == " ".join(map(str, PROMPT))
    return [int(x) for x in rep["tokens"][1].split()], err


def test_run_applies_the_generation_config_and_says_so(configured_dir, tiny_model_dir, capsys):
    _, model = tiny_model_dir
    want = hf_reference(model, **SETTINGS)
    assert want != hf_reference(model)  # the settings change this output
    for drafts in ([], ["--corpus", str(configured_dir / "corpus.txt")]):
        (configured_dir / "corpus.txt").write_text(" ".join(map(str, PROMPT + hf_reference(model))) + "\n")
        got, err = run_ids(capsys, "--model", str(configured_dir), *drafts)
        assert got == want
        lines = [line for line in err if "generation_config" in line]
        assert len(lines) == 1, err
        m = LINE_RE.match(lines[0])
        assert m, lines[0]
        assert m.group(1) == "repetition_penalty=1.3, no_repeat_ngram_size=3"
        assert m.group(2) == str(configured_dir / "generation_config.json")
        assert m.group(3) == "; not applied: do_sample=True, temperature=0.6 (greedy unless --temperature > 0)"


def test_run_flags_override_the_generation_config(configured_dir, tiny_model_dir, capsys):
    _, model = tiny_model_dir
    got, err = run_ids(capsys, "--model", str(configured_dir), "--repetition-penalty", "1.0")
    assert got == hf_reference(model, no_repeat_ngram_size=3)
    line = next(line for line in err if "generation_config" in line)
    assert line.startswith("redraft: generation_config: no_repeat_ngram_size=3 (from ")
    assert "; replaced by flags: repetition_penalty (--repetition-penalty)" in line
    got, _ = run_ids(capsys, "--model", str(configured_dir), "--no-repeat-ngram-size", "2", "--min-new-tokens", "4")
    assert got == hf_reference(model, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4)


def test_no_generation_config_ignores_the_file(configured_dir, tiny_model_dir, capsys):
    _, model = tiny_model_dir
    got, err = run_ids(capsys, "--model", str(configured_dir), "--no-generation-config")
    assert got == hf_reference(model)
    assert not [line for line in err if line.startswith("redraft: generation_config")]


def test_a_model_without_settings_prints_no_line(tiny_model_dir, capsys):
    d, _ = tiny_model_dir
    _, err = run_ids(capsys, "--model", str(d))
    assert not [line for line in err if line.startswith("redraft: generation_config")]


def test_bad_generation_config_value_is_one_line(configured_dir, tmp_path, capsys):
    d = tmp_path / "bad"
    shutil.copytree(configured_dir, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc["no_repeat_ngram_size"] = -2
    (d / "generation_config.json").write_text(json.dumps(gc))
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(d), "--no-chat", "--ngen", "3", words(PROMPT)])
    msg = str(e.value.code)
    assert msg.startswith(f"redraft: error: {d / 'generation_config.json'}: generation_config.no_repeat_ngram_size "
                          "must be an integer >= 0") and "\n" not in msg


@pytest.mark.parametrize("argv,msg", [
    (["run", "--tree", "4"], "--tree: only used with a corpus"),
    (["run", "--k-max", "16"], "--k-max: only used with a corpus"),
    (["run", "--force"], "--force: only used with a corpus"),
    (["run", "--corpus", "c.txt", "--k", "8", "--k-max", "4"], "--k-max 4: no effect unless above the draft depth"),
    (["run", "--gamma", "3"], "--gamma: only used with --draft glide"),
    (["run", "--cape-bins", "0.3,0.6,0.8:7,5,3,1"], "--cape-bins: only used with --draft glide"),
    (["run", "--draft", "glide", "--draft-model", "m", "--cape-bins", "0.5:3,1"], "--cape-bins: only used with --cape"),
    (["run", "--draft", "glide"], "--draft glide needs --draft-model PATH"),
    (["run", "--corpus", "c.txt", "--tree-budget", "16"], "--tree-budget: only used with --tree B or --cape"),
    (["run", "--no-ngram", "--no-exact"], "--no-exact: no effect without a draft source"),
    (["run", "--no-ngram", "--k", "4"], "--k: no effect without a draft source"),
    (["run", "--no-ngram", "--no-policy"], "--no-policy: no effect without a draft source"),
    (["run", "--minacc", "30"], "--minacc 30: no effect without a corpus"),
    (["oracle", "--tree", "0", "--tree-budget", "8"], "--tree-budget: only used with --tree B > 0"),
    (["oracle", "--compare-exact", "--no-exact"], "--no-exact: no effect with --compare-exact"),
    (["bench", "run", "--methods", "plain,hf", "--tree-budget", "8"], "--tree-budget: only used by the method(s) tree"),
    (["bench", "run", "--methods", "plain,hf", "--tree-branches", "2"], "--tree-branches: only used by"),
    (["bench", "run", "--methods", "plain,corpus", "--pld-tokens", "5"], "--pld-tokens: only used by"),
    (["bench", "run", "--methods", "plain,ngram", "--gguf", "x.gguf"], "--gguf: only used by"),
    (["bench", "run", "--methods", "plain,hf", "--k", "4"], "--k: only used by"),
])
def test_options_without_effect_are_refused_before_loading(argv, msg):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--model", NOWHERE] + (["p"] if argv[0] == "run" else []))
    text = str(e.value.code)
    assert msg in text and "\n" not in text, text


def test_oracle_refuses_a_negative_tree(capsys):
    with pytest.raises(SystemExit) as e:
        main(["oracle", "--model", NOWHERE, "--tree", "-3"])
    assert e.value.code == 2 and "-3 must be at least 0" in capsys.readouterr().err


def test_freeze_from_log_refuses_generation_flags(tmp_path):
    for flags, name in ((["--ngen", "5"], "--ngen"), (["--model", NOWHERE], "--model"), (["--no-chat"], "--no-chat")):
        with pytest.raises(SystemExit) as e:
            main(["freeze", "--from-log", str(tmp_path / "log"), "--out", str(tmp_path / "c.txt"), *flags])
        assert f"{name}: only used with --prompts" in str(e.value.code)


def test_sampling_only_flags_warn_with_greedy(tiny_model_dir, capsys):
    d, model = tiny_model_dir
    got, err = run_ids(capsys, "--model", str(d), "--top-k", "5", "--seed", "3")
    assert got == hf_reference(model)  # greedy, as the warning says
    warnings = [line for line in err if line.startswith("redraft: warning:")]
    assert warnings == ["redraft: warning: --top-k, --seed only used when sampling; greedy decoding "
                        "(--temperature 0) ignores them"]
    _, err = run_ids(capsys, "--model", str(d), "--temperature", "0.8", "--top-k", "5", "--seed", "3")
    assert not [line for line in err if line.startswith("redraft: warning:")]


def test_tree_budget_never_cuts_a_single_chain(tiny_model_dir, tmp_path, capsys):
    """Without --tree or --cape the verify tree is one chain: --k 40 drafts 40 tokens, not the tree budget's 32."""
    d, model = tiny_model_dir
    want = hf_greedy(model, PROMPT, 41, EOS)
    assert len(want) == 41  # no EOS: 40 drafted + the bonus token make the whole answer
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(map(str, PROMPT + want)) + "\n")
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "41", "--tokens",
                         "--corpus", str(corpus), "--k", "40", words(PROMPT))
    rep = parse_report(err)
    assert rc == 0 and [int(x) for x in rep["tokens"][1].split()] == want
    assert rep["spec"][1:] == ("1", "41")  # one verify forward
