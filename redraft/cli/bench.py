"""``redraft bench run | cost | corpus | serve``: benchmarks (the work itself is in :mod:`redraft.bench`)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from redraft.bench import corpus_bench, serve_bench
from redraft.bench.concurrent_bench import ConcurrentBenchConfig
from redraft.bench.corpus_bench import DEFAULT_SIZES, run_corpus_bench
from redraft.bench.cost import cost_curve, cost_markdown
from redraft.bench.fleet_bench import FleetBenchConfig
from redraft.bench.harness import bench, machine_info, write_outputs
from redraft.bench.methods import ALL_METHODS, MethodConfig, parse_methods
from redraft.bench.report import plot_cost, text_table
from redraft.bench.workloads import WORKLOADS, ChatEncoder, parse_workloads
from redraft.cli.common import (
    add_model_arg,
    add_model_args,
    add_threads_arg,
    announce_generation_config,
    check_model_or_exit,
    draft_depth,
    existing_dir,
    float_above,
    load_model_or_exit,
    output_dir,
    output_file,
    percent,
    positive,
)
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, MAX_DRAFT_DEPTH, TREE_BUDGET
from redraft.io.atomic import write_json, write_text
from redraft.io.loading import ModelLoadError, default_model_path
from redraft.io.questions import load_questions


def command_line() -> str:
    """The command line of this process, quoted for a shell (recorded in the results)."""
    return "redraft " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "redraft bench"


def model_name(loaded) -> str:
    """A readable model name: the converted directory's stem for the bundled default."""
    if loaded.name == "default" and loaded.path.suffix == ".gguf":  # the llama.cpp runtime runs the file itself
        return f"{loaded.path.stem} (default, llama.cpp)"
    if loaded.name == "default":
        return loaded.path.name.split("-" + loaded.path.name.rsplit("-", 1)[-1])[0] + " (default)"
    return str(loaded.name)


def llama_cpp_gguf(args) -> str | None:
    """The GGUF the llama.cpp methods load: --gguf, else the default model's or a --model ending in .gguf."""
    if args.gguf:
        return args.gguf
    if args.model is None or args.model == "default":
        try:
            return str(default_model_path())
        except ModelLoadError:
            return None
    return args.model if str(args.model).endswith(".gguf") else None


# which --methods read each method flag (a flag given without any of them has no effect)
METHOD_FLAGS = (("--k", "k", ("ngram", "corpus", "corpus+ngram", "tree")),
                ("--minacc", "minacc", ("ngram", "corpus", "corpus+ngram", "tree")),
                ("--tree-branches", "tree_branches", ("tree",)), ("--tree-budget", "tree_budget", ("tree",)),
                ("--pld-tokens", "pld_tokens", ("hf-pld", "llama.cpp-pld")),
                ("--gguf", "gguf", ("llama.cpp", "llama.cpp-pld")))


def check_method_flags(args, methods: list[str]) -> None:
    """Refuse method flags none of the chosen methods reads (before the model loads)."""
    for flag, name, users in METHOD_FLAGS:
        if getattr(args, name) is not None and not set(users) & set(methods):
            raise SystemExit(f"redraft bench run: error: {flag}: only used by the method(s) {', '.join(users)}, "
                             f"not in --methods {args.methods}")


def _parsed(flag: str, parse, *values):
    """``parse(*values)``; a ValueError is a usage error naming ``flag``, exit status 2 as argparse gives one (1 means
    an output that differs from plain greedy)."""
    try:
        return parse(*values)
    except ValueError as e:
        print(f"redraft bench run: error: {flag}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _writable_or_exit(out: str | None, json_path: str | None) -> None:
    """Create ``--out`` and try ``--json``'s file before the run, not after it: a path the checks of the argument
    types let through (a root user on a read-only file system) fails here with exit status 2, naming its option."""
    for flag, path in (("--out", out), ("--json", json_path)):
        if path is None:
            continue
        try:
            if flag == "--out":
                os.makedirs(path, exist_ok=True)
            else:
                existed = os.path.exists(path)
                with open(path, "a", encoding="utf-8"):
                    pass
                if not existed:
                    os.remove(path)
        except OSError as e:
            print(f"redraft bench run: error: {flag} {path}: cannot be written ({e.strerror or e})", file=sys.stderr)
            raise SystemExit(2) from None


def cmd_bench_run(args) -> int:
    counts = _parsed("--workloads", parse_workloads, args.workloads, args.questions)
    methods = _parsed("--methods", parse_methods, args.methods)
    _writable_or_exit(args.out, args.json)
    check_method_flags(args, methods)
    gguf = llama_cpp_gguf(args)
    given = {name: getattr(args, name) for _, name, _ in METHOD_FLAGS
             if name != "gguf" and getattr(args, name) is not None}
    if "minacc" in given:
        given["minacc"] /= 100.0
    cfg = MethodConfig(**given, gguf=gguf)  # MethodConfig holds the defaults of the flags not given
    check_model_or_exit(args.model)
    loaded = load_model_or_exit(args.model, dtype=args.dtype, runtime=args.runtime, n_ctx=args.n_ctx)
    announce_generation_config(loaded)
    encoder = ChatEncoder(loaded.tokenizer, chat=False if args.no_chat else None)
    results = bench(loaded.model, sorted(loaded.eos_token_ids), encoder, load_questions(), counts=counts,
                    ngen=args.ngen, methods=methods, cfg=cfg, freeze=args.freeze,
                    max_prompt_tokens=args.max_prompt_tokens, vocab_size=loaded.vocab_size,
                    progress=not args.no_progress, ceiling=not args.no_ceiling, rounds=args.rounds)
    results["command"] = command_line()
    results["model"] = {"name": model_name(loaded), "path": str(loaded.path), "gguf": gguf,
                        "runtime": loaded.runtime, "vocab_size": loaded.vocab_size}
    if loaded.runtime == "transformers":
        results["model"].update(dtype=str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
                                attn=getattr(loaded.model.config, "_attn_implementation", None))
    else:
        results["model"].update(dtype=loaded.model.description, threads=loaded.model.n_threads,
                                n_ctx=loaded.model.max_length)
    for m, why in results["skipped_methods"].items():
        print(f"redraft bench: skipped {m}: {why}", file=sys.stderr)
    print(text_table(results))
    for p in write_outputs(results, Path(args.out) if args.out else None, args.json):
        print(f"wrote {p}", file=sys.stderr)
    for d in results.get("rounds_differing", []):
        print(f"redraft bench: WARNING: {d['workload']}/{d['method']} decisions (forwards, draft depths, sources, "
              f"accepted tokens, stop) or output changed between rounds on questions "
              f"{', '.join(map(str, d['questions']))}", file=sys.stderr)
    bad = [d for d in results["differing"] if not d["expected"]]
    for d in results["differing"]:
        note = " (expected: different runtime)" if d["expected"] else ""
        print(f"redraft bench: WARNING: {d['workload']}/{d['method']} output differs from plain greedy on "
              f"questions {', '.join(map(str, d['mismatches']))}{note}", file=sys.stderr)
    return 1 if bad else 0


def cmd_bench_cost(args) -> int:
    check_model_or_exit(args.model)
    loaded = load_model_or_exit(args.model)
    context = loaded.max_length
    if context and args.prefix + args.max_s > context:
        raise SystemExit(f"redraft bench cost: error: --prefix {args.prefix} + --max-s {args.max_s} tokens exceed the "
                         f"model's context length ({context})")
    prefix_ids = None
    if not args.random_prefix:
        # a real ~N-token prompt (Spec-Bench summarization text), so attention sees ordinary content
        q = next(q for q in load_questions() if q["category"] == "summarization")
        prefix_ids = loaded.tokenizer(q["turns"][0])["input_ids"][:args.prefix]
    cost = cost_curve(loaded.model, max_s=args.max_s, prefix=args.prefix, repeats=args.repeats,
                      tree_mask=args.tree_mask, prefix_ids=prefix_ids, progress=not args.no_progress)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cost.update({"schema": "redraft-bench-cost/1", "command": command_line(), "model": model_name(loaded),
                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine_info(load, load)})
    text = cost_markdown(cost)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "cost.json", cost, indent=1)
        write_text(out / "cost.md", text + "\n")
        plot_cost(cost, out / "cost_curve.png")
        print(f"wrote {out / 'cost.json'}, {out / 'cost.md'}, {out / 'cost_curve.png'}", file=sys.stderr)
    return 0


def cmd_bench_corpus(args) -> int:
    result = run_corpus_bench(args.sizes, lookups=args.lookups, k=args.k, workdir=args.workdir)
    if args.json_out:
        write_json(args.json_out, result)
    return 0


def cmd_bench_serve(args) -> int:
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    try:
        serve_bench.check_phases(phases)
    except ValueError as e:
        raise SystemExit(f"redraft bench serve: error: {e}") from None
    if args.runtime != "transformers" and phases != ["concurrent"]:
        raise SystemExit(f"redraft bench serve: error: --runtime {args.runtime}: only the concurrent phase runs on "
                         "another runtime (--phases concurrent)")
    concurrent = ConcurrentBenchConfig(runtime=args.runtime,
        levels=tuple(args.concurrency or (1, 4, 16)), max_tokens=args.concurrent_max_tokens, rounds=args.concurrent_rounds,
        min_requests=args.concurrent_min_requests, server_args=tuple(args.server_args), timeout=args.timeout,
        streams=args.probe_streams, stream_max_tokens=args.probe_max_tokens, prompt_tokens=args.probe_prompt_tokens,
        **({"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {}))
    cfg = serve_bench.ServeBenchConfig(
        model=args.model, questions=args.questions, max_tokens=args.max_tokens, requests=args.requests,
        concurrency=max(args.concurrency) if args.concurrency else 4, concurrent=concurrent, plain_check=not args.no_plain_check,
        load_distinct=args.load_distinct, load_max_tokens=args.load_max_tokens,
        repeats=args.repeats, memory_requests=args.memory_requests, cap_tokens=args.cap_tokens,
        timeout=args.timeout, threads=getattr(args, "threads", None), agent_conversations=args.agent_conversations,
        agent_turns=args.agent_turns, agent_max_tokens=args.agent_max_tokens, agent_k=args.agent_k,
        fleet=FleetBenchConfig(requests=args.fleet_requests, distinct=args.fleet_distinct,
                               max_tokens=args.load_max_tokens, timeout=args.timeout))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="redraft-bench-serve-"))
    try:
        results = serve_bench.run_serve_bench(cfg, phases, work, log=lambda line: print(line, flush=True))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"redraft bench serve: error: {e}") from None
    finally:
        print(f"logs and corpora: {work}", file=sys.stderr)
    if args.json:
        write_json(args.json, {"command": command_line(), **results})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / "results.json", {"command": command_line(), **results})
        print(f"wrote {Path(args.out) / 'results.json'}", file=sys.stderr)
    return 0


def positive_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``1,4,16``)."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers of at least 1, e.g. 1,4,16")
    return values


def server_args(text: str) -> list[str]:
    """argparse type: extra ``redraft serve`` arguments in one shell-quoted string (``"--max-running 16"``)."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def corpus_sizes(text: str) -> list[int]:
    """argparse type: comma-separated corpus sizes in tokens (``1e4,1e6``), each at least 100."""
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 1e4,1e6") from None
    if not sizes or min(sizes) < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: each size must be at least 100 tokens")
    return sizes


COST_DESCRIPTION = (
    "Measure the verify cost curve c(S) = time(S tokens) / time(1 token) on the chosen model: with a prefix "
    "(--prefix tokens of Spec-Bench text) in the KV cache, one forward over S tokens is timed for S = 1..--max-s, "
    "with logits for every row, as a verify forward over the root and S-1 drafted tokens computes them; the cache "
    "is cropped back after each. Each timed forward counts as its ratio to the two 1-token forwards around it, and "
    "each repeat visits the sizes in a random order, so a burst of another job's work on a shared machine moves "
    "no S against the 1-token step; each S reports the median ratio. A draft of d tokens pays only when it yields more than c(d+1) tokens "
    "per forward, so the curve says how deep drafts may go; the speculation policy measures its cost curve the "
    "same way.")

RUN_EPILOG = """workloads (--workloads, comma-separated; NAME:N overrides --questions for one workload; 'all'):
  replay     frozen questions (MT-Bench categories, round-robin): their plain answers are in the corpus
  novel      translation / qa / math_reasoning questions: unrelated to the corpus
  near       second turns of frozen questions (frozen answer in the conversation), alternating with other
             questions of the frozen categories
  copy       summarization and RAG prompts (answers reuse the prompt)
  specbench  round-robin sample over all 13 Spec-Bench categories, frozen questions excluded

methods (--methods, comma-separated; default all; plain always runs, it is the reference):
  plain          redraft Engine without drafters (one token per forward)
  hf             Hugging Face model.generate, greedy
  hf-pld         HF prompt lookup decoding, prompt_lookup_num_tokens=10
  ngram          redraft, n-gram drafts from the live context only
  corpus         redraft, frozen-corpus drafts only
  corpus+ngram   redraft, corpus first, n-gram fills the gaps (fixed --k, --minacc guard)
  policy         redraft, corpus first, n-gram fills the gaps, depth chosen per step by the cost-aware policy
                 (cost curve measured here once, cached)
  tree           redraft, corpus top-4 continuations + n-gram merged in one token tree (budget 32)
  llama.cpp      llama-cpp-python greedy on the same GGUF (only when llama_cpp imports)
  llama.cpp-pld  llama-cpp-python with LlamaPromptLookupDecoding(num_pred_tokens=10) (idem)

The corpus is built first from plain greedy answers to the replay questions (--freeze N of them). Methods run
interleaved per question (A B C ... on question 1, then on question 2, start rotated) so machine noise hits all
alike; speedup = median per-question tok/s / median plain tok/s of the same run. With --rounds R the whole run
repeats R times and each question's seconds are the median over rounds. Exit status 1 when a method that should be
exact produced ids different from plain greedy, in any round, or ids that changed between rounds (also flagged in
the tables and JSON)."""


def register(sub) -> None:
    """Add ``bench`` with its ``run``, ``cost``, ``corpus`` and ``serve`` sub-commands to the top-level sub-parsers."""
    bp = sub.add_parser("bench", help="benchmarks (see 'redraft bench -h')",
                        description="Benchmarks, each measured side by side in one run: methods x workloads "
                                    "(run), the verify cost curve (cost), the corpus index (corpus) and the HTTP "
                                    "server (serve). Each writes its raw figures as JSON; see docs/benchmarks.md.")
    bsub = bp.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True

    p = bsub.add_parser("corpus", help="corpus index build/open/lookup benchmark",
                        description=corpus_bench.__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=corpus_sizes, default=list(DEFAULT_SIZES),
                   help="comma-separated corpus sizes in tokens, e.g. 1e4,1e6,1e7,1e8 (default)")
    p.add_argument("--lookups", type=positive, default=20000, help="propose() calls per size (default 20000)")
    p.add_argument("-k", type=draft_depth, default=CORPUS_K_DEFAULT,
                   help=f"draft length 1..{MAX_DRAFT_DEPTH} (default {CORPUS_K_DEFAULT})")
    p.add_argument("--workdir", type=existing_dir, default=None,
                   help="existing directory where the temporary corpus files go (default: system tmp)")
    p.add_argument("--json", dest="json_out", type=output_file, default=None,
                   help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_bench_corpus)

    p = bsub.add_parser("run", help="workloads x methods benchmark against HF generate / prompt lookup / llama.cpp",
                        description="Benchmark redraft's draft configurations side by side with Hugging Face\n"
                                    "generate (greedy, prompt lookup) and llama.cpp on Spec-Bench workloads.\n"
                                    "Prints a table; --out DIR writes results.json (every raw figure), results.md\n"
                                    "and PNG plots.",
                        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--workloads", default="replay,novel,near,copy",
                   help=f"comma-separated from {', '.join(WORKLOADS)} (NAME:N sets its count; 'all'); "
                        "default replay,novel,near,copy")
    p.add_argument("--questions", type=positive, default=5, help="questions per workload (default 5)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {', '.join(ALL_METHODS)} (default all)")
    p.add_argument("--freeze", type=positive, default=None,
                   help="questions frozen into the corpus (default: the replay count)")
    p.add_argument("--k", type=draft_depth, default=None,
                   help=f"draft depth of the redraft methods, 1..{MAX_DRAFT_DEPTH} (default {CORPUS_K_DEFAULT})")
    p.add_argument("--minacc", type=percent, default=None,
                   help=f"acceptance guard threshold in %% (default {100 * CORPUS_MINACC:g})")
    p.add_argument("--tree-branches", type=positive, default=None,
                   help="corpus branches of the tree method (default 4)")
    p.add_argument("--tree-budget", type=positive, default=None,
                   help=f"tree method node budget (default {TREE_BUDGET})")
    p.add_argument("--pld-tokens", type=positive, default=None,
                   help="prompt lookup tokens for hf-pld and llama.cpp-pld (default 10)")
    p.add_argument("--gguf", default=None, help="GGUF for the llama.cpp methods (default: the default model's)")
    p.add_argument("--max-prompt-tokens", type=positive, default=None,
                   help="keep only the last N prompt ids (models with a short context)")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write results.json, results.md and PNG plots here (created if missing)")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help="also write the results JSON here")
    p.add_argument("--no-ceiling", action="store_true",
                   help="do not time the replay ceiling (one forward over prompt + answer) of each question")
    p.add_argument("--rounds", type=positive, default=1, metavar="R",
                   help="run every method on every question R times (the corpus frozen once, the methods built "
                        "afresh each round, the policy's cost curve measured once) and report per question the "
                        "median seconds and the fastest ceiling; decisions and outputs that change between rounds "
                        "are flagged (default 1)")
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_run)

    p = bsub.add_parser("cost", help="verify cost curve c(S) = time(S tokens) / time(1 token)",
                        description=COST_DESCRIPTION)
    add_model_arg(p)
    p.add_argument("--max-s", type=positive, default=64, help="largest S (default 64)")
    p.add_argument("--prefix", type=positive, default=200, help="tokens in the KV cache before each forward (default 200)")
    p.add_argument("--repeats", type=positive, default=5, help="timings per S, median reported (default 5)")
    p.add_argument("--tree-mask", action="store_true",
                   help="also time each S with the explicit 4D tree mask + position ids of tree verification")
    p.add_argument("--random-prefix", action="store_true", help="random prefix ids instead of Spec-Bench text")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write cost.json, cost.md and cost_curve.png here (created if missing)")
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_cost)

    p = bsub.add_parser("serve", help="redraft serve over HTTP: repeat effect, load, overhead, crash, memory, agent "
                                          "loops, concurrent requests, a long prompt beside streams",
                        description=serve_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("--phases", default=",".join(serve_bench.PHASES),
                   help=f"comma-separated subset of {', '.join(serve_bench.PHASES)} (default all)")
    p.add_argument("--questions", type=positive, default=5,
                   help="repeat: questions per pass (default 5; a full-size run: 20)")
    p.add_argument("--max-tokens", type=positive, default=64, help="repeat/overhead: max_tokens (default 64)")
    p.add_argument("--requests", type=positive, default=32,
                   help="load/crash: requests (default 32; a full-size run: 200)")
    p.add_argument("--concurrency", type=positive_list, default=None, metavar="N[,N...]",
                   help="concurrent: the concurrencies to measure, comma-separated (default 1,4,16); load/crash: "
                        "concurrent clients, the largest of them (default 4; a full-size load run: 16)")
    p.add_argument("--concurrent-max-tokens", type=positive, default=64,
                   help="concurrent: max_tokens per request (default 64)")
    p.add_argument("--concurrent-min-requests", type=positive, default=8,
                   help="concurrent: requests per concurrency N are max(this, 2N) (default 8)")
    p.add_argument("--concurrent-rounds", type=positive, default=1,
                   help="concurrent: runs per N and server, alternating which server goes first (A B, B A, ...), "
                        "each with the next questions (the same to both servers), pooled; 2 or more evens out drift "
                        "on a busy machine (default 1)")
    p.add_argument("--server-args", type=server_args, default=[], metavar="'ARGS'",
                   help="concurrent/longprompt: extra 'redraft serve' arguments of the server under test, one "
                        "quoted string, e.g. '--max-running 16 --max-batch-tokens 512' (default: none, its defaults)")
    p.add_argument("--runtime", choices=("transformers", "llama.cpp"), default="transformers",
                   help="concurrent: the runtime both servers run (redraft serve --runtime), and the plain greedy "
                        "reference (default transformers); with llama.cpp give --server-args '--max-running N'")
    p.add_argument("--no-plain-check", action="store_true",
                   help="concurrent: compare answers with the --max-running 1 server's only, not also with plain "
                        "greedy decoding in this process")
    p.add_argument("--probe-streams", type=positive, default=4, help="longprompt: decoding streams (default 4)")
    p.add_argument("--probe-max-tokens", type=positive, default=96,
                   help="longprompt: max_tokens of each stream (default 96)")
    p.add_argument("--probe-prompt-tokens", type=positive, default=4000,
                   help="longprompt: tokens of the arriving prompt (default 4000)")
    p.add_argument("--chunk-tokens", type=positive, default=None,
                   help="longprompt: the prefill chunk whose forward is timed (default: --max-batch-tokens from "
                        "--server-args, else the server's default for it, else 512)")
    p.add_argument("--load-distinct", type=positive, default=8, help="load: distinct questions (default 8)")
    p.add_argument("--load-max-tokens", type=positive, default=24, help="load/crash: max_tokens (default 24)")
    p.add_argument("--repeats", type=positive, default=3, help="overhead: timings per side, median (default 3)")
    p.add_argument("--memory-requests", type=positive, default=100,
                   help="memory: requests (default 100; a full-size run: 10000)")
    p.add_argument("--cap-tokens", type=positive, default=1_000_000, help="memory: the server's --cap-tokens")
    p.add_argument("--agent-conversations", type=positive, default=2, help="agent: tasks (default 2)")
    p.add_argument("--agent-turns", type=positive, default=5, help="agent: requests per task (default 5)")
    p.add_argument("--agent-max-tokens", type=positive, default=48, help="agent: max_tokens per request (default 48)")
    p.add_argument("--agent-k", type=draft_depth, default=None, metavar="K",
                   help="agent: the servers draft from their corpus K tokens deep (--k K --k-max K; default: the "
                        "server's adaptive depth)")
    p.add_argument("--fleet-requests", type=positive, default=300,
                   help="fleet: requests of the mixed load over the replicas (default 300; max_tokens: --load-max-tokens)")
    p.add_argument("--fleet-distinct", type=positive, default=100,
                   help="fleet: distinct questions among them (default 100)")
    p.add_argument("--timeout", type=float_above(0, strict=True), default=1800.0,
                   help="most seconds per load/crash run (default 1800)")
    add_threads_arg(p)
    p.add_argument("--work-dir", default=None, help="keep logs and corpora here (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write every raw figure to DIR/results.json (created if missing)")
    p.set_defaults(func=cmd_bench_serve)
