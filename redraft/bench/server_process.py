"""A ``redraft serve`` process for the serve benchmarks, and reading its Prometheus metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of metric ``name`` whose labels include ``labels``, in Prometheus text ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


class ServerProcess:
    """``python -m redraft serve`` on a free loopback port, its stderr in ``log``; ``python``: the interpreter (default
    this one's; another environment's, e.g. redraft's own beside the vLLM environment)."""

    def __init__(self, model: str | None, log: Path, *extra: str, threads: int | None = None,
                 python: str | None = None) -> None:
        self.log, self.base = log, None
        cmd = [python or sys.executable, "-m", "redraft"] + (["--threads", str(threads)] if threads else []) + ["serve"]
        cmd += (["--model", model] if model else []) + ["--port", "0", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "a"),
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self, timeout: float = 600.0) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.findall(r"on (http://[^\s/]+)/v1", self.log.read_text(errors="replace"))
            if m:
                try:
                    if httpx.get(f"{m[-1]}/health", timeout=5).status_code == 200:
                        self.base = m[-1]
                        return self.base
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (rc {self.proc.returncode}); see {self.log}")
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the server did not start within {timeout:.0f} s; see {self.log}")

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"{self.base}/metrics", timeout=30).text

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def cpu_seconds(self) -> float:
        """CPU seconds the server process has used so far (user + system, all its threads)."""
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def page_faults(self) -> int | None:
        """Minor page faults of the server process so far (first writes to pages it had not touched; Linux's
        ``/proc/PID/stat`` field 10), None where that file is not there."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def serve_help() -> str:
    """``redraft serve --help`` of this build (which options the server has: ``--max-running`` once it batches)."""
    out = subprocess.run([sys.executable, "-m", "redraft", "serve", "--help"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, COLUMNS="200"))
    return out.stdout


def option_default(help_text: str, option: str) -> int | None:
    """The integer ``(default N)`` that ``help_text`` gives for ``option`` (commas allowed), or None."""
    m = re.search(re.escape(option) + r"\b[^\n]*?(?:\n(?!\s*--)[^\n]*?)*?default:? ([\d,]+)", help_text)
    return int(m.group(1).replace(",", "")) if m else None


def process_starter(model: str | None, work: Path, threads: int | None):
    """A ``start_server(name, args) -> (base URL, stop)`` function over :class:`ServerProcess` (log: work/NAME.log)."""
    def start(name: str, args) -> tuple[str, object]:
        srv = ServerProcess(model, work / f"{name}.log", *args, threads=threads)
        try:
            return srv.wait_ready(), srv.stop
        except BaseException:
            srv.kill()
            raise
    return start
