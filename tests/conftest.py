"""Shared fixtures for the engine tests: tiny random-weight target models, reference decoders, test drafters.

The tiny models are built from configs (no hub, no files) once per session, in eval mode and fp32. Their LM heads
are initialised with a large standard deviation so logits spread over several units: argmax near-ties, where the
~1e-6 difference between a verify forward and a single-token forward could flip the greedy choice, become rare.
``test_engine.py::test_tiny_models_have_clear_greedy_margins`` checks that the margins really are large.

Helpers here are plain functions and classes (``from conftest import ...``) so that hypothesis-driven tests can
call them without function-scoped fixtures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from redraft.decoding.engine import Engine
from redraft.runtimes.transformers.target import HFTarget
from redraft.tree import TokenTree

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine torch's thread pool spinning
# against other processes made them 10-20x slower. One thread for the whole test session.
torch.set_num_threads(1)

# CI (.ci/run) always installs the default model's package, so there a skipped real-model test means the suite
# silently proved less than it claims: with this variable set to 1, a skip of any `slow` test is reported as a failure.
# Tests marked `llama` need the optional llama extra, which CI does not build (a ~5 minute compile); their skips
# count as failures only with REDRAFT_REQUIRE_LLAMA=1 (set it where `make llama` ran). Tests marked `browser` drive
# Debian's Chromium (/usr/bin/chromium); .ci/run installs it and sets REDRAFT_REQUIRE_BROWSER=1, so there their skips
# are failures too.
REQUIRE_REAL_MODEL = "REDRAFT_REQUIRE_REAL_MODEL"
REQUIRE_LLAMA = "REDRAFT_REQUIRE_LLAMA"
REQUIRE_BROWSER = "REDRAFT_REQUIRE_BROWSER"


def _skip_is_a_failure(item) -> bool:
    if item.get_closest_marker("llama") is not None:
        return os.environ.get(REQUIRE_LLAMA) == "1"
    if item.get_closest_marker("browser") is not None:
        return os.environ.get(REQUIRE_BROWSER) == "1"
    return item.get_closest_marker("slow") is not None and os.environ.get(REQUIRE_REAL_MODEL) == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and _skip_is_a_failure(item):
        why = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = (f"this test was skipped where it is required ({REQUIRE_REAL_MODEL} / {REQUIRE_LLAMA} / "
                        f"{REQUIRE_BROWSER}): {why}")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: ``--dist loadfile --no-loadscope-reorder``, whole files to a worker, in
    collection order): the files holding slow tests first, the others after them, most tests first. The slow files
    hold the longest tests (the real model, server processes, up to ~95 s each); dealt out late (xdist's own order
    puts the files with most tests first), they kept one worker busy ~30 s after the other had finished. A run in
    one process keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    slow = {f for f, its in files.items() if any(i.get_closest_marker("slow") is not None for i in its)}
    order = sorted(files, key=lambda f: (f not in slow, 0 if f in slow else -len(files[f])))  # sorted() is stable
    items[:] = [i for f in order for i in files[f]]


VOCAB = 96
MAX_POS = 128
HEAD_STD = 1.0  # LM head init std: logits have std ~ sqrt(hidden) * HEAD_STD after the final RMSNorm

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def build_tiny(kind: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A tiny random-weight causal LM: kind in llama | mixtral | qwen2 | mistral; fp32, eval mode.

    The same (kind, seed, overrides) always gives the same weights, whatever ``attn`` is.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kw = dict(COMMON, **overrides)
    if kind == "llama":
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    elif kind == "mixtral":
        kw.setdefault("num_local_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("sliding_window", None)
        cfg, cls = MixtralConfig(**kw), MixtralForCausalLM
    elif kind == "qwen2":
        kw.setdefault("use_sliding_window", False)
        cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    elif kind == "mistral":
        cfg, cls = MistralConfig(**kw), MistralForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, HEAD_STD, generator=torch.Generator().manual_seed(seed + 1000))
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    """Tiny Llama, eager attention."""
    return build_tiny("llama", "eager", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_sdpa():
    """The same weights as ``tiny_llama``, sdpa attention."""
    return build_tiny("llama", "sdpa", seed=0)


@pytest.fixture(scope="session")
def tiny_mixtral():
    """Tiny Mixtral (4 experts, top-2 routing), sdpa attention."""
    return build_tiny("mixtral", "sdpa", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """Tiny Qwen2 (q/k/v biases), sdpa attention."""
    return build_tiny("qwen2", "sdpa", seed=2)


@pytest.fixture(scope="session")
def tiny_models(tiny_llama, tiny_llama_sdpa, tiny_mixtral, tiny_qwen2):
    return {"llama-eager": tiny_llama, "llama-sdpa": tiny_llama_sdpa, "mixtral-sdpa": tiny_mixtral,
            "qwen2-sdpa": tiny_qwen2}


# ---- reference decoders -----------------------------------------------------------------------------------------

def plain_greedy(model, prompt: Sequence[int], n: int, eos: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding through the engine with no drafters (one token per forward)."""
    res = Engine(model, [], eos_token_ids=eos).generate(list(prompt), n)
    assert res.forwards == len(res.output_ids)
    return res.output_ids


def hf_greedy(model, prompt: Sequence[int], n: int, eos: int | None = None, *, scores: bool = False):
    """Hugging Face ``generate(do_sample=False)``; the new ids (and the per-step logits when ``scores``)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                             output_logits=scores, return_dict_in_generate=True, num_beams=1,
                             temperature=None, top_p=None, top_k=None)
    new = out.sequences[0, len(prompt):].tolist()
    if scores:
        return new, torch.stack(out.logits, 1)[0]
    return new


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row: top-1 minus top-2 logit."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def draw_eos(data, full: Sequence[int], n: int) -> tuple[tuple[int, ...], list[int]]:
    """Hypothesis draw for ``full``, the n-token plain output: no EOS, or one of its own tokens (so generation really
    stops, often inside a draft). Returns (EOS ids, the output expected with them)."""
    from hypothesis import strategies as st

    eos_pos = data.draw(st.none() | st.integers(0, n - 1), label="eos position")
    if eos_pos is None:
        return (), list(full)
    return (full[eos_pos],), list(full[:list(full).index(full[eos_pos]) + 1])


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where a and b differ (min length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def draw_planted_case(data, model, max_new: int, perturbations: int = 3):
    """A hypothesis case for exactness tests: (prompt, max_new_tokens, eos ids, expected output, corpus span).

    The prompt is random (sometimes repeated, so n-gram drafts find matches), EOS is none or one of the model's own
    output tokens (so the generation really stops, often inside a draft), and the corpus span is the model's own
    output planted after the prompt with up to ``perturbations`` ids changed (drafts accepted up to each change).
    """
    from hypothesis import strategies as st

    base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), label="prompt")
    prompt = base + base if data.draw(st.booleans(), label="repeat prompt") else base
    n = data.draw(st.integers(1, max_new), label="max_new_tokens")
    full = plain_greedy(model, prompt, n)
    eos, want = draw_eos(data, full, n)
    span = list(prompt + full)
    for _ in range(data.draw(st.integers(0, perturbations), label="perturbations")):
        i = data.draw(st.integers(0, len(span) - 1), label="at")
        span[i] = data.draw(st.integers(0, VOCAB - 1), label="to")
    return prompt, n, eos, want, span


# ---- test drafters ------------------------------------------------------------------------------------------------

class SequenceDrafter:
    """Proposes the continuation of a known token sequence (an "oracle" when that is the greedy output).

    ``shift`` is added (mod vocab) to every proposed id, so shift != 0 makes a drafter that is always wrong.
    ``depth`` overrides max_depth when set (a drafter that ignores the engine's limit).
    """

    guard = None  # never pauses itself

    def __init__(self, seq: Sequence[int], name: str = "oracle", *, shift: int = 0, vocab: int = VOCAB,
                 depth: int | None = None, limit: int | None = None) -> None:
        self.seq = [int(t) for t in seq]
        self.name, self.shift, self.vocab, self.depth, self.limit = name, shift, vocab, depth, limit
        self.calls: list[tuple[int, int]] = []  # (context length, max_depth) per propose call
        self.observed: list[tuple[int, int, int]] = []
        self.begun = 0

    def bind(self, target) -> None:
        pass

    def begin(self, prompt: np.ndarray) -> None:
        self.begun += 1

    def propose(self, context: np.ndarray, max_depth: int):
        self.calls.append((len(context), max_depth))
        L = len(context)
        if context.tolist() != self.seq[:L]:
            return None
        d = self.depth if self.depth is not None else max_depth
        if self.limit is not None:
            d = min(d, self.limit)
        ids = [(t + self.shift) % self.vocab for t in self.seq[L:L + d]]
        return TokenTree.chain(ids, self.name) if ids else None

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        self.observed.append((proposed, accepted, emitted))


class ConstantDrafter:
    """Always proposes the same ids (a garbage drafter when they are unrelated to the model)."""

    guard = None  # never pauses itself

    def __init__(self, ids: Sequence[int], name: str = "garbage") -> None:
        self.ids, self.name = [int(t) for t in ids], name
        self.observed: list[tuple[int, int, int]] = []

    def bind(self, target) -> None:
        pass

    def begin(self, prompt):
        pass

    def propose(self, context, max_depth):
        return TokenTree.chain(self.ids[:max_depth], self.name) if max_depth > 0 else None

    def observe(self, proposed, accepted, emitted):
        self.observed.append((proposed, accepted, emitted))


class RecordingTarget(HFTarget):
    """HFTarget that records every verify forward: (number of ids, tree mask given, positions given)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.log: list[tuple[int, bool, bool]] = []

    def forward(self, ids, positions=None, mask=None, n_logits=1):
        self.log.append((len(ids), mask is not None, positions is not None))
        return super().forward(ids, positions, mask, n_logits)


def generate_tracking(engine: Engine, target: RecordingTarget, prompt: Sequence[int], n: int, **kw):
    """``engine.generate`` (whose target is ``target``) that also returns, per output token, the index of the
    forward that emitted it; with ``res.drafted_per_forward`` it tells which tokens came from a draft-free forward."""
    emitted_by: list[int] = []
    res = engine.generate(list(prompt), n, on_tokens=lambda new: emitted_by.extend([len(target.log) - 1] * len(new)),
                          **kw)
    assert len(emitted_by) == len(res.output_ids)
    return res, emitted_by


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["build_tiny", "plain_greedy", "hf_greedy", "top2_gap", "first_diff", "draw_planted_case", "SequenceDrafter",
           "ConstantDrafter", "RecordingTarget", "generate_tracking", "ceil_div", "VOCAB", "MAX_POS", "math"]


CLI_VOCAB = 64  # the word-level tokenizer of ``tiny_model_dir``: "t00" .. "t63"
CLI_EOS = 1


# ---- a tiny model directory with a tokenizer (the CLI tests) ------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama plus a word-level tokenizer: "t00" .. "t63" are ids 0 .. 63, "t01" is EOS.

    Fixed-width words: the EOS word is an added token, matched before splitting, so it must not be a prefix of
    another word ("w1" would split "w10" into "w1" + "0").
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-model")
    tk = Tokenizer(models.WordLevel(vocab={f"t{i:02d}": i for i in range(CLI_VOCAB)}, unk_token="t00"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t00", eos_token="t01").save_pretrained(d)
    model = build_tiny("llama", "sdpa", seed=11, vocab_size=CLI_VOCAB, eos_token_id=CLI_EOS)
    model.save_pretrained(d)
    return d, model


# ---- the default (real) model: converted and priced once, whatever runs beside ---------------------------------

# redraft's cache as the run began: module fixtures point $REDRAFT_CACHE at temporary directories while their module
# runs (cost curves of tiny models never land in the user's cache); a real-model test in such a module uses this one.
SESSION_CACHE = os.environ.get("REDRAFT_CACHE")


def use_session_cache(monkeypatch) -> None:
    """Point $REDRAFT_CACHE back at the cache the run began with (where the default model was converted)."""
    if SESSION_CACHE is None:
        monkeypatch.delenv("REDRAFT_CACHE", raising=False)
    else:
        monkeypatch.setenv("REDRAFT_CACHE", SESSION_CACHE)


@contextmanager
def cache_lock(name: str):
    """An exclusive lock on ``.<name>.lock`` in redraft's cache directory, across processes: pytest-xdist workers,
    and another test run sharing the cache. Without it two processes converting the default model at once could
    each replace the other's finished copy while it is being read."""
    from redraft.io.loading import cache_dir

    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        fcntl = None
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f".{name}.lock", "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def load_default_model(**kwargs):
    """``redraft.io.loading.load_model(**kwargs)`` of the default model for a real-model test: skipped only when its
    package is absent (any other failure fails). Under a lock, so that one process converts it (the first time ever)
    while the others wait; a float32 load also measures its cost curve there when the cache has none (the policy,
    the servers and ``redraft run`` subprocesses then read it), so parallel workers do not measure it twice."""
    import importlib.util

    from redraft.io.loading import DEFAULT_MODEL_PACKAGE, load_model

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model's package {DEFAULT_MODEL_PACKAGE} is not installed")
    with cache_lock("default-model"):
        loaded = load_model(**kwargs)
        if kwargs.get("dtype", "float32") == "float32" and kwargs.get("attn", "sdpa") == "sdpa":
            from redraft.pricing.cache import cached_cost_curve
            from redraft.runtimes.transformers.target import HFTarget

            cached_cost_curve(HFTarget(loaded.model))
    return loaded


def seed_cost_curve(model, directory, name) -> os.PathLike:
    """Store ``model``'s cached cost curve in the cache ``directory`` under the key of a copy of it saved at ``name``
    (the key holds the model's path): a process loading the copy reads the curve instead of measuring it again
    (~30 s for the default model). Returns the file written."""
    from redraft.pricing.cache import cached_cost_curve, curve_key, curve_path, save_curve
    from redraft.runtimes.transformers.target import as_target

    curve = cached_cost_curve(as_target(model))
    saved = model.config._name_or_path
    model.config._name_or_path = str(name)
    try:
        key = curve_key(model)
    finally:
        model.config._name_or_path = saved
    path = curve_path(key, directory)
    assert save_curve(path, key, curve)
    return path


# the server tests' module-scoped fixtures, shared from here so that test modules need not import them (imported
# last: serverkit imports build_tiny from this module)
from serverkit import loaded, model_dir, tenants_file  # noqa: E402,F401


def stream_of(spans):
    """The corpus stream: non-empty spans joined by -1, oldest first (the layout corpora read)."""
    stream = []
    for s in spans:
        if len(s):
            if stream:
                stream.append(-1)
            stream.extend(int(t) for t in s)
    return stream
