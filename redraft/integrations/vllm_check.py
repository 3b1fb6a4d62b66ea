"""End-to-end check of the vLLM proposer on vLLM's CPU build (``make vllm-check``).

Serves one model with vLLM's offline ``LLM`` API on Spec-Bench questions twice, greedy, one request at a time:
without speculation, then with :class:`redraft.integrations.vllm_proposer.RedraftProposer` over a corpus frozen from
the first pass (prompt + output per question, as ``redraft freeze`` writes it). Prints tokens/s both ways, vLLM's
own acceptance counters (drafts, draft tokens, accepted tokens, mean acceptance length = 1 + accepted / drafts)
and whether the output ids are identical. Each pass runs in its own process (a fresh vLLM engine).

Exit status: 0 identical ids on every question; 1 some differ; 2 vLLM could not run (the reason is printed).
Run it with the vLLM environment's python and this checkout on PYTHONPATH:
``python -m redraft.integrations.vllm_check --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from redraft.io.atomic import write_json

PROPOSER = "redraft.integrations.vllm_proposer.RedraftProposer"
QUESTIONS = Path(__file__).resolve().parent.parent / "data" / "spec_bench_question.jsonl"
# A small shared CPU: one OpenMP thread, no core pinning, 1 GiB of KV cache, the engine in this process (no busy
# engine-core process competing for the second core). Any of them set in the environment wins.
CPU_DEFAULTS = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def run_pass(args) -> dict:
    """One vLLM engine, one pass over the questions: {"prompts", "outputs", "seconds", "tokens", "spec"}."""
    from vllm import LLM, SamplingParams

    from redraft.io.freeze import read_prompts
    from redraft.io.prompts import encode_prompt

    spec = None
    if args.k:
        spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.n,
              enforce_eager=True, disable_log_stats=False, speculative_config=spec, seed=0)
    tok = llm.get_tokenizer()
    prompts = []
    for q in read_prompts(args.questions)[:args.n]:
        prompts.append(encode_prompt(tok, q))  # the same ids `redraft run` gives the question
    sp = SamplingParams(temperature=0.0, max_tokens=args.ngen, ignore_eos=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up: first-call costs stay out of the timing
    before = _spec_counters(llm)
    outputs, t0 = [], time.perf_counter()
    if args.batch:
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in res]
    else:
        for p in prompts:
            res = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
            outputs.append(list(res[0].outputs[0].token_ids))
    seconds = time.perf_counter() - t0
    after = _spec_counters(llm)
    spec_stats = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    return {"prompts": prompts, "outputs": outputs, "seconds": seconds,
            "tokens": sum(len(o) for o in outputs), "spec": spec_stats}


def _spec_counters(llm) -> dict:
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
    out = run_pass(args)
    write_json(args.result, out, indent=None)  # complete or absent: the parent reads it once this exits
    return 0


def spawn(args, k: int, result: Path, env: dict) -> dict | None:
    cmd = [sys.executable, "-m", "redraft.integrations.vllm_check", "--child", "--result", str(result),
           "--k", str(k), "--model", args.model, "--questions", str(args.questions), "--n", str(args.n),
           "--ngen", str(args.ngen), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    if args.batch:
        cmd.append("--batch")
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
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens for the replay pass (default 8)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batch", action="store_true", help="submit all questions at once (default: one at a time)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the corpus, results and logs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
    plain = spawn(args, 0, work / "plain.json", env)
    if plain is None:
        return 2
    from redraft.io.freeze import append_spans

    corpus = work / "corpus.txt"
    corpus.unlink(missing_ok=True)
    append_spans(corpus, [pr + out for pr, out in zip(plain["prompts"], plain["outputs"], strict=True)])
    env_replay = {**env, "REDRAFT_DRAFT_CORPUS": str(corpus)}
    replay = spawn(args, args.k, work / "replay.json", env_replay)
    if replay is None:
        return 2
    return report(plain, replay, args, corpus)


def report(plain: dict, replay: dict, args, corpus: Path) -> int:
    """Print the figures; 0 when every question's ids are identical, else 1."""
    same = [a == b for a, b in zip(plain["outputs"], replay["outputs"], strict=True)]
    tps_plain = plain["tokens"] / plain["seconds"]
    tps_replay = replay["tokens"] / replay["seconds"]
    s = replay["spec"]
    drafts, drafted, accepted = (s.get(k, 0) for k in SPEC_COUNTERS)
    mal = 1 + accepted / drafts if drafts else float("nan")
    threads = os.environ.get("OMP_NUM_THREADS", CPU_DEFAULTS["OMP_NUM_THREADS"])
    print(f"vllm-check: model {args.model}, {len(same)} Spec-Bench questions x {args.ngen} tokens, greedy, "
          f"{'batched' if args.batch else 'one request at a time'}, dtype {args.dtype}, {threads} thread(s)")
    print(f"  without speculation : {plain['tokens']} tokens in {plain['seconds']:.2f} s = {tps_plain:.1f} tokens/s")
    print(f"  redraft proposer K={args.k}: {replay['tokens']} tokens in {replay['seconds']:.2f} s = "
          f"{tps_replay:.1f} tokens/s ({tps_replay / tps_plain:.2f}x), corpus {corpus}")
    print(f"  vLLM spec decode: {drafts} drafts, {drafted} draft tokens, {accepted} accepted "
          f"({100 * accepted / drafted if drafted else 0:.1f}%), mean acceptance length {mal:.2f}")
    print(f"  identical ids: {sum(same)}/{len(same)}")
    for i, ok in enumerate(same):
        if not ok:
            a, b = plain["outputs"][i], replay["outputs"][i]
            j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"  question {i}: first difference at output token {j} ({a[j:j + 4]} vs {b[j:j + 4]})")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
