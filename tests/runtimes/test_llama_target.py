"""The llama.cpp target (redraft.runtimes.llamacpp.target): the bundled GGUF run by llama.cpp as it is quantized.

Every draft path on it is checked against llama.cpp's own plain greedy decoding (llama-cpp-python's ``Llama.generate``
with top_k 1, the same context length and threads), token for token. Skipped where the ``llama`` extra is not
installed (``make llama``); the bad-input tests that need no llama.cpp run everywhere.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from llamakit import SKIP_REASON, has_llama, needs_llama

from redraft.compose import SpeculationConfig, build_engine, build_policy, load_target, plain_engine
from redraft.compose.runtime import torch_threads
from redraft.io.loading import ModelLoadError, default_model_path

N_CTX, THREADS = 2048, 1
PROMPTS = ["The capital of France is", "Write a Python function that reverses a string.",
           "List three primary colors and explain why they are called primary."]


@pytest.fixture(scope="module")
def loaded():
    if not has_llama():
        pytest.skip(SKIP_REASON)
    return load_target(None, runtime="llama.cpp", n_ctx=N_CTX, threads=THREADS, quiet=True)


@pytest.fixture(scope="module")
def prompts(loaded):
    from redraft.io.prompts import encode_prompt

    return [encode_prompt(loaded.tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(loaded, prompts):
    """llama.cpp's own greedy ids for each prompt (48 tokens, stopping at an EOS id)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(default_model_path()), n_ctx=N_CTX, n_threads=THREADS, verbose=False, seed=0)
    eos = set(loaded.eos_token_ids)
    out = []
    for ids in prompts:
        got: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            got.append(int(tok))
            if tok in eos or len(got) >= 48:
                break
        out.append(got)
    llm.close()
    return out


@needs_llama
def test_plain_decoding_is_llama_cpps_own_greedy_decoding(loaded, prompts, reference):
    engine = plain_engine(loaded.model, eos_token_ids=sorted(loaded.eos_token_ids))
    for ids, ref in zip(prompts, reference, strict=True):
        res = engine.generate(ids, 48)
        assert res.output_ids == ref
        assert res.forwards == len(ref)  # the prompt's forward chose the first token


@needs_llama
def test_every_draft_path_matches_llama_cpps_greedy_ids(loaded, prompts, reference):
    """Replays from a corpus of the answers (deep chains), the policy, n-gram drafts on novel prompts, fixed-depth
    chains: each equals llama.cpp's own greedy output; replays take far fewer forwards (on a batch-invariant build;
    one with llamafile's sgemm, whose verify rows move, settles its many near ties with draft-free forwards)."""
    from redraft.corpus import Corpus, tokenizer_fingerprint

    target, eos = loaded.model, sorted(loaded.eos_token_ids)
    corpus = Corpus.from_spans([p + r for p, r in zip(prompts, reference, strict=True)],
                               vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer))
    engines = {
        "policy+corpus": build_engine(target, SpeculationConfig(), eos_token_ids=eos, corpus=corpus,
                                      policy=build_policy(target)),
        "corpus K=8": build_engine(target, SpeculationConfig(k=8, policy=False, ngram=False), eos_token_ids=eos,
                                   corpus=corpus),
        "ngram K=4": build_engine(target, SpeculationConfig(k=4, policy=False), eos_token_ids=eos),
    }
    for name, engine in engines.items():
        for ids, ref in zip(prompts, reference, strict=True):
            res = engine.generate(ids, 48)
            assert res.output_ids == ref, name
            if name == "corpus K=8" and target.invariant:  # a build whose batch rows move settles near ties
                assert res.forwards <= len(ref) // 4, (name, res.forwards)


@needs_llama
def test_verify_rows_equal_plain_rows_on_a_batch_invariant_build(loaded, prompts):
    """The load-time probe's verdict holds on a real sequence: 12 rows in one batch against 12 single forwards."""
    import torch

    target = loaded.model
    ids = prompts[0]
    tail = [int(t) for t in plain_engine(target).generate(ids, 13).output_ids]
    target.reset()
    target.forward(ids)
    batch = target.forward(tail[:12], n_logits=12)
    target.crop(len(ids))
    single = torch.cat([target.forward([t]) for t in tail[:12]])
    target.reset()
    assert torch.equal(batch, single) == target.invariant
    assert target.numerics == ("llama.cpp batch-invariant" if target.invariant else "llama.cpp")


@needs_llama
def test_borrowed_logits_are_the_copys_values_in_llama_cpps_own_buffer(loaded, prompts):
    """forward(borrow=True) returns llama.cpp's output buffer itself (no copy), with the values a copy holds, and
    a forward longer than one batch still gets a copy of its own."""
    target = loaded.model
    ids = prompts[1]
    target.reset()
    copied = target.forward(ids, n_logits=4)
    target.reset()
    lent = target.forward(ids, n_logits=4, borrow=True)
    assert torch.equal(lent, copied)
    assert lent.data_ptr() == ctypes.addressof(target._lib.llama_get_logits(target._ctx).contents)
    kept = lent.clone()
    target.forward([ids[0]])  # the next decode writes over the lent rows
    assert not torch.equal(lent[0], kept[0]) and torch.equal(kept, copied)
    target.reset()
    long = [ids[i % len(ids)] for i in range(target.n_batch + 5)]
    lent = target.forward(long, n_logits=3, borrow=True)  # two decodes: copied, as without borrow
    assert lent.data_ptr() != ctypes.addressof(target._lib.llama_get_logits(target._ctx).contents)
    target.reset()


@needs_llama
def test_exact_mode_with_the_noisy_builds_threshold_still_matches(loaded, prompts, reference, monkeypatch):
    """Judged as a build whose batch rows move (llamafile's sgemm), exact mode settles near-ties and the ids stay
    llama.cpp's."""
    from redraft.corpus import Corpus, tokenizer_fingerprint

    target = loaded.model
    monkeypatch.setattr(target, "numerics", "llama.cpp")
    corpus = Corpus.from_spans([p + r for p, r in zip(prompts, reference, strict=True)],
                               vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer))
    engine = build_engine(target, SpeculationConfig(k=8, policy=False, ngram=False),
                          eos_token_ids=sorted(loaded.eos_token_ids), corpus=corpus)
    near = 0
    for ids, ref in zip(prompts, reference, strict=True):
        res = engine.generate(ids, 48)
        assert res.output_ids == ref
        near += res.near_ties
    assert near > 0  # the small model's rows are close: a threshold of about a logit catches some


@needs_llama
def test_prefix_reuse_keeps_the_cache_and_the_ids(loaded, prompts, reference):
    target = loaded.model
    engine = plain_engine(target, eos_token_ids=sorted(loaded.eos_token_ids))
    ids = prompts[1]
    first = engine.generate(ids, 48)
    prefix = target.snapshot(ids[:-3])
    assert prefix.length == len(ids) - 3
    again = engine.generate(ids, 48, prefix=prefix)
    assert again.output_ids == first.output_ids == reference[1]
    assert again.prefix_hit_tokens == len(ids) - 3
    with pytest.raises(ValueError, match="not the first"):
        target.snapshot([ids[0] + 1])


@needs_llama
def test_target_refuses_what_it_cannot_do(loaded):
    import torch

    target = loaded.model
    target.reset()
    with pytest.raises(NotImplementedError, match="chains only"):
        target.forward([1, 2], positions=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="n_logits"):
        target.forward([1, 2], n_logits=3)
    with pytest.raises(NotImplementedError, match="transformers runtime"):
        target.verified_kv([0], 1)
    target.forward([1, 2, 3])
    with pytest.raises(ValueError, match="contiguous"):
        target.keep(1, [2])
    target.reset()


def test_llama_runtime_bad_input_names_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="runtime 'vllm'"):
        load_target(None, runtime="vllm")
    with pytest.raises(ModelLoadError, match="--dtype float16"):
        load_target(None, runtime="llama.cpp", dtype="float16")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="runs a .gguf file"):
        load_target(str(tmp_path), runtime="llama.cpp")
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_target(str(bogus), runtime="llama.cpp")


@needs_llama
def test_a_truncated_gguf_is_refused_by_llama_cpp(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="cannot load .*not a complete GGUF file: truncated") as e:
        load_target(str(cut), runtime="llama.cpp")
    assert "make llama" not in str(e.value)  # the file's fault, not the build's


def test_missing_extra_says_how_to_install_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llama(name, *a, **kw):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(ModelLoadError, match="make llama"):
        load_target(None, runtime="llama.cpp")


@needs_llama
def test_loading_on_llama_cpp_leaves_torch_one_thread(loaded):
    # torch's spinning OpenMP workers would take cores from llama.cpp's threads between forwards
    assert torch.get_num_threads() == 1
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_torch_threads_restores_the_count_and_refuses_zero():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("the block failed")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="n=0"), torch_threads(0):
        pass
