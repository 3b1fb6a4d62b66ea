"""Whether a llama.cpp build runs a GGUF file on this CPU, and how: probed in a child process, cached.

A llama.cpp build can die on the first decode of more than one row: ggml's AMX kernels, compiled by GCC 12 for a Xeon
with AMX without ``make llama``'s header fix (native/gcc-amx/), put a Q4_0/Q4_1/Q8_0/K-quant file's weights in an
"AMX" buffer and raise SIGILL at ``ldtilecfg`` or ``tilezero`` there (their tile configuration half written); a build
that forces those kernels on a CPU without AMX dies the same way. A crash in the process that loaded the model takes
a server or a test run down with it, so the first load of a file runs it in a child process instead (:func:`probe`):
load, a 64-token prompt in one batch, then verify-sized batches against the same tokens fed one at a time. The child
reports whether every batch row equals the row of that token alone (batch invariance, what exact mode needs to
settle nothing) and the median time of a one-row step.

:func:`settle` chooses the configuration (:class:`Config`) the parent then loads, probing once per build, CPU and
file (the verdict is cached under ``<cache>/llama-probe/``). llama.cpp's defaults come first, and when they run and are
batch-invariant nothing else is probed. Otherwise every :data:`CONFIGS` entry is: llama.cpp's extra weight buffer
types on or off (``use_extra_bufts``: repacked layouts such as ``q4_0_8x8`` / ``q4_K_8x8``, and AMX where compiled; a
repacked kernel may batch rows another way than it computes one), times ggml's tiled K-quant matmul on or off
(``GGML_CPU_TILED_MM``: from 8 rows on it computes K-quant and IQ rows another way). The fastest batch-invariant
configuration wins unless its one-row step is more than :data:`INVARIANT_SLACK` slower than the fastest one's
(:func:`choose`). Measured on SmolLM2 and Gemma 3 Q4_K_M files: extra buffers off and the tiled matmul off are
invariant, at llama.cpp's own one-row speed (docs/llama-cpp.md).

Nothing here imports llama.cpp or torch (numpy only): the child does (``redraft.runtimes.llamacpp.target``), so the parent
can decide before it loads anything that may crash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from redraft.io.atomic import write_json
from redraft.io.loading import cache_dir

log = logging.getLogger(__name__)

SCHEMA = 2  # bump when the child's measurements or the choice change meaning: older verdicts are probed again
PROBE_BATCHES = (2, 3, 4, 5, 8, 9)  # verify batch sizes compared with one-row forwards (4-row groups and remainders)
PROBE_PREFIX = 64  # prompt tokens fed as one batch first (the crash of a batched kernel shows here)
PROBE_TIMEOUT = 300.0  # seconds a child may take (loading a large file included)
TILED_ENV = "GGML_CPU_TILED_MM"  # ggml's switch of its tiled K-quant matmul ("0": off), read once per process
LOAD_FAILED = 3  # the child's exit status when llama.cpp refused the file itself (not a crash of a kernel)
# A non-invariant configuration is chosen only when its one-row step is this much faster than the fastest invariant
# one: exact mode on non-invariant kernels settles near ties with extra forwards and forfeits a replay's gain, so
# invariance is worth up to about that gain on the price of a row (docs/llama-cpp.md, the load probe).
INVARIANT_SLACK = 1.5

# The child: constructs the target with the extra buffer types as asked (no probe of its own) and prints one JSON
# line. A string, not an import: this module must not import llama.cpp (nor torch) itself.
_CHILD = """
import json, sys
from redraft.runtimes.llamacpp.target import LlamaCppTarget
from redraft.runtimes.llamacpp.lib import LlamaCppError
from redraft.runtimes.llamacpp.probe import LOAD_FAILED, batch_report
try:
    t = LlamaCppTarget(sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), extra_bufts=sys.argv[3] == "1",
                       tiled_matmul=sys.argv[4] == "1")
except LlamaCppError as e:
    print(e, file=sys.stderr)
    sys.exit(LOAD_FAILED)
print(json.dumps(batch_report(t, batches=tuple(int(x) for x in sys.argv[5].split(",")), prefix=int(sys.argv[6]))))
"""


@dataclass(frozen=True)
class Config:
    """One way to load a file: llama.cpp's extra weight buffer types (repacked ``*_8x8`` layouts, AMX) on or off
    (``llama_model_params.use_extra_bufts``), and ggml's tiled K-quant matmul on or off (``GGML_CPU_TILED_MM``; it
    takes K-quant and IQ matmuls of 8 rows and more, so their rows differ from the one-row kernel's)."""

    extra_bufts: bool = True
    tiled_matmul: bool = True

    def describe(self) -> str:
        """How this differs from llama.cpp's defaults, in llama.cpp's own terms ("llama.cpp's defaults" if not)."""
        parts = ([] if self.extra_bufts else ["no repacked/AMX weight buffers (--no-repack)"]) + (
            [] if self.tiled_matmul else ["no tiled K-quant matmul (GGML_CPU_TILED_MM=0)"])
        return ", ".join(parts) or "llama.cpp's defaults"


# The configurations probed, in order: llama.cpp's defaults first; the others only when the defaults crash or are not
# batch-invariant.
CONFIGS = (Config(True, True), Config(True, False), Config(False, True), Config(False, False))


@dataclass(frozen=True)
class ProbeResult:
    """What one child process found for one :class:`Config`.

    Attributes:
        config: the configuration probed.
        runs: the child loaded the file and decoded every batch without dying.
        invariant: every batch row was bit for bit the row of that token fed alone (False when it did not run).
        max_diff: per batch size, the largest |logit| change of a batch row against the one-row forward, divided by
            the row's largest |logit| (0.0 when invariant).
        step_ms: median milliseconds of a one-row forward after the prefix (0.0 when it did not run).
        why: how the child failed ("" when it ran): its signal or exit status and its last line of stderr.
    """

    config: Config
    runs: bool
    invariant: bool = False
    max_diff: dict | None = None
    step_ms: float = 0.0
    why: str = ""
    load_failed: bool = False  # llama.cpp refused the file (truncated, foreign): no kernel choice helps


@dataclass(frozen=True)
class Verdict:
    """The configuration :func:`settle` chose for a file: what the parent loads.

    Attributes:
        config: the :class:`Config` to load with.
        invariant: batch rows equal one-row rows in that configuration (exact mode's noise is zero then).
        note: one line for the log when the choice is not llama.cpp's default ("" otherwise).
        probes: every :class:`ProbeResult` behind the choice, as dicts (for docs and bug reports).
    """

    config: Config
    invariant: bool
    note: str = ""
    probes: tuple = ()


class ProbeFailed(RuntimeError):
    """No configuration of this llama.cpp build ran the file: every child process died or failed (the message says
    how each did), or llama.cpp refused the file itself (``file_refused``: a truncated or foreign file, where no
    build or kernel helps)."""

    def __init__(self, message: str, *, file_refused: bool = False) -> None:
        super().__init__(message)
        self.file_refused = file_refused


def probe(gguf: str | os.PathLike, *, threads: int, config: Config = CONFIGS[0], batches=PROBE_BATCHES,
          prefix: int = PROBE_PREFIX, timeout: float = PROBE_TIMEOUT) -> ProbeResult:
    """Run ``gguf`` in a child process under ``config`` (see the module docstring).

    Args:
        gguf: the GGUF file; threads: llama.cpp threads in the child; config: the :class:`Config` to load with;
            batches: verify batch sizes compared with one-row forwards; prefix: prompt tokens fed as one batch
            first; timeout: seconds before the child counts as failed.
    Returns:
        the :class:`ProbeResult`; a child that crashed, hung or printed no verdict is ``runs=False`` with ``why``.
    """
    cmd = [sys.executable, "-c", _CHILD, str(gguf), str(int(threads)), "1" if config.extra_bufts else "0",
           "1" if config.tiled_matmul else "0", ",".join(str(int(b)) for b in batches), str(int(prefix))]
    env = {k: v for k, v in os.environ.items() if k != TILED_ENV}  # the child sets it from the config
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ProbeResult(config, False, why=f"no verdict within {timeout:.0f} s")
    last = (r.stderr.strip().splitlines() or [""])[-1][:300]
    if r.returncode == LOAD_FAILED:
        return ProbeResult(config, False, why=last, load_failed=True)
    if r.returncode != 0:
        how = (f"killed by signal {-r.returncode} ({signal.Signals(-r.returncode).name})" if r.returncode < 0
               else f"exit status {r.returncode}")
        return ProbeResult(config, False, why=how + (f": {last}" if last else ""))
    try:
        report = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return ProbeResult(config, False, why=f"printed no verdict: {r.stdout.strip()[-200:]!r}")
    return ProbeResult(config, True, invariant=bool(report["invariant"]),
                       max_diff={str(k): float(v) for k, v in report["max_diff"].items()},
                       step_ms=float(report["step_ms"]))


def batch_report(target, batches=PROBE_BATCHES, prefix: int = PROBE_PREFIX, steps: int = 16) -> dict:
    """How ``target`` (a :class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget`, or anything with its reset / forward /
    crop / vocab_size) computes verify batches of the given sizes, the measurement a child process reports:
    ``prefix`` tokens fed as one batch, then each batch against the same tokens fed one at a time, then ``steps``
    timed one-row forwards. The target's cache is reset after.

    Returns:
        {"invariant": every batch row bit for bit its one-row row, "max_diff": {size: the largest |logit| change
        over the row's largest |logit|}, "step_ms": median milliseconds of a one-row forward}.
    """
    n = max(batches)
    ids = [(17 * i + 1) % target.vocab_size for i in range(prefix + n + steps)]
    target.reset()
    target.forward(ids[:prefix])
    single = np.concatenate([target.forward([t]).numpy() for t in ids[prefix:prefix + n]])
    times = []
    for t in ids[prefix + n:]:
        t0 = time.perf_counter()
        target.forward([t])
        times.append(time.perf_counter() - t0)
    diffs = {}
    for b in batches:
        target.crop(prefix)
        rows = target.forward(ids[prefix:prefix + b], n_logits=b).numpy()
        ref = single[:b]
        diffs[int(b)] = float(np.abs(rows - ref).max() / max(float(np.abs(ref).max()), 1e-30))
    target.reset()
    return {"invariant": all(d == 0.0 for d in diffs.values()), "max_diff": diffs,
            "step_ms": 1e3 * float(np.median(times))}


def choose(results: list[ProbeResult]) -> Verdict:
    """The configuration to load, from the probes made so far (llama.cpp's defaults first).

    The fastest configuration at one row (what plain decoding costs) sets the pace; among those within
    :data:`INVARIANT_SLACK` of it, the first batch-invariant one in probe order (closest to llama.cpp's defaults)
    is chosen (an invariant build replays without settling near ties), else the first one, with exact mode's
    measured noise.

    Raises:
        ProbeFailed: none ran (the message names each failure).
    """
    probes = tuple(asdict(r) for r in results)
    ran = [r for r in results if r.runs]
    if not ran:
        whys = [r.why for r in results]
        if len(set(whys)) == 1:  # the same failure everywhere (a file llama.cpp cannot load): said once
            raise ProbeFailed(f"with each of {len(results)} kernel configurations: {whys[0]}")
        raise ProbeFailed("; ".join(f"with {r.config.describe()}: {r.why}" for r in results))
    fastest = min(ran, key=lambda r: r.step_ms)
    within = [r for r in ran if r.step_ms <= fastest.step_ms * INVARIANT_SLACK]  # llama.cpp's pace, in probe order
    pick = next((r for r in within if r.invariant), within[0])
    if pick is results[0]:
        return Verdict(pick.config, pick.invariant, probes=probes)
    crashed = [r for r in results if not r.runs]
    note = f"loading with {pick.config.describe()}"
    if crashed:
        note += (f"; {crashed[0].config.describe()} fails with this build on this CPU ({crashed[0].why}): rebuild "
                 "with `make llama` (docs/llama-cpp.md)")
    elif pick.invariant:
        note += (f": batch-invariant (llama.cpp's defaults are not for this file), one-row step "
                 f"{pick.step_ms:.1f} ms against {results[0].step_ms:.1f} ms")
    return Verdict(pick.config, pick.invariant, note=note, probes=probes)


def build_key(gguf: str | os.PathLike, threads: int, tiled_matmul: bool | None = None) -> str:
    """A digest of what a verdict depends on: the llama.cpp libraries (names, sizes, modification times), the CPU
    (model name and feature flags), the GGUF file (path, size, modification time), the threads, a fixed tiled-matmul
    setting and :data:`SCHEMA`."""
    parts = [f"schema={SCHEMA}", f"threads={int(threads)}", f"machine={platform.machine()}", f"tiled={tiled_matmul}",
             f"build={library_signature()}", f"cpu={cpu_signature()}"]
    path = Path(gguf).resolve()
    st = path.stat()
    parts.append(f"gguf={path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def library_signature() -> str:
    """A digest of the installed llama.cpp build: llama-cpp-python's libraries (names, sizes, modification times) and
    its module; "" without the binding. A rebuild (other flags, redraft's few-row kernel) changes it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return ""
    root = Path(spec.origin).parent
    parts = []
    for lib in sorted(root.rglob("*.so*")) + sorted(root.rglob("*.dylib")) + sorted(root.rglob("*.dll")):
        st = lib.stat()
        parts.append(f"lib={lib.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}")
    parts.append(f"module={spec.origin}:{Path(spec.origin).stat().st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cpu_signature() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``'s first processor; ``platform.processor()``
    elsewhere): a build that runs on one CPU may die on another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    return f"{fields.get('model name', '')}|{fields.get('flags', '')}"


def settle(gguf: str | os.PathLike, *, threads: int, tiled_matmul: bool | None = None,
           cache: str | os.PathLike | None = None) -> Verdict:
    """The configuration to load ``gguf`` with on this build and CPU: cached, or probed in child processes now
    (about two seconds each; rules in the module docstring).

    Args:
        gguf: the GGUF file (must exist); threads: llama.cpp threads; tiled_matmul: the tiled-matmul setting when the
            process has fixed it already (only configurations with it are probed), None when free; cache: directory
            of verdicts (default ``<redraft cache>/llama-probe``).
    Raises:
        ProbeFailed: no configuration ran the file (the message names each failure).
    """
    folder = Path(cache) if cache is not None else cache_dir() / "llama-probe"
    file = folder / f"{build_key(gguf, threads, tiled_matmul)}.json"
    try:
        d = json.loads(file.read_text())
        return Verdict(Config(**d["config"]), bool(d["invariant"]), str(d.get("note", "")),
                       tuple(d.get("probes", ())))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    configs = [c for c in CONFIGS if tiled_matmul is None or c.tiled_matmul == tiled_matmul]
    results = [probe(gguf, threads=threads, config=configs[0])]
    if results[0].load_failed:  # the file itself: say what is wrong with it, probe nothing else
        raise ProbeFailed(gguf_problem(gguf) or results[0].why, file_refused=True)
    if not (results[0].runs and results[0].invariant):
        results += [probe(gguf, threads=threads, config=c) for c in configs[1:]]
    verdict = choose(results)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(file, {**asdict(verdict), "gguf": str(gguf)}, indent=1)
    except OSError as e:  # a read-only cache: probe again next time
        log.warning("llama.cpp probe verdict not cached (%s): %s", file, e)
    return verdict

def gguf_problem(path: str | os.PathLike) -> str:
    """Why ``path`` is not a complete GGUF file ("" when it is): its header, metadata and tensor table read by the
    gguf package (memory-mapped; a truncated file fails there), and every tensor's data inside the file."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        size = os.path.getsize(path)
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                return f"truncated (tensor {t.name} ends past the file's {size} bytes)"
    except Exception as e:  # the reader raises ValueError, IndexError, struct or numpy errors on a damaged file
        return f"not a complete GGUF file: truncated or damaged ({type(e).__name__}: {str(e)[:120]})"
    return ""
