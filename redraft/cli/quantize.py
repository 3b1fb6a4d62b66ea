"""``redraft quantize``: a GGUF model rewritten in another quantization type by llama.cpp's quantizer, once, into the
cache (:mod:`redraft.runtimes.llamacpp.quantize`), then probed: which kernels llama.cpp runs it with here and whether
they are batch-invariant (:mod:`redraft.runtimes.llamacpp.probe`)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from redraft.runtimes.llamacpp.quantize import QUANT_TYPES, QuantizeError, check_source, quantize


def register(subparsers) -> argparse.ArgumentParser:
    """Register ``quantize``; it sets ``func(args) -> int``."""
    p = subparsers.add_parser(
        "quantize", help="write a GGUF model in another quantization type (llama.cpp's quantizer), for --runtime "
                         "llama.cpp",
        description="Write MODEL (a .gguf file; default: the bundled SmolLM2) in another quantization type with "
                    "llama.cpp's own quantizer, into redraft's cache (or --out), and print the new file's path. "
                    "Single types (q4_0, q8_0, iq4_nl, ...) are written for every tensor, output layer included; "
                    "K-quant mixes (q4_k_m, ...) as llama.cpp chooses them. A copy made before is reused. The new "
                    "file is then probed in a child process: the kernels llama.cpp runs it with here, their "
                    "one-row step and whether verify rows equal one-row rows. Needs the llama extra (make llama).",
        epilog="On x86, q4_0 and iq4_nl are repacked by llama.cpp into layouts whose batched rows are cheap and "
               "batch-invariant: replays run fastest there (docs/llama-cpp.md). Compare against llama.cpp's plain "
               "decoding of the same file.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the .gguf file to requantize (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--type", "-t", required=True, type=str.lower, choices=tuple(QUANT_TYPES), metavar="TYPE",
                   help=f"target type, one of {', '.join(QUANT_TYPES)}")
    p.add_argument("--out", "-o", default=None, metavar="FILE",
                   help="write here instead of <cache>/quantized/ (REDRAFT_CACHE sets the cache)")
    p.add_argument("--force", action="store_true", help="write again even if the file exists")
    p.add_argument("--no-probe", action="store_true", help="skip the kernel probe of the new file")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Quantize, report the path (stdout) and the probe's verdict (stderr). Exit status 1 on bad input or a failed
    quantization or probe."""
    from redraft.io.loading import default_model_path

    src = str(args.model) if args.model else str(default_model_path())
    try:
        check_source(src, args.type)
    except QuantizeError as e:
        print(f"redraft quantize: error: {e}", file=sys.stderr)
        return 1
    from redraft.runtimes.llamacpp.lib import LlamaCppError

    t0 = time.perf_counter()
    try:
        path, made = quantize(src, args.type, args.out, threads=args.threads, force=args.force)
    except (QuantizeError, LlamaCppError) as e:
        print(f"redraft quantize: error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(path) / 2 ** 20
    how = f"written in {time.perf_counter() - t0:.1f} s" if made else "made before; reused (--force writes again)"
    print(f"redraft quantize: {os.path.basename(src)} as {args.type}: {path} ({size:.1f} MiB, {how})", file=sys.stderr)
    if not args.no_probe:
        from redraft.runtimes.llamacpp.probe import ProbeFailed, settle

        try:
            v = settle(path, threads=args.threads or os.cpu_count() or 1)
        except ProbeFailed as e:
            print(f"redraft quantize: error: llama.cpp cannot run {path} here: {e}", file=sys.stderr)
            return 1
        chosen = next((p for p in v.probes if p["config"] == {"extra_bufts": v.config.extra_bufts,
                                                                "tiled_matmul": v.config.tiled_matmul}), None)
        step = f", one-row step {chosen['step_ms']:.1f} ms" if chosen else ""
        print(f"redraft quantize: llama.cpp runs it with {v.config.describe()}{step}; verify rows "
              f"{'equal one-row rows (batch-invariant)' if v.invariant else 'differ from one-row rows (exact mode settles near ties)'}",
              file=sys.stderr)
    print(path)
    return 0
