"""Schema fuzzing of ``redraft serve`` (``make fuzz-server``): Schemathesis generates requests from the served
``/openapi.json`` and the run fails on any 5xx answer or crash.

Starts ``python -m redraft serve`` on a tiny random-weight model (tests/serverkit.py's: word-level tokenizer, 64 ids,
640-token context, so generations are quick) on a free 127.0.0.1 port, runs
``schemathesis run URL/openapi.json --checks not_a_server_error --max-examples N``, stops the server and exits with
Schemathesis' status (0: no server error in any generated request).

Prints, from the server's access log, how many requests each route answered with each status (a response
schema is checked only on the statuses that occur).

Usage: python benchmarks/serve/fuzz_server.py [--max-examples N] [--checks LIST]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# no 5xx; each response's status, content type and body as /openapi.json documents them
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_table(log: Path) -> str:
    """Requests per route and HTTP status, from the access-log lines (``"POST /v1/completions" 200 ...``)."""
    counts: Counter = Counter()
    for m in re.finditer(r'"([A-Z]+) ([^ "?]+)[^"]*" (\d{3}) ', log.read_text(errors="replace")):
        path = re.sub(r"/v1/responses/[^/]+$", "/v1/responses/{id}", m.group(2))
        counts[(f"{m.group(1)} {path}", m.group(3))] += 1
    routes = sorted({r for r, _ in counts})
    codes = sorted({c for _, c in counts})
    rows = [f"{'route':34}" + "".join(f"{c:>7}" for c in codes)]
    rows += [f"{r:34}" + "".join(f"{counts[(r, c)]:>7}" for c in codes) for r in routes]
    rows.append(f"{'all':34}" + "".join(f"{sum(n for (_, k), n in counts.items() if k == c):>7}" for c in codes))
    return "requests by route and status (the server's access log):\n" + "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=50, help="generated requests per operation (default 50)")
    ap.add_argument("--checks", default=CHECKS, help=f"Schemathesis checks (default {CHECKS})")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import conftest  # noqa: F401  (first: it defines what serverkit imports from it, then imports serverkit)
    from serverkit import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="redraft-fuzz-"))
    model = save_tiny_model(work / "model")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log = open(work / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "redraft", "serve", "--model", str(model), "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print((work / "server.log").read_text(), file=sys.stderr)
                    return 2
                time.sleep(0.5)
        st = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
        cmd = [st, "run", f"{base}/openapi.json", "--checks", args.checks, "--max-examples",
               str(args.max_examples), "--workers", "1", "--request-timeout", "120"]
        print("$ " + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env, cwd=work)  # its cache directory goes there, not into the checkout
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    print(status_table(work / "server.log"))
    if rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"server log: {work / 'server.log'}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
