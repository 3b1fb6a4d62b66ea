"""Benchmark methods: ours (the Engine with each draft configuration) and the peers a user would pick instead.

Every method turns prompt ids into at most ``ngen`` greedy output ids and a :class:`RunRecord`; the harness times
each call with the same clock, so figures are comparable across runtimes. Output ids are compared with plain greedy
(ours) for the same prompt in the same run.

| name | what runs |
| --- | --- |
| plain | redraft Engine, no drafters: one token per forward (the speedup baseline) |
| hf | Hugging Face ``model.generate`` greedy |
| hf-pld | HF prompt lookup decoding (``prompt_lookup_num_tokens=10``) |
| ngram | redraft, n-gram drafts from the live context only |
| corpus | redraft, frozen-corpus drafts only |
| corpus+ngram | redraft, corpus first, n-gram fills the gaps, fixed depth K and guard (Colibri's semantics) |
| policy | redraft, corpus first, n-gram fills the gaps, the cost-aware policy choosing each depth (the default) |
| tree | redraft, the corpus's 4 most frequent continuations plus n-gram merged into one token tree (budget 32) |
| llama.cpp | llama-cpp-python greedy on the same GGUF (optional: only when ``import llama_cpp`` works) |
| llama.cpp-pld | llama-cpp-python with ``LlamaPromptLookupDecoding(num_pred_tokens=10)`` (optional) |
| policy-transformers | with ``--runtime llama.cpp``: the policy method on the transformers target of the same GGUF |

With ``--runtime llama.cpp`` the redraft methods (plain, ngram, corpus, policy, ...) run on llama.cpp and the
llama.cpp methods use the target's context length and threads, so llama.cpp's own greedy ids must equal plain's;
the hf methods need the transformers model and are skipped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, TREE_BUDGET
from redraft.runtimes.llamacpp.probe import Config, ProbeFailed, settle

ALL_METHODS = ("plain", "hf", "hf-pld", "ngram", "corpus", "corpus+ngram", "policy", "tree", "llama.cpp",
               "llama.cpp-pld", "policy-transformers")
DEFAULT_METHODS = ALL_METHODS[:-1]
HF_METHODS = ("hf", "hf-pld")  # they call transformers' generate on the model itself
NEEDS_CORPUS = ("corpus", "corpus+ngram", "tree")  # policy runs without a corpus too (n-gram drafts only)


@dataclass
class RunRecord:
    """What one method produced for one prompt.

    ``forwards`` is None where the runtime does not expose it; ``accepted_per_forward`` (accepted draft tokens in
    each forward, prefill included) only exists for redraft methods; ``sources`` maps a draft source to its
    counts (:meth:`redraft.decoding.runstats.SourceStats.to_dict`).
    """

    output_ids: list[int]
    seconds: float
    forwards: int | None = None
    accepted_per_forward: list[int] | None = None
    sources: dict[str, dict] = field(default_factory=dict)
    stop_reason: str = ""
    draft_depth_per_forward: list[int] | None = None


class Method:
    """A way to generate. Subclasses set ``name``, ``description`` and implement :meth:`generate`.

    ``exact_expected`` is False for methods that cannot reproduce our greedy ids by construction (another
    runtime's arithmetic); their differences are still reported, marked as expected.
    """

    name = "method"
    description = ""
    exact_expected = True

    def generate(self, prompt_ids: Sequence[int], ngen: int) -> RunRecord:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EngineMethod(Method):
    """A redraft :class:`~redraft.decoding.engine.Engine` configuration (reused across prompts: drafters reset per
    prompt). ``threads``: torch intra-op threads while it generates (None: as the process has them)."""

    def __init__(self, name: str, engine, description: str = "", threads: int | None = None) -> None:
        self.name, self.engine, self.description, self.threads = name, engine, description, threads

    def generate(self, prompt_ids, ngen):
        from redraft.compose.runtime import torch_threads

        with torch_threads(self.threads) if self.threads else contextlib.nullcontext():
            t0 = time.perf_counter()
            res = self.engine.generate(list(prompt_ids), ngen)
            dt = time.perf_counter() - t0
        # per-forward draft depths give acceptance by draft position (see the report); plain drafts nothing
        depths = list(res.draft_depth_per_forward) if self.engine.drafters else None
        return RunRecord(list(res.output_ids), dt, res.forwards, list(res.accepted_per_forward),
                         {k: s.to_dict() for k, s in res.sources.items()}, res.stop_reason, depths)


class HFGenerateMethod(Method):
    """Hugging Face ``model.generate(do_sample=False)``, optionally with prompt lookup; forwards counted by a hook."""

    def __init__(self, name: str, model, eos_token_ids: Sequence[int], prompt_lookup: int | None = None,
                 description: str = "") -> None:
        self.name, self.model, self.description = name, model, description
        self.eos = sorted(int(e) for e in eos_token_ids)
        self.prompt_lookup = prompt_lookup

    def generate(self, prompt_ids, ngen):
        import torch

        count = [0]
        hook = self.model.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=ngen, do_sample=False,
                  num_beams=1, temperature=None, top_p=None, top_k=None,
                  eos_token_id=self.eos or None, pad_token_id=self.eos[0] if self.eos else 0)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, **kw)
            dt = time.perf_counter() - t0
        finally:
            hook.remove()
        new = out[0, len(prompt_ids):].tolist()
        stop = "eos" if new and new[-1] in self.eos else "length"
        return RunRecord(new, dt, count[0], None, {}, stop)


class LlamaCppMethod(Method):
    """llama-cpp-python greedy (temp 0) on a GGUF file, optionally with its prompt-lookup draft model."""

    exact_expected = False  # quantised kernels and activations: not the fp32 arithmetic of the target model

    def __init__(self, name: str, gguf_path: str, eos_token_ids: Sequence[int], *, prompt_lookup: int | None = None,
                 n_ctx: int = 4096, description: str = "", n_threads: int | None = None,
                 exact_expected: bool = False, config: Config | None = None) -> None:
        from llama_cpp import Llama

        from redraft.runtimes.llamacpp.lib import model_defaults, set_tiled_matmul

        draft = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
        self.name, self.description = name, description
        self.exact_expected = exact_expected  # True beside redraft's llama.cpp target: the same build and settings
        # llama-cpp-python's Llama keeps a score array of n_batch rows unless logits_all is passed, yet with a draft
        # model it writes every row there: a prompt past n_batch tokens raised ValueError; logits_all sizes it
        # [n_ctx, vocab], and prompt lookup evaluates its draft past the answer's end, so it needs that much room
        self.n_ctx, self.room = n_ctx, 1 + (2 * prompt_lookup if prompt_lookup else 0)
        config = config or Config()  # the kernels the load probe chose (the target's, beside a llama.cpp target)
        set_tiled_matmul(config.tiled_matmul)
        with model_defaults(extra_bufts=config.extra_bufts):
            # the prompt on the same threads as the tokens (llama-cpp-python's default n_threads_batch is every
            # core, llama.cpp's own -tb defaults to -t): side by side with a target on n threads, n threads each
            threads = n_threads or os.cpu_count() or 1
            self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             draft_model=draft, logits_all=draft is not None, verbose=False, seed=0)
        self.eos = set(int(e) for e in eos_token_ids) | {int(self.llm.token_eos())}
        self.forwards = 0
        inner_eval = self.llm.eval

        def counting_eval(tokens):
            self.forwards += 1
            return inner_eval(tokens)

        self.llm.eval = counting_eval  # generate() calls self.eval once per forward (draft included)

    def generate(self, prompt_ids, ngen):
        self.llm.reset()  # no KV prefix reuse from the previous prompt: every method starts cold
        self.forwards = 0
        out: list[int] = []
        stop = "length"
        ngen = min(ngen, self.n_ctx - len(prompt_ids) - self.room)  # the context's end, as the target stops there
        t0 = time.perf_counter()
        if ngen > 0:
            for tok in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                         repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if tok in self.eos:
                    stop = "eos"
                    break
                if len(out) >= ngen:
                    break
        dt = time.perf_counter() - t0
        return RunRecord(out, dt, self.forwards, None, {}, stop)

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:
            pass


def _transformers_policy(gguf: str, eos: Sequence[int], corpus, threads: int) -> Method:
    """The policy method on the transformers target of ``gguf`` (dequantised to fp32 once), for a run whose redraft
    methods are on llama.cpp: its ids are the fp32 model's, so they differ from llama.cpp's as expected. It runs
    (and measures its cost curve) on ``threads`` torch threads, the llama.cpp target's count."""
    from redraft.compose import SpeculationConfig, build_engine, build_policy
    from redraft.compose.runtime import torch_threads
    from redraft.io.loading import load_model

    with torch_threads(threads):
        loaded = load_model(gguf, quiet=True)
        spec = SpeculationConfig()
        policy = build_policy(loaded.model, max_nodes=spec.policy_nodes)
    method = EngineMethod("policy-transformers", build_engine(loaded.model, spec, eos_token_ids=eos, corpus=corpus,
                                                              policy=policy),
                          "redraft policy on the transformers target (fp32) of the same GGUF", threads=threads)
    method.exact_expected = False
    return method


def llama_config(gguf: str) -> tuple[Config | None, str]:
    """The kernels llama.cpp runs ``gguf`` with here, as the load probe chose them in child processes
    (:func:`redraft.runtimes.llamacpp.probe.settle`, cached): (config, "") or, when no configuration ran it, (None,
    why), naming how each child died."""
    if not os.path.isfile(gguf):
        return None, f"GGUF file {gguf} does not exist"
    try:
        return settle(gguf, threads=os.cpu_count() or 1).config, ""
    except ProbeFailed as e:
        return None, f"llama.cpp cannot run {gguf} here (probed in a child process): {e}"


def llama_cpp_available() -> tuple[bool, str]:
    """(True, "") when llama-cpp-python imports, else (False, why)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken shared library
        return False, f"llama-cpp-python is not installed ({type(e).__name__}: {e})"
    return True, ""


@dataclass
class MethodConfig:
    """Settings shared by the redraft methods."""

    k: int = CORPUS_K_DEFAULT
    minacc: float = CORPUS_MINACC
    tree_branches: int = 4
    tree_budget: int = TREE_BUDGET
    pld_tokens: int = 10
    gguf: str | None = None  # GGUF for the llama.cpp methods (None: skip them)
    n_ctx: int = 4096
    curve: object | None = None  # the policy method's CostCurve (None: measured here, cached; tests inject one)


def parse_methods(spec: str | None) -> list[str]:
    """``"plain,corpus"`` -> names in the canonical order; None/"all" = every method. Raises ValueError."""
    if spec in (None, "", "all"):
        return list(DEFAULT_METHODS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in ALL_METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(ALL_METHODS)}")
    return [n for n in ALL_METHODS if n in names]


def build_methods(names: Sequence[str], model, eos_token_ids: Sequence[int], corpus, cfg: MethodConfig
                  ) -> tuple[list[Method], dict[str, str]]:
    """Methods for ``names`` (plain always first), and {name: why skipped} for those that cannot run here."""
    from redraft.compose import SpeculationConfig, build_engine, build_policy, plain_engine

    eos = list(eos_token_ids)
    skipped: dict[str, str] = {}
    runtime = getattr(model, "runtime", "transformers")  # a LlamaCppTarget says "llama.cpp"
    probed: tuple[Config | None, str] | None = None  # the llama.cpp kernels (or why none), once for both methods

    def engine(*, corpus=None, ngram: bool = True, tree: int = 0):
        # Colibri's fixed semantics: depth K, guard MINACC, no policy
        spec = SpeculationConfig(k=cfg.k, minacc=cfg.minacc, policy=False, ngram=ngram, tree=tree,
                                 tree_budget=cfg.tree_budget if tree else None)
        return build_engine(model, spec, eos_token_ids=eos, corpus=corpus)

    def policy_engine():
        # one policy for the whole run: it keeps learning across questions, as a long-running process does
        spec = SpeculationConfig()
        policy = build_policy(model, max_nodes=spec.policy_nodes, curve=cfg.curve)
        return build_engine(model, spec, eos_token_ids=eos, corpus=corpus, policy=policy)

    makers: dict[str, Callable[[], Method]] = {
        "plain": lambda: EngineMethod("plain", plain_engine(model, eos_token_ids=eos),
                                      "redraft Engine, no drafters (one token per forward)"),
        "hf": lambda: HFGenerateMethod("hf", model, eos, None, "HF generate, greedy"),
        "hf-pld": lambda: HFGenerateMethod("hf-pld", model, eos, cfg.pld_tokens,
                                           f"HF generate, prompt_lookup_num_tokens={cfg.pld_tokens}"),
        "ngram": lambda: EngineMethod("ngram", engine(),
                                      f"redraft, n-gram drafts only (K={cfg.k})"),
        "corpus": lambda: EngineMethod("corpus", engine(corpus=corpus, ngram=False),
                                       f"redraft, frozen-corpus drafts only (K={cfg.k})"),
        "corpus+ngram": lambda: EngineMethod("corpus+ngram", engine(corpus=corpus),
                                             f"redraft, corpus then n-gram (K={cfg.k})"),
        "policy": lambda: EngineMethod("policy", policy_engine(),
                                       "redraft, corpus then n-gram, depth per step from the cost-aware policy"),
        "tree": lambda: EngineMethod("tree", engine(corpus=corpus, tree=cfg.tree_branches),
                                     f"redraft, token tree: corpus x{cfg.tree_branches} branches + n-gram, "
                                     f"budget {cfg.tree_budget} (K={cfg.k})"),
    }
    out: list[Method] = []
    for name in ["plain"] + [n for n in names if n != "plain"]:
        if name in NEEDS_CORPUS and corpus is None:
            skipped[name] = "no corpus"
            continue
        if name in HF_METHODS and runtime != "transformers":
            skipped[name] = f"needs the transformers runtime (this run is on {runtime})"
            continue
        if name == "policy-transformers":
            if runtime == "transformers" or not cfg.gguf:
                skipped[name] = "only beside --runtime llama.cpp (the policy method is on transformers already)"
                continue
            out.append(_transformers_policy(cfg.gguf, eos, corpus, getattr(model, "n_threads", 1)))
            continue
        if name.startswith("llama.cpp"):
            ok, why = llama_cpp_available()
            if not ok:
                skipped[name] = why
                continue
            if not cfg.gguf:
                skipped[name] = "no GGUF file for this model"
                continue
            same = runtime == "llama.cpp"  # then the target's own context, threads and kernels, and the same ids
            if probed is None:  # the kernels: the target's, or the load probe's (a child process: a crash skips)
                probed = llama_config(cfg.gguf) if not same else (
                    Config(model.extra_bufts, model.tiled_matmul), "")
            if probed[0] is None:
                skipped[name] = probed[1]
                continue
            try:
                pld = cfg.pld_tokens if name == "llama.cpp-pld" else None
                desc = (f"llama-cpp-python, LlamaPromptLookupDecoding(num_pred_tokens={cfg.pld_tokens})" if pld
                        else "llama-cpp-python greedy")
                kernels = "" if probed[0] == Config() else f", {probed[0].describe()}"
                out.append(LlamaCppMethod(name, cfg.gguf, eos, prompt_lookup=pld,
                                          n_ctx=model.max_length if same else cfg.n_ctx,
                                          n_threads=model.n_threads if same else None, exact_expected=same,
                                          config=probed[0],
                                          description=f"{desc} on {os.path.basename(cfg.gguf)}{kernels}"))
            except Exception as e:
                skipped[name] = f"llama.cpp failed to load {cfg.gguf}: {type(e).__name__}: {e}"
            continue
        out.append(makers[name]())
    return out, skipped
