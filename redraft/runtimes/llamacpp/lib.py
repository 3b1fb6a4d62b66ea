"""llama.cpp's library as a process holds it: the import of llama-cpp-python's bindings, the backend's one-time set-up
(its log silenced), the process-wide switches a target's kernels depend on (ggml's tiled K-quant matmul,
llama-cpp-python's default model parameters) and what the build holds (redraft's few-row kernel).
:mod:`redraft.runtimes.llamacpp.target` builds targets on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from redraft.runtimes.llamacpp.probe import TILED_ENV


class LlamaCppError(RuntimeError):
    """llama.cpp cannot run here: the ``llama`` extra is missing, or a GGUF file does not load, or a decode failed."""


def import_llama_cpp():
    """The ``llama_cpp`` module (llama-cpp-python's bindings of llama.cpp's C API).

    Raises:
        LlamaCppError: it is not installed (``make llama``, or ``pip install -e '.[llama]'``).
    """
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppError(
            "the llama.cpp runtime needs llama-cpp-python: run `make llama` in the repository (or `pip install -e "
            f"'.[llama]'` there with the CMAKE_ARGS docs/llama-cpp.md gives); import failed: {e}") from e
    return llama_cpp


_BACKEND_READY = False
_TILED_MATMUL: bool | None = None  # ggml's tiled K-quant matmul as this process set it (it reads the switch once)


def set_tiled_matmul(on: bool) -> bool:
    """Ask ggml for its tiled K-quant matmul on or off (``GGML_CPU_TILED_MM``, process-wide, read once by ggml at
    its first batched K-quant matmul); returns the setting this process runs with: the first target's, or the
    environment's when the user set it."""
    global _TILED_MATMUL
    if _TILED_MATMUL is None:
        user = _env_tiled()
        if user is None and not bool(on):
            os.environ[TILED_ENV] = "0"
        _TILED_MATMUL = bool(on) if user is None else user  # the user's own setting wins
    return _TILED_MATMUL


def _env_tiled() -> bool | None:
    """``GGML_CPU_TILED_MM`` as ggml reads it (unset: None; else off for "0" or anything not a non-zero integer)."""
    v = os.environ.get(TILED_ENV)
    if v is None:
        return None
    try:
        return int(v.strip()) != 0
    except ValueError:
        return False


def init_backend(llama_cpp) -> None:
    """Initialise llama.cpp's backend once and route its log (model loading prints hundreds of lines) to nothing."""
    global _BACKEND_READY
    if _BACKEND_READY:
        return
    llama_cpp.llama_backend_init()
    callback = llama_cpp.llama_log_callback(lambda level, text, user: None)
    init_backend.callback = callback  # kept alive: llama.cpp holds the pointer
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    _BACKEND_READY = True


def tiled_matmul_fixed() -> bool | None:
    """The tiled K-quant matmul setting this process is held to (a target set it, or the user's
    ``GGML_CPU_TILED_MM``), or None while it is free."""
    return _TILED_MATMUL if _TILED_MATMUL is not None else _env_tiled()


@contextlib.contextmanager
def model_defaults(*, extra_bufts: bool):
    """Make llama-cpp-python's own ``Llama`` load models with llama.cpp's extra weight buffer types on or off (it has
    no argument for ``use_extra_bufts``): its default model parameters are patched for the block. A baseline on the
    same kernels as a :class:`LlamaCppTarget` is built so."""
    lib = import_llama_cpp()
    inner = lib.llama_cpp.llama_model_default_params

    def params():
        p = inner()
        p.use_extra_bufts = bool(extra_bufts)
        return p

    lib.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_cpp.llama_model_default_params = inner


class RowKernel:
    """redraft's few-row kernel in the llama.cpp build this process runs (native/ggml-rows/rows.inc, added to ggml's
    AMX matmul by `make llama` on x86): verify batches of 2..``max_rows`` rows on AMX-repacked Q4_0, Q4_1 and Q8_0
    weights take it (``max_rows`` 0 or 1: ``REDRAFT_GGML_ROWS`` turned it off).

    Args:
        lib: the ``ctypes.CDLL`` of the libggml-cpu that exports it.
    """

    def __init__(self, lib) -> None:
        lib.redraft_ggml_rows_max.restype = ctypes.c_int
        lib.redraft_ggml_rows_calls.restype = ctypes.c_uint64
        self._lib = lib
        self.max_rows = int(lib.redraft_ggml_rows_max())

    def calls(self) -> int:
        """Matrix products the kernel has computed in this process (one per weight matrix and batch)."""
        return int(self._lib.redraft_ggml_rows_calls())


def row_kernel() -> RowKernel | None:
    """The loaded build's :class:`RowKernel`, or None: a build without it (another CPU architecture, a
    llama-cpp-python built elsewhere) or no llama.cpp library loaded in this process yet. Linux (the library is
    found in /proc/self/maps: the very copy llama.cpp runs, not another file of the same name)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    fields = (line.split(None, 5) for line in maps.splitlines())
    for path in sorted({f[5] for f in fields if len(f) == 6 and "libggml-cpu" in f[5]}):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "redraft_ggml_rows_max") and hasattr(lib, "redraft_ggml_rows_calls"):
            return RowKernel(lib)
    return None
