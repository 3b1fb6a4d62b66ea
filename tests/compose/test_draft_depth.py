"""One rule for a corpus draft depth: the CLI flags, the environment, SpeculationConfig and the vLLM proposer judge
a bad K with the same words (redraft.defaults.check_depth), each naming its own setting."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from redraft.cli.argtypes import draft_depth
from redraft.compose import SpeculationConfig
from redraft.compose.env import DepthError, EnvError, read_draft_env
from redraft.defaults import MAX_DRAFT_DEPTH
from redraft.integrations.vllm_proposer import ProposerConfigError, RedraftProposer

BAD = ["0", str(MAX_DRAFT_DEPTH + 1), "8.5", "x"]


def vllm_config(k):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=400, get_vocab_size=lambda: 500, tokenizer=None,
                                     hf_config=SimpleNamespace(eos_token_id=2)))


def python_value(text):
    """What a Python caller would pass for the variable's text: an int where it is one, else the text."""
    try:
        return int(text)
    except ValueError:
        return text


def rule(message, name):
    """The message without its ``NAME=`` prefix: the part every path must word the same way."""
    assert message.startswith(f"{name}="), message
    return message[len(name) + 1:]


@pytest.mark.parametrize("text", BAD)
@pytest.mark.parametrize("var,field", [("REDRAFT_CORPUS_K", "k"), ("REDRAFT_CORPUS_K_MAX", "k_max")])
def test_same_bad_depth_same_words_everywhere(text, var, field):
    with pytest.raises(ProposerConfigError) as proposer:
        RedraftProposer(vllm_config(MAX_DRAFT_DEPTH), environ={var: text})
    with pytest.raises(DepthError) as config:
        SpeculationConfig(**{field: python_value(text)})
    with pytest.raises(argparse.ArgumentTypeError) as flag:
        draft_depth(text)
    want = rule(str(proposer.value), var)
    assert rule(str(config.value), f"SpeculationConfig.{field}") == want
    assert str(flag.value) == want  # argparse adds "argument --k: "
    assert "1..48" in want and "draft depth" in want


@pytest.mark.parametrize("text", BAD)
def test_the_environment_path_words_it_the_same(text, capsys):
    """The CLI's environment keeps Colibri's rule (an out-of-range K is clamped with a warning, it cannot be refused
    at parse time); the warning and the error for a non-integer carry the same words as the other paths."""
    with pytest.raises(ProposerConfigError) as proposer:
        RedraftProposer(vllm_config(MAX_DRAFT_DEPTH), environ={"COLI_CORPUS_K": text})
    want = rule(str(proposer.value), "COLI_CORPUS_K")
    if isinstance(python_value(text), int):
        k = read_draft_env({"COLI_CORPUS_K": text}).k
        assert k == max(1, min(int(text), MAX_DRAFT_DEPTH))
        assert capsys.readouterr().err == f"redraft: warning: COLI_CORPUS_K={want}; using {k}\n"
    else:
        with pytest.raises(EnvError) as env:
            read_draft_env({"COLI_CORPUS_K": text})
        assert rule(str(env.value), "COLI_CORPUS_K") == want


def test_a_proposer_range_names_num_speculative_tokens():
    with pytest.raises(ProposerConfigError, match=r"REDRAFT_CORPUS_K_MAX=9 is outside 1\.\.8 \(a draft depth in "
                                                  r"tokens, at most num_speculative_tokens=8\)"):
        RedraftProposer(vllm_config(8), environ={"REDRAFT_CORPUS_K_MAX": "9"})


@pytest.mark.parametrize("env", [{"REDRAFT_CORPUS_K_MAX": "8"}, {"REDRAFT_CORPUS_K": "6", "REDRAFT_CORPUS_K_MAX": "6"}])
def test_a_proposer_depth_cap_must_be_above_the_depth(env):
    """As the CLI refuses --k-max not above --k: without REDRAFT_CORPUS_K the depth starts at 8, as on the CLI."""
    with pytest.raises(ProposerConfigError, match="no effect unless above the corpus draft depth"):
        RedraftProposer(vllm_config(16), environ=env)


def test_a_proposer_depth_cap_is_a_fixed_setting():
    s = RedraftProposer(vllm_config(32), environ={"REDRAFT_CORPUS_K_MAX": "24"}).settings
    assert (s.policy, s.corpus_k, s.corpus_k_max) == (False, 8, 24)
