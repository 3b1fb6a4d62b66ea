"""``redraft demo``: the main job end to end on the bundled model.

1. Answer N Spec-Bench first turns with plain greedy decoding.
2. Freeze the prompts and answers into a corpus (the text format, loaded back through the normal path).
3. Replay the same questions with corpus (+ n-gram) drafts: same ids, far fewer forwards.
4. Run M other questions against the same corpus, interleaved with plain greedy, to show it costs nothing there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from redraft.cli.common import (
    add_model_args,
    announce_generation_config,
    check_model_or_exit,
    draft_depth,
    load_model_or_exit,
    nonneg,
    open_corpus_or_exit,
    output_file,
    positive,
    questions_or_exit,
)
from redraft.compose import SpeculationConfig, build_engine, build_policy, plain_engine
from redraft.corpus import CorpusError
from redraft.corpus.format import write_text
from redraft.decoding.runstats import RunSummary
from redraft.defaults import MAX_DRAFT_DEPTH
from redraft.io.atomic import write_json
from redraft.io.loading import cache_dir
from redraft.io.progress import Progress
from redraft.io.prompts import encode_prompt


def figures(plain: RunSummary, spec: RunSummary) -> dict:
    """Plain greedy vs drafted figures over the same questions (one question, or all of them)."""
    return {
        "tokens": spec.tokens,
        "forwards_plain": plain.forwards, "forwards_spec": spec.forwards,
        "tokens_per_forward": spec.tokens_per_forward,
        "acceptance": spec.acceptance,
        "proposed": spec.proposed, "accepted": spec.accepted,
        "tok_s_plain": plain.tokens_per_second, "tok_s_spec": spec.tokens_per_second,
        # the same tokens both ways when the outputs are identical, so this is also the wall-time ratio
        "speedup": spec.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0,
    }


def compare(questions: list[dict], plain_results: list, spec_results: list) -> tuple[list[dict], dict]:
    """Per-question rows and the total for paired plain / drafted GenerationResults of ``questions``."""
    rows = []
    for q, b, s in zip(questions, plain_results, spec_results, strict=True):
        plain, spec = RunSummary.of([b]), RunSummary.of([s])
        rows.append({"question_id": q["question_id"], **figures(plain, spec),
                     "corpus_proposed": spec.source("corpus").proposed,
                     "corpus_accepted": spec.source("corpus").accepted,
                     "seconds_plain": plain.seconds, "seconds_spec": spec.seconds,
                     "identical": s.output_ids == b.output_ids})
    total = {"questions": len(rows), **figures(RunSummary.of(plain_results), RunSummary.of(spec_results)),
             "identical": sum(r["identical"] for r in rows)}
    return rows, total


LEGEND = "\n".join((
    "q: Spec-Bench question id; tokens: answer tokens; fwd: forwards of plain greedy decoding (one per token);",
    "fwd+d: forwards with drafts; tok/fwd: tokens per forward with drafts; accept: share of drafted tokens accepted;",
    "tok/s, tok/s+d: tokens/s without and with drafts (wall time: it swings with the machine's load); speedup:",
    "their ratio; same: ids identical to plain greedy decoding"))


def format_table(title: str, rows: list[dict], total: dict) -> str:
    """A plain-text table: one row per question and a total row."""
    head = (f"{'q':>5} {'tokens':>6} {'fwd':>5} {'fwd+d':>5} {'tok/fwd':>7} {'accept':>6} "
            f"{'tok/s':>7} {'tok/s+d':>7} {'speedup':>7}  same")
    lines = [title, head, "-" * len(head)]
    for r in rows + [dict(total, question_id="all")]:
        same = "yes" if r["identical"] is True else ("NO" if r["identical"] is False else f"{r['identical']}/{len(rows)}")
        lines.append(f"{r['question_id']!s:>5} {r['tokens']:>6} {r['forwards_plain']:>5} {r['forwards_spec']:>5} "
                     f"{r['tokens_per_forward']:>7.2f} {100 * r['acceptance']:>5.0f}% {r['tok_s_plain']:>7.1f} "
                     f"{r['tok_s_spec']:>7.1f} {r['speedup']:>6.2f}x  {same}")
    return "\n".join(lines)


def run_demo(args) -> int:
    qs = questions_or_exit(0, args.questions + args.other, "demo")
    replay_q, other_q = qs[:args.questions], qs[args.questions:]
    # the demo reads no environment: its flags alone say how it drafts
    cfg = SpeculationConfig(k=args.k, policy=not args.no_policy, ngram=not args.no_ngram)
    policy_on, k = cfg.policy_on, cfg.depth
    check_model_or_exit(args.model)
    loaded = load_model_or_exit(args.model, dtype=args.dtype, runtime=args.runtime, n_ctx=args.n_ctx)
    announce_generation_config(loaded)
    chat = False if args.no_chat else None
    plain = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)

    def encode(q):
        return encode_prompt(loaded.tokenizer, q["turns"][0], chat=chat)

    plain.generate(encode(qs[0]), 8)  # warm-up: first-call allocations should not land on question 1

    base = [plain.generate(encode(q), args.ngen)
            for q in Progress(replay_q, desc="1/3 plain greedy", unit="q", noun="question")]

    default_name = "corpus.txt" if loaded.runtime == "transformers" else f"corpus-{loaded.runtime}.txt"
    corpus_path = Path(args.corpus_out) if args.corpus_out else cache_dir() / "demo" / default_name
    corpus_path.parent.mkdir(parents=True, exist_ok=True)
    try:  # replaces the file at once (temporary file + rename): an interrupted demo never leaves half a corpus
        write_text(corpus_path, [r.prompt_ids + r.output_ids for r in base])
    except CorpusError as e:
        raise SystemExit(f"redraft demo: error: {e}") from None
    corpus = open_corpus_or_exit(str(corpus_path), loaded)
    print(f"froze {len(base)} answers into {corpus_path} ({corpus.n_tokens} ids)", file=sys.stderr)

    # one policy for the whole demo: it keeps what it learned across questions, as a long-running process would
    policy = build_policy(loaded.model, max_nodes=cfg.policy_nodes) if policy_on else None

    def spec_engine():
        return build_engine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, corpus=corpus, policy=policy)

    replay = [spec_engine().generate(encode(q), args.ngen)
              for q in Progress(replay_q, desc="2/3 replay", unit="q", noun="question")]

    other_base, other = [], []
    for q in Progress(other_q, desc="3/3 other questions", unit="q", noun="question"):
        ids = encode(q)
        other_base.append(plain.generate(ids, args.ngen))  # interleaved A B A B: machine noise hits both alike
        other.append(spec_engine().generate(ids, args.ngen))

    replay_rows, replay_total = compare(replay_q, base, replay)
    drafts = f"cost-aware policy, depth <= {MAX_DRAFT_DEPTH}" if policy_on else f"K={k}"
    report = {"model": loaded.name, "runtime": loaded.runtime, "k": None if policy_on else k, "policy": policy_on, "ngen": args.ngen,
              "ngram": not args.no_ngram, "corpus": str(corpus_path), "corpus_ids": corpus.n_tokens,
              "replay": {"rows": replay_rows, "total": replay_total}}
    if policy is not None:
        report["cost_curve"] = policy.curve.to_dict()
    print(format_table(f"Replay: {len(replay_rows)} questions frozen in the corpus ({drafts})", replay_rows,
                       replay_total))
    other_rows = []
    if other_q:
        other_rows, other_total = compare(other_q, other_base, other)
        report["other"] = {"rows": other_rows, "total": other_total}
        print()
        print(format_table(f"Other questions: {len(other_rows)} not in the corpus", other_rows, other_total))
    print(f"\n{LEGEND}")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(r["identical"] for r in replay_rows + other_rows)
    if not ok:
        print("redraft demo: WARNING: some outputs differ from plain greedy", file=sys.stderr)
    return 0 if ok else 1


def register(sub) -> None:
    """Add ``demo`` to the top-level sub-parsers."""
    p = sub.add_parser("demo", help="replay 20 Spec-Bench questions from a frozen corpus and compare with greedy",
                       description="Generate answers with plain greedy decoding, freeze them, replay the same "
                                   "questions with corpus drafts, then run other questions with the same corpus. "
                                   "Prints per-question and total tokens/forward, acceptance, tok/s and speedup.")
    add_model_args(p)
    p.add_argument("--questions", type=positive, default=20, help="questions to freeze and replay (default 20)")
    p.add_argument("--other", type=nonneg, default=10, help="other questions run against the same corpus (default 10)")
    p.add_argument("--k", type=draft_depth, default=None,
                   help="fixed corpus draft depth 1..48 instead of the cost-aware policy (the default)")
    p.add_argument("--no-policy", action="store_true", help="fixed depth (--k, default 8) and guard, Colibri's way")
    p.add_argument("--no-ngram", action="store_true", help="corpus drafts only")
    p.add_argument("--corpus-out", default=None, type=output_file,
                   help="where to write the frozen corpus, replacing that file (default: <cache>/demo/corpus.txt)")
    p.add_argument("--json", default=None, metavar="PATH", type=output_file, help="also write every figure as JSON")
    p.set_defaults(func=run_demo)
