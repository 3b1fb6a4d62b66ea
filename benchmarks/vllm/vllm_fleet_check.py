"""A mixed fleet on one corpus directory: a ``redraft serve`` replica and a vLLM engine with redraft's proposer
learn into the same directory and replay each other's answers (``make vllm-fleet-check``).

Run from the repository root with the vLLM environment's python and this checkout on PYTHONPATH
(``PYTHONPATH=$PWD ../vllm-venv/bin/python benchmarks/vllm/vllm_fleet_check.py --model DIR --server-python
.venv/bin/python``); the server runs in redraft's own environment (``--server-python``), because vLLM pins another
transformers. In one run:

1. the server answers question set A (greedy ``/v1/completions`` on the chat-templated prompt ids), learning each
   answer into ``D``; then the vLLM engine (``REDRAFT_LEARN_CORPUS=D``) generates A, drafting from the server's
   answers once its corpus has followed the server's journal;
2. the vLLM engine answers set B first, learning into ``D``; then the server answers B from what vLLM learned;
3. a checker reads every journal and the base of ``D``: each answer is stored once (learn-once across writers),
   none is missing.

vLLM does not tell a proposer a request's ``max_tokens``: an answer vLLM cut there (not at EOS) is learned only
once it has left vLLM's batch for 64 steps, or at shutdown. So on an idle engine the server cannot replay such an
answer yet, and it stores its own copy. The check reports those answers apart ("cut by length"), and they do not
fail it.

It reports, per direction, the first answers' and the replays' generation seconds, forwards (the server's count)
or vLLM's draft acceptance, and whether each replay's text equals the other replica's answer. The two runtimes
compute in fp32 in their own ways, so a near tie can still split them: that counts as "differs", not as a loss.

Exit status: 0 every answer stored exactly once and every replay drafted from the other's answer (answers vLLM cut
by length excepted, see above); 1 otherwise; 2 vLLM or the server could not run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_check import CPU_DEFAULTS, PROPOSER, QUESTIONS, spec_counters  # benchmarks/vllm/vllm_check.py, beside this

FOLLOW_WAIT = 2.0  # seconds a replica may take to see the other's answer (the corpus follows every 0.2 s)


def server_answer(base: str, prompt: list[int], ngen: int) -> dict:
    """One greedy completion of ``prompt`` (token ids) on the server: {"text", "seconds", "forwards", "tokens"}."""
    import httpx

    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": ngen, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    got = r.json()
    st = got.get("redraft", {})
    return {"text": got["choices"][0]["text"], "seconds": st.get("generation_seconds"),
            "forwards": st.get("forwards"), "tokens": got["usage"]["completion_tokens"]}


def vllm_answer(llm, prompt: list[int], ngen: int) -> dict:
    """One greedy generation on the vLLM engine: {"ids", "text", "seconds", "tokens", "spec"} (vLLM's counters)."""
    from vllm import SamplingParams

    before = spec_counters(llm)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=ngen),
                       use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)
    out = res[0].outputs[0]
    return {"ids": list(out.token_ids), "text": out.text, "seconds": seconds, "tokens": len(out.token_ids),
            "spec": {k.split(":")[-1]: after.get(k, 0) - before.get(k, 0) for k in after}}


def stored_spans(d: Path) -> list[tuple[int, ...]]:
    """Every span of corpus directory ``d`` (the base and every journal), as tuples."""
    from redraft.corpus.directory import read_directory

    corpus, _ = read_directory(d)
    return [tuple(int(t) for t in s) for s in corpus.span_list()]


def count_answer(spans: list[tuple[int, ...]], prompt: list[int]) -> int:
    """How many stored spans begin with ``prompt`` followed by at least one token (one learned answer each)."""
    n = len(prompt)
    return sum(1 for s in spans if len(s) > n and list(s[:n]) == prompt)


def run(args) -> int:
    from vllm import LLM

    from redraft.bench.server_process import ServerProcess
    from redraft.io.freeze import read_prompts
    from redraft.io.prompts import encode_prompt

    work = Path(args.workdir or tempfile.mkdtemp(prefix="redraft-vllm-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    d = work / "corpus"
    print(f"vllm-fleet-check: corpus directory {d}", file=sys.stderr)
    server = ServerProcess(args.model, work / "server.log", "--corpus-dir", str(d), "--no-answer-cache", "--quiet",
                           threads=1, python=args.server_python)
    try:
        base = server.wait_ready(timeout=600)
        for k, v in CPU_DEFAULTS.items():
            os.environ.setdefault(k, v)
        os.environ["REDRAFT_LEARN_CORPUS"] = str(d)
        spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
        llm = LLM(model=args.model, dtype="float32", max_model_len=2048, max_num_seqs=4, enforce_eager=True,
                  disable_log_stats=False, speculative_config=spec, seed=0)
        prompts = [encode_prompt(llm.get_tokenizer(), q) for q in read_prompts(args.questions)[:2 * args.n]]
        a, b = prompts[:args.n], prompts[args.n:]
        vllm_answer(llm, prompts[-1][:16], 4)  # warm-up outside the timing
        rows = []
        for p in a:  # server first, then vLLM replays it
            first = server_answer(base, p, args.ngen)
            time.sleep(FOLLOW_WAIT)
            again = vllm_answer(llm, p, args.ngen)
            rows.append(("server -> vLLM", first, again))
        for p in b:  # vLLM first, then the server replays it
            first = vllm_answer(llm, p, args.ngen)
            time.sleep(FOLLOW_WAIT)
            again = server_answer(base, p, args.ngen)
            rows.append(("vLLM -> server", first, again))
    finally:
        server.stop()
    spans = stored_spans(d)
    stored = [count_answer(spans, p) for p in a + b]
    return report(rows, stored, args)


def report(rows, stored: list[int], args) -> int:
    """Print the per-direction table; the exit status (see the module doc)."""
    late = [name == "vLLM -> server" and f["tokens"] >= args.ngen for name, f, _ in rows]  # cut by length on vLLM
    ok = all(n == 1 for n, excused in zip(stored, late, strict=True) if not excused)
    for direction in ("server -> vLLM", "vLLM -> server"):
        mine = [(f, g) for name, f, g in rows if name == direction]
        first_s = statistics.median(f["seconds"] / max(1, f["tokens"]) for f, _ in mine)
        again_s = statistics.median(g["seconds"] / max(1, g["tokens"]) for _, g in mine)
        same = sum(1 for f, g in mine if f["text"] == g["text"])
        print(f"{direction}: first answers {first_s * 1e3:.1f} ms/token, replays {again_s * 1e3:.1f} ms/token "
              f"({first_s / again_s:.1f}x), replay text equal to the first answer {same}/{len(mine)}")
        for f, g in mine:
            if "forwards" in g:  # the server replayed
                detail = f"server forwards {g['forwards']} for {g['tokens']} tokens"
                drafted = g["forwards"] is not None and g["forwards"] < g["tokens"] / 2
            else:
                sp = g["spec"]
                acc, drafts = sp.get("spec_decode_num_accepted_tokens", 0), sp.get("spec_decode_num_drafts", 0)
                detail = f"vLLM drafts {drafts}, accepted {acc} of {g['tokens']} tokens"
                drafted = acc >= g["tokens"] / 2
            cut = f["tokens"] >= args.ngen
            excused = cut and direction == "vLLM -> server"
            ok = ok and (drafted or excused)
            print(f"  {f['seconds']:.3f} s -> {g['seconds']:.3f} s; {detail}"
                  f"{'; first answer cut by length' if cut else ''}{' (learned late: vLLM does not pass max_tokens to a proposer)' if excused else ''}")
    print(f"answers stored once: {sum(1 for n in stored if n == 1)}/{len(stored)} (counts {stored}; "
          f"vLLM's answers cut by length: {sum(late)})")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vllm_fleet_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (redraft's converted default)")
    p.add_argument("--server-python", required=True, help="python of redraft's environment (runs the server)")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="Spec-Bench JSONL (default: the bundled one)")
    p.add_argument("--n", type=int, default=3, help="questions per direction (default 3)")
    p.add_argument("--ngen", type=int, default=96, help="max new tokens per question (default 96)")
    p.add_argument("--k", type=int, default=32, help="num_speculative_tokens of the vLLM proposer (default 32)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the corpus and the server log here")
    args = p.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except Exception as e:
        print(f"vllm-fleet-check: vLLM cannot be imported in {sys.executable} ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    try:
        return run(args)
    except RuntimeError as e:
        print(f"vllm-fleet-check: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
