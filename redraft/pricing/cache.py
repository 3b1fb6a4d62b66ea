"""The measured cost curve, cached on disk per model, dtype, thread count and machine (the default policy is built on
it by :func:`redraft.compose.build_policy`); the policy itself only takes a :class:`~redraft.pricing.curve.CostCurve`.
Also the reader of a curve file given by hand (:func:`read_curve`: vLLM's step curve, REDRAFT_COST_CURVE).

A curve measured on one machine says nothing about another (a GPU verifies 64 tokens for about the price of one;
a 2-core CPU does not), nor about the same machine with another thread count or dtype. The cache key holds all of
that plus the measurement settings; the file name is a hash of the key and the file repeats the key, so a stale or
foreign file is measured again, never trusted. Writes go to a temporary file renamed into place, so a crash or a
concurrent run never leaves half a file. A file that cannot be read or parsed is ignored with a warning and
measured again: a bad cache never stops a generation.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from redraft.defaults import COST_PREFIX, COST_REPEATS, COST_SIZES
from redraft.io.atomic import write_json
from redraft.io.loading import base_attention, cache_dir
from redraft.pricing.curve import CostCurve
from redraft.pricing.measure import measure_cost_curve

LLAMA_COST_MAX = 128  # the largest draft size timed for a llama.cpp target

# /2: ratios to the 1-token forwards around each sample, sizes in random order, the robust fit (pricing.fit); curves of /1
# (median times over the median 1-token time, sizes swept in order) are measured again
SCHEMA = "redraft-cost-curve/2"


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else ``platform.processor()``), or "unknown"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hf_model(model):
    """The transformers model itself, given one or an HFTarget wrapping one."""
    return model if hasattr(model, "config") else model.model


def model_fingerprint(model) -> dict:
    """What identifies a model's verify cost: name, architecture and sizes, parameter count, attention kernel."""
    model = hf_model(model)
    cfg = model.config
    return {"name": str(getattr(cfg, "_name_or_path", "") or ""), "type": str(getattr(cfg, "model_type", "")),
            "layers": getattr(cfg, "num_hidden_layers", None), "hidden": getattr(cfg, "hidden_size", None),
            "vocab": getattr(cfg, "vocab_size", None), "params": int(sum(p.numel() for p in model.parameters())),
            "attn": base_attention(cfg)}


def curve_key(model, *, sizes: Sequence[int] = COST_SIZES, prefix: int = COST_PREFIX,
              repeats: int = COST_REPEATS, threads: int | None = None) -> dict:
    """The cache key: model fingerprint, dtype, device, torch thread count, machine and measurement settings.

    Args:
        model: a transformers causal LM, an HFTarget, or a LlamaCppTarget (keyed by its GGUF and threads).
        threads: torch intra-op threads the curve is for (default: ``torch.get_num_threads()`` now).
    """
    import torch

    if getattr(model, "runtime", None) == "llama.cpp":  # a LlamaCppTarget: its GGUF, build and threads
        return _llama_key(model, sizes=sizes, prefix=prefix, repeats=repeats)
    import transformers

    inner = hf_model(model)
    param = next(inner.parameters())
    device = str(param.device)
    if param.device.type == "cuda":
        device += f" {torch.cuda.get_device_name(param.device)}"
    return {"schema": SCHEMA, "model": model_fingerprint(inner), "dtype": str(param.dtype), "device": device,
            "threads": int(threads if threads is not None else torch.get_num_threads()),
            "machine": {"cpu": cpu_model(), "arch": platform.machine(), "system": platform.system(),
                        "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__},
            "sizes": sorted(set(int(s) for s in sizes) | {0}), "prefix": int(prefix), "repeats": int(repeats)}


def _llama_key(target, *, sizes: Sequence[int], prefix: int, repeats: int) -> dict:
    """:func:`curve_key` for a :class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget`: the GGUF file (name, size,
    llama.cpp's description), llama-cpp-python's version, the build (the target's ``build``: its libraries' digest and
    few-row kernel limit; a build with llamafile's sgemm or with redraft's few-row kernel batches rows at other
    costs) and its numerics, the target's thread count and the machine."""
    from importlib.metadata import version

    stat = target.path.stat()
    return {"schema": SCHEMA, "runtime": "llama.cpp", "timed": "shape change", "llama_cpp_python": version("llama_cpp_python"),
            "build": str(getattr(target, "build", "")),
            "model": {"file": target.path.name, "bytes": stat.st_size, "desc": target.description},
            "numerics": str(getattr(target, "numerics", "")),
            "threads": int(target.n_threads), "n_ctx": int(target.max_length),
            "machine": {"cpu": cpu_model(), "arch": platform.machine(), "system": platform.system(),
                        "cpus": os.cpu_count()},
            "sizes": sorted(set(int(s) for s in sizes) | {0}), "prefix": int(prefix), "repeats": int(repeats)}


def curve_from_json(data) -> CostCurve:
    """The curve in a parsed JSON object: a curve ``{"sizes": [...], "costs": [...]}`` or a cache file's
    ``{"key": ..., "curve": {...}}``. Raises ValueError naming the bad field."""
    if isinstance(data, dict) and isinstance(data.get("curve"), dict):
        data = data["curve"]
    return CostCurve.from_dict(data)


def read_curve(path: str | os.PathLike) -> CostCurve:
    """:func:`curve_from_json` of the JSON file at ``path``. Raises OSError (unreadable) or ValueError (not JSON,
    not a valid curve)."""
    with open(path, encoding="utf-8") as f:
        return curve_from_json(json.load(f))


def curve_path(key: dict, directory: str | os.PathLike) -> Path:
    """``directory/cost-curves/<hash of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / "cost-curves" / f"{digest}.json"


def default_directory() -> Path:
    """redraft's cache directory (:func:`redraft.io.loading.cache_dir`)."""
    return cache_dir()


def load_curve(path: str | os.PathLike, key: dict) -> CostCurve | None:
    """The cached curve at ``path`` when it exists and was measured under ``key``; else None.

    A file that exists but cannot be read, is not JSON, holds another key or an invalid curve is reported with a
    RuntimeWarning naming the file and the problem, and None is returned (the caller measures again).
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != key:
            raise ValueError("its key does not match this model/machine")
        curve = data.get("curve")
        if not isinstance(curve, dict):
            raise ValueError("it holds no curve object")
        return CostCurve.from_dict(curve)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        warnings.warn(f"cost curve cache {path}: ignored ({e}); measuring again", RuntimeWarning, stacklevel=2)
        return None


def save_curve(path: str | os.PathLike, key: dict, curve: CostCurve) -> bool:
    """Write ``curve`` under ``key`` atomically (temporary file + rename). Returns False, with a warning, on an
    OS error (read-only cache, full disk): the measured curve is still usable, only not cached."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"key": key, "curve": curve.to_dict()}, indent=1)
        return True
    except OSError as e:
        warnings.warn(f"cost curve cache {path}: not written ({e})", RuntimeWarning, stacklevel=2)
        return False


def cached_cost_curve(model, *, directory: str | os.PathLike | None = None, sizes: Sequence[int] = COST_SIZES,
                      prefix: int = COST_PREFIX, repeats: int = COST_REPEATS, refresh: bool = False,
                      measure: Callable[..., CostCurve] = measure_cost_curve) -> CostCurve:
    """The cost curve for ``model`` here: from the cache when present and valid, else measured and cached.

    Args:
        model: a :class:`~redraft.runtimes.transformers.target.Target` (an HFTarget or a LlamaCppTarget; its KV cache is reset
            when measuring), or a bare transformers model when ``measure`` takes one (the default needs a target:
            :func:`redraft.runtimes.transformers.target.as_target`).
        directory: cache root (default: redraft's cache directory, ``$REDRAFT_CACHE`` or ``~/.cache/redraft``).
        sizes, prefix, repeats: measurement settings (part of the key).
        refresh: measure again even when a cached curve exists.
        measure: the measuring function (tests pass a fake); called as ``measure(model, sizes, prefix=,
            repeats=)``.
    Returns:
        :class:`CostCurve`.
    """
    if getattr(model, "runtime", None) == "llama.cpp" and tuple(sizes) == tuple(COST_SIZES):
        # llama.cpp's verify cost grows linearly past a few rows on a CPU (docs/llama-cpp.md): the curve's last
        # segment carries it on, and the sizes past LLAMA_COST_MAX would cost a minute of forwards to time
        sizes = tuple(s for s in COST_SIZES if s <= LLAMA_COST_MAX)
    key = curve_key(model, sizes=sizes, prefix=prefix, repeats=repeats)
    path = curve_path(key, directory if directory is not None else default_directory())
    curve = None if refresh else load_curve(path, key)
    if curve is None:
        # once per model, dtype, thread count and machine: say so, it takes seconds (minutes on a loaded machine)
        print(f"redraft: measuring this machine's verify cost curve once ({len(key['sizes'])} forward sizes up to "
              f"{max(key['sizes'])} tokens; cached in {path.parent})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        bar = {"progress": sys.stderr.isatty()} if measure is measure_cost_curve else {}  # a bar on a terminal
        curve = measure(model, key["sizes"], prefix=prefix, repeats=repeats, **bar)
        save_curve(path, key, curve)
        print(f"redraft: cost curve measured in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return curve

