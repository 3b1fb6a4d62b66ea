"""The public Python API (:class:`redraft.Redraft`) and transformers' ``custom_generate`` hook (:mod:`redraft.hf`),
against plain greedy decoding of the same model: ids identical; the README's example runs as written (slow: the
default model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import load_default_model, plain_greedy, use_session_cache
from serverkit import EOS, save_tiny_model, words

from redraft import Redraft
from redraft.corpus import Corpus
from redraft.hf import custom_generate

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # cost curves in a temporary cache, never the user's
        mp.setenv("REDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
        d = save_tiny_model(tmp_path_factory.mktemp("api-model"))
        rd = Redraft.from_pretrained(str(d))
        yield d, rd.model, rd.tokenizer


def hf_plain(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)[0].tolist()


def test_generate_equals_plain_greedy_and_replays_from_its_corpus(tiny, tmp_path):
    d, model, tok = tiny
    want = plain_greedy(model, PROMPT, 40, eos=[EOS])
    path = tmp_path / "answers.corpus"
    rd = Redraft(model, tok, corpus=str(path), learn=True)  # an already loaded model and tokenizer
    first = rd.generate(PROMPT, 40)
    assert first.ids == want and first.text == tok.decode(want, skip_special_tokens=True)
    assert first.stats["tokens"] == len(want) and first.stats["forwards"] >= 1
    assert path.is_file()  # learned, written atomically
    again = Redraft.from_pretrained(model, tok, corpus=str(path)).generate(PROMPT, 40)  # a later run replays it
    assert again.ids == want and again.stats["forwards"] < first.stats["forwards"]
    assert again.stats["sources"]["corpus"]["accepted"] > 0 and 0 < again.stats["acceptance"] <= 1


def test_generate_a_list_of_prompts_in_order(tiny):
    d, model, tok = tiny
    rd = Redraft(model, tok)
    texts = [words([3, 4, 5, 6]), words([20, 21, 22])]
    outs = rd.generate(texts, 20, chat=False)
    assert [o.prompt for o in outs] == texts
    for o in outs:
        assert o.ids == plain_greedy(model, o.prompt_ids, 20, eos=[EOS])


def test_fixed_config_fields_and_bad_input(tiny, tmp_path):
    d, model, tok = tiny
    rd = Redraft(model, tok, corpus=Corpus.from_spans([PROMPT + plain_greedy(model, PROMPT, 30, eos=[EOS])]), k=4)
    assert not rd.config.policy_on and rd.policy is None
    out = rd.generate(PROMPT, 30)
    assert out.ids == plain_greedy(model, PROMPT, 30, eos=[EOS]) and max(out.result.accepted_per_forward) <= 4
    with pytest.raises(FileNotFoundError, match="no such file"):
        Redraft(model, tok, corpus=str(tmp_path / "missing.corpus"))
    with pytest.raises(ValueError, match="SpeculationConfig.k="):
        Redraft(model, tok, k=99)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        Redraft.from_pretrained(model)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rd.generate(PROMPT, 0)


# ---- transformers custom_generate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 17, 60])
def test_custom_generate_returns_what_generate_returns(tiny, n):
    d, model, tok = tiny
    spans = [PROMPT + plain_greedy(model, PROMPT, 60, eos=[EOS])]
    gen = custom_generate(corpus=Corpus.from_spans(spans))
    x = torch.tensor([PROMPT])
    got = model.generate(input_ids=x, attention_mask=torch.ones_like(x), custom_generate=gen, max_new_tokens=n)
    assert got.tolist()[0] == hf_plain(model, PROMPT, n)
    assert got.dtype == torch.long and got.shape[0] == 1


def test_custom_generate_honours_stopping_criteria_and_streamer(tiny):
    from transformers import StoppingCriteria, StoppingCriteriaList

    d, model, tok = tiny
    want = hf_plain(model, PROMPT, 40)[len(PROMPT):]

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= len(PROMPT) + 7, dtype=torch.bool)

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    gen = custom_generate(corpus=Corpus.from_spans([PROMPT + want]))
    x = torch.tensor([PROMPT])
    got = model.generate(input_ids=x, custom_generate=gen, max_new_tokens=40, streamer=streamer,
                         stopping_criteria=StoppingCriteriaList([AtLength()]))
    assert got[0].tolist() == PROMPT + want[:7]  # HF keeps the token that met the criterion
    assert streamer.puts[0] == PROMPT and sum(streamer.puts[1:], []) == want[:7] and streamer.ended


@pytest.mark.parametrize("kw,says", [(dict(do_sample=True), "do_sample=True"), (dict(num_beams=2), "num_beams=2"),
                                     (dict(return_dict_in_generate=True), "return_dict_in_generate")])
def test_custom_generate_refuses_what_it_cannot_reproduce(tiny, kw, says):
    d, model, tok = tiny
    x = torch.tensor([PROMPT])
    with pytest.raises(ValueError, match=says):
        model.generate(input_ids=x, custom_generate=custom_generate(), max_new_tokens=5, **kw)


def test_custom_generate_refuses_a_batch_and_a_logits_processor(tiny):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    d, model, tok = tiny
    x = torch.tensor([PROMPT, PROMPT])
    with pytest.raises(ValueError, match="batch of 1"):
        model.generate(input_ids=x, custom_generate=custom_generate(), max_new_tokens=5)
    with pytest.raises(ValueError, match="logits_processor"):
        model.generate(input_ids=x[:1], custom_generate=custom_generate(), max_new_tokens=5,
                       logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))


# ---- the README's example, as written -------------------------------------------------------------------------------

def readme_python_blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_has_the_python_example():
    blocks = readme_python_blocks()
    assert blocks and "Redraft.from_pretrained" in blocks[0] and any("custom_generate" in b for b in blocks)


@pytest.mark.slow  # the default model
def test_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    # The cache of the run, not the module's temporary one (``tiny`` points $REDRAFT_CACHE there while this module
    # runs): there the default model was converted and its cost curve measured once (else ~45 s more, every run).
    use_session_cache(monkeypatch)
    load_default_model(quiet=True)  # converted and priced under the lock (the README's own load then reads the cache)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in readme_python_blocks():
        exec(compile(block, str(README), "exec"), scope)  # its own asserts check ids against plain generate
    assert (tmp_path / "answers.corpus").is_file()


def test_prefix_dir_starts_a_new_object_from_the_prefix_on_disk(tiny, tmp_path):
    """``prefix_dir``: one object writes its prompt's KV entries; a new object (what a new process has) starts the
    next prompt under the same long prefix from disk, with plain greedy's ids."""
    import random

    d, model, tok = tiny
    rng = random.Random(8)
    system = [rng.randrange(2, 64) for _ in range(150)]
    first = Redraft(model, tok, prefix_dir=tmp_path / "p").generate(system + [5, 6, 7], 20)
    assert first.result.prefix_hit_tokens == 0
    prompt = system + [30, 31]
    out = Redraft(model, tok, prefix_dir=tmp_path / "p").generate(prompt, 20)
    assert out.ids == plain_greedy(model, prompt, 20, eos=[EOS])
    assert out.result.prefix_disk_tokens >= len(system)
