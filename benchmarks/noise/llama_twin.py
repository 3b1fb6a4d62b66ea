"""The bench's floor on llama.cpp: two identical plain decoders side by side, each question's time in one over the other.

    python benchmarks/noise/llama_twin.py [--model GGUF] [--threads T] [--questions N] [--ngen T] [--rounds R]
        [--json OUT]

Two llama.cpp contexts on the same GGUF, the same kernels and threads, each decoding with redraft's plain engine
(the same forwards, the same ids), run one after the other per question, their order swapped every round, as
``redraft bench run`` runs its methods. Whatever ratio a question shows here is not the code's: it is how far
this machine moves one question's time between two decoders that do the same work (the cache and memory placement
of each context, the host's other tenants). A per-question ratio between two methods in ``redraft bench run`` is
judged against this spread. Prints each question's ratio of medians over the rounds, then their median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled model's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--questions", type=int, default=10, help="novel questions, as the bench's novel workload")
    ap.add_argument("--ngen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()

    from redraft.bench.workloads import ChatEncoder, build_workloads
    from redraft.compose import load_target, plain_engine
    from redraft.io.questions import load_questions
    from redraft.runtimes.llamacpp.target import LlamaCppTarget

    loaded = load_target(args.model, runtime="llama.cpp", threads=args.threads, quiet=True)
    first = loaded.model
    second = LlamaCppTarget(first.path, n_ctx=first.max_length, n_threads=args.threads,
                            extra_bufts=first.extra_bufts, tiled_matmul=first.tiled_matmul)
    eos = sorted(loaded.eos_token_ids)
    items = build_workloads(load_questions(), {"novel": args.questions}, ChatEncoder(loaded.tokenizer), {})[0].items
    engines = {"A": plain_engine(first, eos_token_ids=eos), "B": plain_engine(second, eos_token_ids=eos)}
    seconds: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for item in items:
            order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
            ids = {}
            for name in order:
                t0 = time.perf_counter()
                ids[name] = engines[name].generate(list(item.prompt_ids), args.ngen).output_ids
                seconds.setdefault((item.qid, name), []).append(time.perf_counter() - t0)
            if ids["A"] != ids["B"]:
                raise SystemExit(f"q{item.qid}: the two contexts decoded different ids")
    ratios = {}
    for item in items:
        a, b = (statistics.median(seconds[(item.qid, n)]) for n in ("A", "B"))
        ratios[item.qid] = a / b
        print(f"q{item.qid}: A/B {a / b:.3f}  rounds {[round(x / y, 3) for x, y in zip(seconds[(item.qid, 'A')], seconds[(item.qid, 'B')], strict=True)]}")
    values = list(ratios.values())
    print(f"{first.description}, {args.threads} thread(s): A/B median {statistics.median(values):.3f}, "
          f"range {min(values):.3f}-{max(values):.3f} over {len(values)} questions x {args.rounds} rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": first.description, "threads": args.threads, "rounds": args.rounds,
                       "ngen": args.ngen, "ratios": ratios,
                       "seconds": {f"{q}/{n}": v for (q, n), v in seconds.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
