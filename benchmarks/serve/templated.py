"""Templated replays through ``redraft serve``: harness-shaped prompts that all end in the same instruction.

``python benchmarks/serve/templated.py --work DIR [--questions N] [--max-tokens T] [--out FILE.json]``

Spec-Bench questions (all categories, round-robin) are wrapped in one fixed few-shot template whose last ~15 tokens
(an instruction and "Answer:") follow every question, as evaluation harnesses write them. A fresh ``redraft serve``
(empty corpus, its defaults) answers each as a greedy ``/v1/completions`` request, then the same requests again.
Reported: tokens per forward of each pass, identical answers, and the learned corpus size after each pass (the rerun
must not store anything). Then, in this process, the second pass's drafting is compared side by side at a fixed
corpus depth (K = 48, no other source) with the longest-context lookup and with the 8-id rule alone
(``context_n=None``): tokens per forward of each, ids identical to the server's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

INSTRUCTION = "\nReply in two or three plain sentences, precisely and without any preamble.\nAnswer:"
TEMPLATE = (
    "Answer each question.\n\n"
    "Question: At what temperature does water boil at sea level?" + INSTRUCTION
    + " Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.\n\n"
    "Question: Who wrote Pride and Prejudice?" + INSTRUCTION
    + " Jane Austen wrote Pride and Prejudice; it was published in 1813.\n\n"
    "Question: {question}" + INSTRUCTION
)


def templated_prompts(n: int) -> list[str]:
    """n Spec-Bench questions (first turns, categories round-robin) inside TEMPLATE."""
    from redraft.bench.workloads import round_robin
    from redraft.io.questions import load_questions

    qs = load_questions()
    cats = list(dict.fromkeys(q["category"] for q in qs))
    return [TEMPLATE.format(question=q["turns"][0]) for q in round_robin(qs, cats, n)]


def serve_passes(prompts: list[str], max_tokens: int, work: Path, threads: int | None) -> dict:
    """Two passes of greedy completions through a fresh server; per pass: tokens, forwards, answers, corpus size."""
    import httpx

    from redraft.bench.serve_bench import ServerProcess, metric_value

    srv = ServerProcess(None, work / "serve.log", "--corpus-dir", str(work / "corpora"), threads=threads)
    passes = []
    try:
        base = srv.wait_ready()
        with httpx.Client() as c:
            for _ in range(2):
                p = {"tokens": 0, "forwards": 0, "learned": 0, "texts": [], "ids": []}
                for prompt in prompts:
                    r = c.post(f"{base}/v1/completions", timeout=1200, json={
                        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                    body = r.json()
                    p["tokens"] += body["usage"]["completion_tokens"]
                    p["forwards"] += body["redraft"]["forwards"]
                    p["learned"] += bool(body["redraft"].get("learned"))
                    p["texts"].append(body["choices"][0]["text"])
                p["corpus_tokens"] = metric_value(srv.metrics(), "redraft:corpus_tokens", tenant="default")
                passes.append(p)
    finally:
        srv.stop()
    return {"passes": passes, "corpus_dir": str(work / "corpora")}


def engine_side_by_side(prompts: list[str], max_tokens: int, corpus_dir: str) -> dict:
    """Replay each prompt in this process from the server's learned corpus at K = 48 (corpus drafts only), with
    the longest-context lookup and with the 8-id rule alone; tokens per forward and ids of each."""
    from redraft.compose import SpeculationConfig, build_drafters, engine_with
    from redraft.corpus.online import OnlineCorpus
    from redraft.io.loading import load_model

    loaded = load_model(None, quiet=True)
    corpus = OnlineCorpus(Path(corpus_dir) / "default", vocab_size=loaded.model.config.vocab_size)
    eos = sorted(loaded.eos_token_ids)
    out = {}
    for name, context_n in (("longest_context", 4096), ("eight_ids", None)):
        tokens = forwards = 0
        ids = []
        for prompt in prompts:
            p = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            drafters = build_drafters(corpus, k=48, minacc=0.0, ngram=False, context_n=context_n)
            engine = engine_with(loaded.model, drafters, SpeculationConfig(k=48, policy=False), eos_token_ids=eos)
            res = engine.generate(p, max_tokens)
            tokens += len(res.output_ids)
            forwards += res.forwards
            ids.append(res.output_ids)
        out[name] = {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / max(1, forwards),
                     "ids": ids}
    out["identical"] = sum(a == b for a, b in zip(out["longest_context"]["ids"], out["eight_ids"]["ids"],
                                                   strict=True))
    corpus.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/serve/templated.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=20, help="Spec-Bench questions (default 20)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (default torch's)")
    ap.add_argument("--work", required=True, help="directory for the server's log and corpora (created)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--from-corpus-dir", default=None, metavar="DIR",
                    help="start the server from a copy of this learned corpus directory (an earlier run's "
                         "WORK/corpora): both passes are then replays")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process side-by-side comparison")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.from_corpus_dir:
        import shutil

        shutil.copytree(args.from_corpus_dir, work / "corpora", dirs_exist_ok=True)
    prompts = templated_prompts(args.questions)
    served = serve_passes(prompts, args.max_tokens, work, args.threads)
    first, second = served["passes"]
    side = None if args.no_engine else engine_side_by_side(prompts, args.max_tokens, served["corpus_dir"])
    result = {
        "questions": len(prompts), "max_tokens": args.max_tokens,
        "serve_first_tokens_per_forward": first["tokens"] / max(1, first["forwards"]),
        "serve_second_tokens_per_forward": second["tokens"] / max(1, second["forwards"]),
        "serve_identical": sum(a == b for a, b in zip(first["texts"], second["texts"], strict=True)),
        "corpus_tokens_after_first": first["corpus_tokens"], "corpus_tokens_after_second": second["corpus_tokens"],
        "learned_first": first["learned"], "learned_second": second["learned"],
    }
    if side is not None:
        result.update(k48_longest_context_tokens_per_forward=side["longest_context"]["tokens_per_forward"],
                      k48_eight_ids_tokens_per_forward=side["eight_ids"]["tokens_per_forward"],
                      k48_identical=side["identical"])
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
