"""The price of a verify row on llama.cpp per weight type, in one run: which type replays fastest, exactly.

For the bundled SmolLM2 GGUF and copies of it in other types written by llama.cpp's quantizer (``redraft
quantize``), each loaded with the kernels the load probe chose (redraft/runtimes/llamacpp/probe.py), on this build,
CPU and thread count:

- plain tokens/s: one-row forwards after a 128-token prefix (median of 64);
- c(S): an S-row forward with logits for every row over a one-row forward, after the same prefix (each sample timed
  against the one-row forwards around it, sizes in random order, median of ``--repeats``);
- batch invariance: every row of batches of 2..9, 12, 13, 16 and 17 rows (4-row groups and their remainders)
  against the same tokens fed one at a time, and the largest relative change where a row differs;
- the replay ceiling: plain decoding's time (the prompt's forward, then ``--answer`` one-row steps) over one forward
  of ``--prompt`` + ``--answer`` tokens from an empty cache (a replay verified in one forward can go no faster).

Usage: ``python benchmarks/ceiling/llama_types.py --threads 2 --out docs/bench/llama-types`` (needs the llama extra;
the copies are written once into redraft's cache). ``GGML_CPU_TILED_MM=0`` is set for the whole run: ggml reads it
once per process, and only K-quant files take that kernel (the probe turns it off for them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # before llama.cpp loads: see the module docstring

TYPES = ("bundled", "q4_0", "iq4_nl", "q8_0", "q5_0", "f16", "bf16", "q4_k_m")
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCHES = (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17)


def cpu_name() -> str:
    """The CPU's model name and whether it has AMX (figures are per CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    amx = "AMX" if " amx_int8" in flags else "no AMX"
    avx = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")
    return f"{name} ({avx}, {amx}, {os.cpu_count()} CPUs)"


def measure(path: str, threads: int, repeats: int, prompt: int, answer: int) -> dict:
    """One file's figures (see the module docstring)."""
    from redraft.pricing.measure import ratios, time_forwards
    from redraft.runtimes.llamacpp.probe import batch_report
    from redraft.runtimes.llamacpp.target import LlamaCppTarget

    target = LlamaCppTarget(path, n_ctx=1024, n_threads=threads)
    try:
        ids = [(31 * i + 7) % target.vocab_size for i in range(128 + 64)]
        target.reset()
        target.forward(ids[:128])
        steps = []
        for t in ids[128:]:
            t0 = time.perf_counter()
            target.forward([t])
            steps.append(time.perf_counter() - t0)
        step = statistics.median(steps)
        samples = time_forwards(target, SIZES, prefix_ids=ids[:128], repeats=repeats)
        c = {s: statistics.median(v) for s, v in ratios(samples).items()}
        report = batch_report(target, batches=BATCHES, prefix=64)
        whole = [(17 * i + 3) % target.vocab_size for i in range(prompt + answer)]
        full, pre = [], []
        for _ in range(3):
            target.reset()
            t0 = time.perf_counter()
            target.forward(whole[:prompt])
            pre.append(time.perf_counter() - t0)
            target.reset()
            t0 = time.perf_counter()
            target.forward(whole, n_logits=answer)
            full.append(time.perf_counter() - t0)
        # plain decoding's time (the prompt's forward, then one step a token) over one forward of prompt + answer
        ceiling = (statistics.median(pre) + answer * step) / statistics.median(full)
        return {"file": os.path.basename(path), "description": target.description,
                "kernels": {"extra_bufts": target.extra_bufts, "tiled_matmul": target.tiled_matmul},
                "invariant": report["invariant"], "max_diff": report["max_diff"], "step_ms": 1e3 * step,
                "plain_tok_s": 1.0 / step, "c": c, "replay_ceiling": ceiling,
                "prompt_plus_answer_ms": 1e3 * statistics.median(full), "prompt_ms": 1e3 * statistics.median(pre)}
    finally:
        target.close()


def markdown(rows: list[dict], meta: dict) -> str:
    """The table docs/llama-cpp.md quotes."""
    head = ("| type (file) | kernels | plain tok/s | " + " | ".join(f"c({s})" for s in SIZES[1:]) +
            " | prompt + answer in one forward (ms) | replay ceiling | batch-invariant (max change where not) |")
    lines = [f"{meta['cpu']}, {meta['threads']} threads, llama-cpp-python {meta['llama_cpp_python']}; "
             f"replay ceiling: plain decoding's time over one forward of {meta['prompt']} + "
             f"{meta['answer']} tokens (plain: the prompt's forward + {meta['answer']} steps); ggml's tiled K-quant matmul off for the run", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        k = r["kernels"]
        kern = "defaults" if k["extra_bufts"] else "no repack"  # the tiled matmul is off run-wide
        inv = "yes" if r["invariant"] else "no ({:.1e})".format(max(r["max_diff"].values()))
        lines.append(f"| {r['type']} ({r['description']}) | {kern} | {r['plain_tok_s']:.1f} | "
                     + " | ".join(f"{r['c'][s]:.2f}" for s in SIZES[1:])
                     + f" | {r['prompt_plus_answer_ms']:.0f} | {r['replay_ceiling']:.1f}x | {inv} |")
    exact = [r for r in rows if r["invariant"]]
    if exact:
        best = min(exact, key=lambda r: r["prompt_plus_answer_ms"])
        lines += ["", f"Cheapest exact replay: {best['type']}, one forward of {meta['prompt']} + {meta['answer']} "
                      f"tokens in {best['prompt_plus_answer_ms']:.0f} ms ({best['replay_ceiling']:.1f}x its own plain "
                      f"decoding, {best['plain_tok_s']:.1f} tok/s plain)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma-separated from {', '.join(TYPES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    from importlib.metadata import version

    from redraft.io.loading import default_model_path
    from redraft.runtimes.llamacpp.quantize import quantize

    bundled = str(default_model_path())
    rows = []
    for name in args.types.split(","):
        path = bundled if name == "bundled" else str(quantize(bundled, name, threads=args.threads)[0])
        print(f"{name}: {path}", file=sys.stderr, flush=True)
        rows.append({"type": name, **measure(path, args.threads, args.repeats, args.prompt, args.answer)})
    meta = {"cpu": cpu_name(), "threads": args.threads, "llama_cpp_python": version("llama_cpp_python"),
            "prompt": args.prompt, "answer": args.answer, "repeats": args.repeats,
            "created": time.strftime("%Y-%m-%d %H:%M")}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
