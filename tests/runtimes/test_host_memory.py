"""keep_freed_memory + prefault: a process's later allocations land on pages it already backed (counted as minor page
faults, Linux with glibc only)."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt on Linux")

CHILD = """
import json, resource, sys, torch
from redraft.runtimes.host_memory import keep_freed_memory, prefault
ok = None
if sys.argv[1] == "kept":
    ok = keep_freed_memory()
    prefault(96 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# a first request's kind of memory: many KV-sized blocks (under 1 MiB to 6 MiB), written, freed, written again
for _ in range(2):
    blocks = [torch.ones(n, dtype=torch.uint8) for n in [800_000] * 40 + [6 << 20] * 4]
    del blocks
print(json.dumps({"ok": ok, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prefaulted_heap_takes_a_first_requests_blocks_without_fresh_pages():
    pages = (40 * 800_000 + 4 * (6 << 20)) // 4096  # ~14k pages written per pass
    plain, kept = faults("plain"), faults("kept")
    assert kept["ok"] is True
    assert plain["faults"] > pages // 2, plain  # glibc's defaults: fresh pages for these blocks
    assert kept["faults"] < pages // 20, kept  # every block from pages prefault backed

