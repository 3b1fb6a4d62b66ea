"""lm-evaluation-harness through ``redraft serve``, run twice, plus a loglikelihood task checked against transformers
(the figures in docs/serving.md).

Starts ``python -m redraft serve`` (the default model, an in-memory corpus) on a free port; runs the ``lm_eval`` CLI
on tests/data/lm_eval's ``redraft_capitals`` (generate_until) twice and ``redraft_capitals_mc`` (multiple_choice)
once, with ``local-completions`` and the server's tokenizer routes (``tokenizer_backend=remote``); reads the
server's /metrics around each run (server-side seconds, forwards, tokens, corpus size); recomputes every
multiple-choice loglikelihood with transformers (one forward over context + continuation); writes JSON.

Usage (from the repository root): python benchmarks/serve/lm_eval_replay.py OUT.json [--work DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = {"server_seconds": "vllm:e2e_request_latency_seconds_sum", "forwards": "redraft:target_forwards_total",
           "generated_tokens": "vllm:generation_tokens_total", "requests": "vllm:e2e_request_latency_seconds_count"}


def scrape(base: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from redraft.bench.serve_bench import metric_value

    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {k: metric_value(text, name) for k, name in METRICS.items()}
    out["corpus_tokens"] = metric_value(text, "redraft:corpus_tokens")
    return out


def lm_eval(base: str, model: str, task: str, out: Path, env: dict) -> tuple[float, list[dict], dict]:
    exe = str(Path(sys.executable).with_name("lm_eval"))
    cmd = [exe, "--model", "local-completions", "--model_args",
           f"model={model},base_url={base}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
           "--batch_size", "4", "--tasks", task, "--include_path", "tests/data/lm_eval", "--output_path", str(out),
           "--log_samples"]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    samples = [json.loads(line) for f in glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
               for line in open(f)]
    results = json.load(open(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]))["results"][task]
    return wall, sorted(samples, key=lambda s: s["doc_id"]), results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="redraft-lm-eval-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "redraft", "serve", "--port", str(port),
                               "--enable-tokenizer-info-endpoint"], env=env,
                              stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            try:
                model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=2))["data"][0]["id"]
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit((work / "server.log").read_text()) from None
                time.sleep(0.5)
        runs = []
        for i in (1, 2):
            before = scrape(base)
            wall, samples, results = lm_eval(base, model, "redraft_capitals", work / f"gen{i}", env)
            after = scrape(base)
            delta = {k: round(after[k] - before[k], 3) for k in METRICS}
            runs.append({"wall_seconds": round(wall, 2), **delta, "corpus_tokens_after": after["corpus_tokens"],
                         "tokens_per_forward": round(delta["generated_tokens"] / max(1, delta["forwards"]), 2),
                         "exact_match": results["exact_match,city"],
                         "answers": [s["resps"][0][0] for s in samples]})
        wall, mc, results = lm_eval(base, model, "redraft_capitals_mc", work / "mc", env)
    finally:
        server.terminate()
        server.wait(30)

    import torch

    sys.path.insert(0, str(ROOT))
    from redraft.io.loading import load_model

    loaded = load_model()
    tok = loaded.tokenizer
    diffs, rows = [], []
    for s in mc:
        for arg, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            ctx, cont = arg["arg_0"], arg["arg_1"]
            whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            n = len(tok(ctx, add_special_tokens=False)["input_ids"])
            with torch.inference_mode():
                lp = torch.log_softmax(loaded.model(torch.tensor([whole])).logits[0].float(), -1)
            want = sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole)))
            got = float(resp[0][0])
            diffs.append(abs(got - want))
            rows.append({"doc_id": s["doc_id"], "continuation": cont, "server": got, "transformers": want})
    report = {"model": model, "generate_until": runs,
              "identical_samples": runs[0]["answers"] == runs[1]["answers"],
              "multiple_choice": {"wall_seconds": round(wall, 2), "acc": results["acc,none"],
                                  "max_abs_loglikelihood_diff": max(diffs), "choices": rows}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "multiple_choice"}, indent=1))
    print(f"multiple_choice: acc {results['acc,none']}, max |loglikelihood diff| {max(diffs):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
