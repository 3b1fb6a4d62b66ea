"""Novel text on llama.cpp: llama.cpp's own greedy decoding, redraft's plain decoding and three policy variants in
one process, interleaved per question, with each one's time inside and outside ``llama_decode``.

The variants: ``curve`` (the policy on the measured cost curve alone), ``loop`` (the curve corrected by the loop's
own step times, redraft.pricing.loop) and ``policy`` (loop prices and the asking budget, redraft.policy.asking:
the default). Ratio = llama.cpp's seconds over the method's per question (median over rounds), reported as the
median (min) over questions, with how many answers equal llama.cpp's own ids. Use ten questions or more on a quiet
machine: a per-question ratio moves by several percent between runs. Results: docs/llama-cpp.md, "The loop's own prices".

    OMP_NUM_THREADS=2 python benchmarks/policy/novel_variants.py --threads 2 --questions 30 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from redraft.bench.methods import LlamaCppMethod
from redraft.bench.workloads import NOVEL, ChatEncoder, item_for, round_robin
from redraft.compose import SpeculationConfig, build_engine, build_policy, load_target, plain_engine
from redraft.io.questions import load_questions
from redraft.runtimes.llamacpp.probe import Config


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ngen", type=int, default=128)
    args = ap.parse_args()
    import llama_cpp.llama_cpp as bindings  # the llama extra: after --help, which needs none

    loaded = load_target(args.model, runtime="llama.cpp", threads=args.threads, quiet=True)
    target = loaded.model
    decode = bindings.llama_decode
    spent = {"s": 0.0}

    def timed(ctx, batch):  # every llama_decode of this process, llama-cpp-python's included
        t0 = time.perf_counter()
        rc = decode(ctx, batch)
        spent["s"] += time.perf_counter() - t0
        return rc

    bindings.llama_decode = timed
    target._lib.llama_decode = timed
    eos = sorted(loaded.eos_token_ids)
    spec = SpeculationConfig()
    baseline = LlamaCppMethod("llama.cpp", str(target.path), eos, n_threads=args.threads, n_ctx=target.max_length,
                              config=Config(target.extra_bufts, target.tiled_matmul))
    loop_only = build_engine(target, spec, eos_token_ids=eos, policy=build_policy(target, max_nodes=spec.policy_nodes))
    loop_only.planner.asks = None
    plain = plain_engine(target, eos_token_ids=eos)
    methods = {
        "llama.cpp": lambda p, n: baseline.generate(p, n).output_ids,
        "plain": plain.generate,
        "curve": build_engine(target, spec, eos_token_ids=eos, policy=build_policy(
            target, max_nodes=spec.policy_nodes, learn_prices=False)).generate,
        "loop": loop_only.generate,
        "policy": build_engine(target, spec, eos_token_ids=eos,
                               policy=build_policy(target, max_nodes=spec.policy_nodes)).generate,
    }
    items = [item_for(q, ChatEncoder(loaded.tokenizer)) for q in round_robin(load_questions(), NOVEL, args.questions)]
    seconds: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    outputs: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    totals = {m: [0.0, 0.0, 0] for m in methods}  # wall, decode, tokens
    for _ in range(args.rounds):
        for it in items:
            for name, run in methods.items():
                spent["s"] = 0.0
                t0 = time.perf_counter()
                out = run(it.prompt_ids, args.ngen)
                dt = time.perf_counter() - t0
                out = getattr(out, "output_ids", out)
                seconds[name].setdefault(it.qid, []).append(dt)
                outputs[name].setdefault(it.qid, [int(t) for t in out])
                totals[name][0] += dt
                totals[name][1] += spent["s"]
                totals[name][2] += len(out)
    base = {q: statistics.median(v) for q, v in seconds["llama.cpp"].items()}
    for name in methods:
        wall, dec, toks = totals[name]
        line = f"{name:10s} {wall / toks * 1e3:.3f} ms/token, outside llama_decode {(wall - dec) / toks * 1e6:.0f} us/token"
        if name != "llama.cpp":
            ratios = sorted(base[q] / statistics.median(v) for q, v in seconds[name].items())
            same = sum(outputs[name][q] == outputs["llama.cpp"][q] for q in base)
            line += (f"; vs llama.cpp median {statistics.median(ratios):.3f} (min {ratios[0]:.3f}); "
                     f"same ids as llama.cpp {same}/{len(base)}")
        print(line)


if __name__ == "__main__":
    main()
