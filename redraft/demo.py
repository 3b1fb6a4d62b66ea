"""``redraft demo``: the main job end to end on the bundled model.

1. Answer N Spec-Bench first turns with plain greedy decoding.
2. Freeze the prompts and answers into a corpus (the text format, loaded back through the normal path).
3. Replay the same questions with corpus (+ n-gram) drafts: same ids, far fewer forwards.
4. Run M other questions against the same corpus, interleaved with plain greedy, to show it costs nothing there.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

from tqdm import tqdm


def spec_bench_questions() -> list[dict]:
    """Spec-Bench's 480 questions (Apache-2.0, see redraft/data/SPEC_BENCH_LICENSE) in file order."""
    text = resources.files("redraft").joinpath("data/spec_bench_question.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _row(qid, base, spec) -> dict:
    st = spec.sources
    proposed = sum(s.proposed for s in st.values())
    accepted = sum(s.accepted for s in st.values())
    return {
        "question_id": qid,
        "tokens": len(spec.output_ids),
        "forwards_plain": base.forwards, "forwards_spec": spec.forwards,
        "tokens_per_forward": spec.tokens_per_forward,
        "acceptance": accepted / proposed if proposed else 0.0,
        "proposed": proposed, "accepted": accepted,
        "corpus_proposed": st["corpus"].proposed if "corpus" in st else 0,
        "corpus_accepted": st["corpus"].accepted if "corpus" in st else 0,
        "seconds_plain": base.seconds, "seconds_spec": spec.seconds,
        "tok_s_plain": base.tokens_per_second, "tok_s_spec": spec.tokens_per_second,
        "speedup": spec.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0,
        "identical": spec.output_ids == base.output_ids,
    }


def _total(rows: list[dict]) -> dict:
    tok = sum(r["tokens"] for r in rows)
    sp, ss = sum(r["seconds_plain"] for r in rows), sum(r["seconds_spec"] for r in rows)
    fp, fs = sum(r["forwards_plain"] for r in rows), sum(r["forwards_spec"] for r in rows)
    prop, acc = sum(r["proposed"] for r in rows), sum(r["accepted"] for r in rows)
    return {
        "questions": len(rows), "tokens": tok, "forwards_plain": fp, "forwards_spec": fs,
        "tokens_per_forward": tok / fs if fs else 0.0, "acceptance": acc / prop if prop else 0.0,
        "proposed": prop, "accepted": acc,
        "tok_s_plain": tok / sp if sp else 0.0, "tok_s_spec": tok / ss if ss else 0.0,
        "speedup": sp / ss if ss else 0.0,  # same tokens both ways, so the time ratio is the tok/s ratio
        "identical": sum(r["identical"] for r in rows),
    }


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
    from redraft.cli import _load, _open_corpus
    from redraft.defaults import CORPUS_K_DEFAULT, MAX_DRAFT_DEPTH
    from redraft.policy.apply import policy_for
    from redraft.drafters import build_drafters
    from redraft.drafters.frozen_corpus import clamp_k
    from redraft.engine import Engine
    from redraft.freeze import append_spans
    from redraft.models import cache_dir, encode_prompt

    qs = spec_bench_questions()
    if args.questions + max(args.other, 0) > len(qs):
        raise SystemExit(f"redraft demo: error: only {len(qs)} questions available")
    if args.other < 0:
        raise SystemExit("redraft demo: error: --other must be >= 0")
    replay_q, other_q = qs[:args.questions], qs[args.questions:args.questions + args.other]
    policy_on = args.k is None and not args.no_policy
    k = MAX_DRAFT_DEPTH if policy_on else clamp_k(args.k if args.k is not None else CORPUS_K_DEFAULT)
    loaded = _load(args)
    tok = loaded.tokenizer
    chat = False if args.no_chat else None
    plain = Engine(loaded.model, [], eos_token_ids=loaded.eos_token_ids)
    encode = lambda q: encode_prompt(tok, q["turns"][0], chat=chat)
    plain.generate(encode(qs[0]), 8)  # warm-up: first-call allocations should not land on question 1

    base = []
    for q in tqdm(replay_q, desc="1/3 plain greedy", unit="q", file=sys.stderr):
        base.append(plain.generate(encode(q), args.ngen))

    corpus_path = Path(args.corpus_out) if args.corpus_out else cache_dir() / "demo" / "corpus.txt"
    corpus_path.parent.mkdir(parents=True, exist_ok=True)
    corpus_path.unlink(missing_ok=True)
    append_spans(corpus_path, [r.prompt_ids + r.output_ids for r in base])
    corpus = _open_corpus(str(corpus_path), loaded)
    print(f"froze {len(base)} answers into {corpus_path} ({corpus.n_tokens} ids)", file=sys.stderr)

    # one policy for the whole demo: it keeps what it learned across questions, as a long-running process would
    policy = policy_for(loaded.model) if policy_on else None

    def spec_engine():
        return Engine(loaded.model, build_drafters(corpus, k=k, ngram=not args.no_ngram, policy=policy_on),
                      eos_token_ids=loaded.eos_token_ids, max_depth=k, policy=policy)

    replay_rows = []
    for q, b in tqdm(list(zip(replay_q, base)), desc="2/3 replay", unit="q", file=sys.stderr):
        replay_rows.append(_row(q["question_id"], b, spec_engine().generate(encode(q), args.ngen)))

    other_rows = []
    for q in tqdm(other_q, desc="3/3 other questions", unit="q", file=sys.stderr):
        ids = encode(q)
        b = plain.generate(ids, args.ngen)  # interleaved A B A B: machine noise hits both alike
        other_rows.append(_row(q["question_id"], b, spec_engine().generate(ids, args.ngen)))

    drafts = "cost-aware policy, depth <= 48" if policy_on else f"K={k}"
    report = {"model": loaded.name, "k": None if policy_on else k, "policy": policy_on, "ngen": args.ngen,
              "ngram": not args.no_ngram,
              "corpus": str(corpus_path), "corpus_ids": corpus.n_tokens,
              "replay": {"rows": replay_rows, "total": _total(replay_rows)}}
    if policy is not None:
        report["cost_curve"] = policy.curve.to_dict()
    print(format_table(f"Replay: {len(replay_rows)} questions frozen in the corpus ({drafts})",
                       replay_rows, report["replay"]["total"]))
    if other_rows:
        report["other"] = {"rows": other_rows, "total": _total(other_rows)}
        print()
        print(format_table(f"Other questions: {len(other_rows)} not in the corpus", other_rows,
                           report["other"]["total"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(r["identical"] for r in replay_rows + other_rows)
    if not ok:
        print("redraft demo: WARNING: some outputs differ from plain greedy", file=sys.stderr)
    return 0 if ok else 1
