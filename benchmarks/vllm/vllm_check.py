"""End-to-end check of the vLLM proposer on vLLM's CPU build (``make vllm-check``).

Serves one model with vLLM's offline ``LLM`` API on Spec-Bench questions twice, greedy, one request at a time (or
all at once with ``--batch``): without speculation, then with :class:`redraft.integrations.vllm_proposer.RedraftProposer`
over a corpus frozen from the first pass (prompt + output per question, as ``redraft freeze`` writes it). Each
engine runs two question sets: the replayed ones (the corpus holds their answers) and as many novel ones (the next
questions of the file, not in the corpus). Prints tokens/s both ways per set, vLLM's own acceptance counters
(drafts, draft tokens, accepted tokens, mean acceptance length = 1 + accepted / drafts) and whether the output ids
are identical. Each engine runs in its own process (a fresh vLLM engine); ``--processes P`` starts each engine P
times, alternating (plain, proposer, plain, ...), and compares the medians over processes: on a shared CPU a fresh
process's steps can run faster or slower than another's for the whole of its life, which rounds within one
process do not average out (Measurements: docs/measurements.md#benchmarks-vllm-vllm_check).

The proposer drafts under the cost-aware policy with the cost curve of vLLM's step measured by the plain engine
after its passes (:func:`measure_step_curve`: decode steps over 1..64 rows fitted as a line, REDRAFT_COST_CURVE for the proposer),
unless ``--cost-curve FILE`` gives one or ``--no-policy`` asks for the fixed depth K.

Exit status: 0 identical ids on every question; 1 some differ; 2 vLLM could not run (the reason is printed).
Run it from the repository root with the vLLM environment's python and this checkout on PYTHONPATH:
``PYTHONPATH=$PWD ../vllm-venv/bin/python benchmarks/vllm/vllm_check.py --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redraft
from redraft.io.atomic import write_json
from redraft.pricing.fit import fit_step_curve

PROPOSER = "redraft.integrations.vllm_proposer.RedraftProposer"
QUESTIONS = Path(redraft.__file__).resolve().parent / "data" / "spec_bench_question.jsonl"  # the bundled copy
# A small shared CPU: one OpenMP thread, no core pinning, 1 GiB of KV cache, the engine in this process (no busy
# engine-core process competing for the second core). Any of them set in the environment wins.
CPU_DEFAULTS = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


# Rows per step at which the plain engine times vLLM's decode step (the proposer's cost curve); beyond the last
# one the curve extends with its last slope.
STEP_ROWS = (1, 2, 4, 8, 16, 32, 64)


def run_engine(args) -> dict:
    """One vLLM engine: the replayed questions, then the novel ones, then (``--cost-out``) the step curve.

    Returns {"replay": pass, "novel": pass, "curve": {"sizes", "costs", "seconds"} or None}, each pass as
    :func:`run_pass` returns it.
    """
    from vllm import LLM, SamplingParams

    from redraft.io.freeze import read_prompts
    from redraft.io.prompts import encode_prompt

    spec = None
    if args.k:
        spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=max(args.n, STEP_ROWS[-1]), enforce_eager=True, disable_log_stats=False,
              speculative_config=spec, seed=0)
    tok = llm.get_tokenizer()
    questions = read_prompts(args.questions)
    prompts = [encode_prompt(tok, q) for q in questions[:2 * args.n]]  # the same ids `redraft run` gives them
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up: first-call costs stay out of the timing
    out = {"replay": run_rounds(llm, prompts[:args.n], args),
           "novel": run_rounds(llm, prompts[args.n:], args) if args.novel else None, "curve": None}
    if args.cost_out:
        out["curve"] = measure_step_curve(llm, prompts[0])
    return out


def measure_step_curve(llm, prompt: list[int], rows=STEP_ROWS, steps=(4, 20), repeats: int = 2) -> dict:
    """The cost curve of this engine's decode step, fitted as C(T) = a + b T: {"sizes", "costs", "fit", "seconds"}.

    For each T in ``rows``, T copies of ``prompt`` (its first 16 ids: a short prefill) are generated for steps[0]
    and steps[1] tokens (EOS ignored); the difference of the two wall times (the faster of ``repeats``), over the
    steps between them, is one decode step over T rows, prefill and start-up cancelled out. A verify step over T rows
    of one request costs about the same (the same weights pass over T rows). Single differences are noisy on a
    shared machine (some come out negative), so the curve is a robust line through them
    (:func:`redraft.pricing.fit.fit_step_curve`):
    costs c(n) = C(1 + n) / C(1) at sizes n = T - 1.
    """
    from vllm import SamplingParams

    prompt = prompt[:16]
    seconds = []
    for t in rows:
        best = []
        for m in steps:
            sp = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}] * t, sp, use_tqdm=False)
                runs.append(time.perf_counter() - t0)
            best.append(min(runs))
        seconds.append((best[1] - best[0]) / (steps[1] - steps[0]))
    return fit_step_curve(rows, seconds)


def run_rounds(llm, prompts: list[list[int]], args) -> dict:
    """:func:`run_pass` ``args.rounds`` times on the same engine: the first round's pass, with "seconds" the median
    round's and "round_seconds" every round's (a single pair of runs swings by +-10% on a shared CPU).

    Raises:
        RuntimeError: a later round's outputs differ from the first's (greedy decoding must repeat itself).
    """
    passes = [run_pass(llm, prompts, args) for _ in range(max(1, args.rounds))]
    first = median_pass(passes, "a repeated round")
    first["round_seconds"] = [round(p["seconds"], 3) for p in passes]
    return first


def median_pass(passes: list[dict], which: str) -> dict:
    """The first of several passes over the same questions, with "seconds" their median.

    Raises:
        RuntimeError: a later pass's outputs differ from the first's (greedy decoding must repeat itself); the
            message says ``which`` pass did.
    """
    if any(p["outputs"] != passes[0]["outputs"] for p in passes[1:]):
        raise RuntimeError(f"vllm-check: {which} gave other outputs than the first")
    return dict(passes[0], seconds=statistics.median(p["seconds"] for p in passes))


def run_pass(llm, prompts: list[list[int]], args) -> dict:
    """One pass over ``prompts``: {"prompts", "outputs", "seconds", "tokens", "spec"}."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.ngen, ignore_eos=False)
    before = spec_counters(llm)
    outputs, t0 = [], time.perf_counter()
    if args.batch:
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in res]
    else:
        for p in prompts:
            res = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
            outputs.append(list(res[0].outputs[0].token_ids))
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)
    spec_stats = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    return {"prompts": prompts, "outputs": outputs, "seconds": seconds,
            "tokens": sum(len(o) for o in outputs), "spec": spec_stats}


def merge_processes(runs: list[dict]) -> dict:
    """One engine's results over several processes (each as :func:`run_engine` returns it) as one.

    Per question set: the first process's pass, with "seconds" the median over processes of each one's (median
    round) seconds, "process_seconds" each one's, and "round_seconds" every round of every process. vLLM's counters
    are the first process's.

    Raises:
        RuntimeError: a later process's outputs differ from the first's (greedy decoding must repeat itself).
    """
    merged = dict(runs[0])
    for name in ("replay", "novel"):
        passes = [r.get(name) for r in runs]
        if any(p is None for p in passes):
            continue
        first = median_pass(passes, f"another process on the {name} set")
        first["process_seconds"] = [round(p["seconds"], 3) for p in passes]
        first["round_seconds"] = [s for p in passes for s in p.get("round_seconds", [p["seconds"]])]
        merged[name] = first
    return merged


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters of ``llm`` so far ({name: value} for SPEC_COUNTERS that it reports)."""
    totals: dict = {}
    for m in llm.get_metrics():
        for name in SPEC_COUNTERS:
            if m.name in (name, name + "_total") and hasattr(m, "value"):
                totals[name] = totals.get(name, 0) + m.value
    return totals


def child(args) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:
        print(f"vllm-check: vLLM cannot be imported in {sys.executable} ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    out = run_engine(args)
    write_json(args.result, out, indent=None)  # complete or absent: the parent reads it once this exits
    return 0


def spawn(args, k: int, result: Path, env: dict, cost_out: Path | None = None) -> dict | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--result", str(result),
           "--k", str(k), "--model", args.model, "--questions", str(args.questions), "--n", str(args.n),
           "--ngen", str(args.ngen), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--rounds", str(args.rounds)]
    if args.batch:
        cmd.append("--batch")
    if not args.novel:
        cmd.append("--no-novel")
    if cost_out is not None:
        cmd += ["--cost-out", str(cost_out)]
    label = f"with the redraft proposer (K={k})" if k else "without speculation"
    print(f"vllm-check: pass {label} ...", file=sys.stderr, flush=True)
    with open(result.with_suffix(".log"), "w") as logf:
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not result.exists():
        tail = result.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-15:]
        why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
        print(f"vllm-check: vLLM could not run the pass {label} (exit {rc}): {why.strip()}\n"
              f"  full log: {result.with_suffix('.log')}", file=sys.stderr)
        return None
    return json.loads(result.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vllm_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (redraft's converted default)")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="Spec-Bench JSONL (default: the bundled one)")
    p.add_argument("--n", type=int, default=10, help="questions (default 10)")
    p.add_argument("--ngen", type=int, default=128, help="max new tokens per question (default 128)")
    p.add_argument("--k", type=int, default=32, help="num_speculative_tokens for the proposer (default 32)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="vLLM's max_model_len: prompt + output tokens per request (default 2048)")
    p.add_argument("--batch", action="store_true", help="submit all questions at once (default: one at a time)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over each question set per engine process; times are the median round's (default 1; "
                        "rounds share a process, so they do not average out the process's own speed: see "
                        "--processes)"),
    p.add_argument("--processes", type=int, default=1,
                   help="processes per engine, alternating plain and proposer; times are the median process's "
                        "(default 1; a fresh process can run ~10%% faster or slower for its whole life on a shared "
                        "CPU: use 3 to compare within a few %%)")
    p.add_argument("--no-novel", dest="novel", action="store_false",
                   help="skip the novel-text pass (the next --n questions, not in the corpus)")
    p.add_argument("--no-policy", action="store_true",
                   help="the proposer's fixed depth K and Colibri's guards instead of the cost-aware policy")
    p.add_argument("--cost-curve", type=Path, default=None,
                   help="the step's cost curve for the proposer (JSON {sizes, costs}); default: measured by the "
                        "plain engine after its passes")
    p.add_argument("--workdir", type=Path, default=None, help="keep the corpus, results and logs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cost-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("rounds", "processes", "n", "ngen") + (() if args.child else ("k",)):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: expected an integer >= 1")
    for flag in ("questions", "cost_curve"):
        if getattr(args, flag) is not None and not getattr(args, flag).is_file():
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no such file")
    if args.child:
        args.k = args.k or None
        return child(args)
    if not (Path(args.model) / "config.json").is_file():
        print(f"vllm-check: --model {args.model}: not a Hugging Face model directory (no config.json)",
              file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="redraft-vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for k, v in CPU_DEFAULTS.items():
        env.setdefault(k, v)
    measure = None if args.no_policy or args.cost_curve else work / "cost.json"
    plain = spawn(args, 0, work / "plain.json", env, cost_out=measure)
    if plain is None:
        return 2
    plains = [plain]
    env_policy = {"REDRAFT_POLICY": "0"} if args.no_policy else {"REDRAFT_POLICY": "1"}
    if not args.no_policy:
        curve_file = args.cost_curve or work / "step-curve.json"
        if measure is not None:
            write_json(curve_file, {k: plain["curve"][k] for k in ("sizes", "costs")}, indent=None)
        env_policy["REDRAFT_COST_CURVE"] = str(curve_file)
    from redraft.io.freeze import append_spans

    corpus = work / "corpus.txt"
    corpus.unlink(missing_ok=True)
    first = plain["replay"]
    append_spans(corpus, [pr + out for pr, out in zip(first["prompts"], first["outputs"], strict=True)])
    env_replay = {**env, **env_policy, "REDRAFT_DRAFT_CORPUS": str(corpus)}
    spec = spawn(args, args.k, work / "replay.json", env_replay)
    if spec is None:
        return 2
    specs = [spec]
    for i in range(2, args.processes + 1):  # alternate, so a slow stretch of the machine hits both engines
        for runs, k, name, run_env in ((plains, 0, "plain", env), (specs, args.k, "replay", env_replay)):
            runs.append(spawn(args, k, work / f"{name}-{i}.json", run_env))
            if runs[-1] is None:
                return 2
    try:
        plain, spec = merge_processes(plains), merge_processes(specs)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    summary = {"model": args.model, "questions": args.n, "ngen": args.ngen, "k": args.k, "batch": args.batch,
               "rounds": args.rounds, "processes": args.processes,
               "policy": not args.no_policy, "dtype": args.dtype,
               "threads": env.get("OMP_NUM_THREADS"), "step_curve": plain.get("curve"), "passes": {}}
    rc = 0
    for name in ("replay", "novel"):
        if plain.get(name) is None or spec.get(name) is None:
            continue
        figures = report(name, plain[name], spec[name], args, corpus)
        summary["passes"][name] = figures
        rc = rc or (0 if figures["identical"] == figures["questions"] else 1)
    write_json(work / "summary.json", summary, indent=1)
    print(f"  raw figures: {work / 'summary.json'}")
    return rc


def report(name: str, plain: dict, spec: dict, args, corpus: Path) -> dict:
    """Print one question set's figures; return them (tokens/s, speedup, vLLM's counters, identical ids)."""
    same = [a == b for a, b in zip(plain["outputs"], spec["outputs"], strict=True)]
    tps_plain = plain["tokens"] / plain["seconds"]
    tps_spec = spec["tokens"] / spec["seconds"]
    s = spec["spec"]
    drafts, drafted, accepted = (s.get(k, 0) for k in SPEC_COUNTERS)
    mal = 1 + accepted / drafts if drafts else float("nan")
    threads = os.environ.get("OMP_NUM_THREADS", CPU_DEFAULTS["OMP_NUM_THREADS"])
    how = f"K={args.k}, " + ("fixed depth" if args.no_policy else "policy")
    print(f"vllm-check {name}: model {args.model}, {len(same)} Spec-Bench questions x {args.ngen} tokens, greedy, "
          f"{'batched' if args.batch else 'one request at a time'}, dtype {args.dtype}, {threads} thread(s)"
          + (f", corpus {corpus}" if name == "replay" else ", not in the corpus"))
    print(f"  without speculation : {plain['tokens']} tokens in {plain['seconds']:.2f} s = {tps_plain:.1f} tokens/s")
    print(f"  redraft proposer ({how}): {spec['tokens']} tokens in {spec['seconds']:.2f} s = "
          f"{tps_spec:.1f} tokens/s ({tps_spec / tps_plain:.2f}x)")
    if plain.get("process_seconds") and len(plain["process_seconds"]) > 1:
        print(f"  processes (median taken): without {plain['process_seconds']} s, proposer "
              f"{spec['process_seconds']} s")
    if plain.get("round_seconds") and len(plain["round_seconds"]) > 1:
        print(f"  rounds: without {plain['round_seconds']} s, proposer {spec['round_seconds']} s")
    print(f"  vLLM spec decode{' (first process)' if spec.get('process_seconds') else ''}: {drafts} drafts, {drafted} draft tokens, {accepted} accepted "
          f"({100 * accepted / drafted if drafted else 0:.1f}%), mean acceptance length {mal:.2f}")
    print(f"  identical ids: {sum(same)}/{len(same)}")
    for i, ok in enumerate(same):
        if not ok:
            a, b = plain["outputs"][i], spec["outputs"][i]
            j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"  question {i}: first difference at output token {j} ({a[j:j + 4]} vs {b[j:j + 4]})")
    return {"questions": len(same), "identical": sum(same), "plain_tokens": plain["tokens"],
            "plain_seconds": round(plain["seconds"], 3), "spec_tokens": spec["tokens"],
            "spec_seconds": round(spec["seconds"], 3), "speedup": round(tps_spec / tps_plain, 3),
            "plain_round_seconds": plain.get("round_seconds"), "spec_round_seconds": spec.get("round_seconds"),
            "plain_process_seconds": plain.get("process_seconds"),
            "spec_process_seconds": spec.get("process_seconds"),
            "drafts": drafts, "draft_tokens": drafted, "accepted": accepted}

if __name__ == "__main__":
    sys.exit(main())
