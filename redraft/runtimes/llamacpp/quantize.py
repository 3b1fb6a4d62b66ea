"""A GGUF model rewritten in another quantization type by llama.cpp's own quantizer, once, into redraft's cache.

A replay is one wide forward over prompt + answer, so on llama.cpp its speed is the price of a batched row, and that
price depends on the weights' type: ggml repacks Q4_0 and IQ4_NL into interleaved ``*_8x8`` layouts whose batched
kernels are batch-invariant and cheap, where Q4_1 has none (docs/llama-cpp.md). :func:`quantize` writes a copy of a
model in the type asked (``llama_model_quantize``, the library call behind llama.cpp's ``llama-quantize``): a single
type for every tensor, output layer and token embeddings included (llama.cpp's ``--pure``), or a K-quant mix
(``q4_k_m`` and the like) as llama.cpp chooses it. The copy is written under a temporary name and renamed when
complete, and an existing copy is reused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from redraft.io.atomic import temporary_name
from redraft.io.loading import ModelLoadError, cache_dir, check_model_spec
from redraft.runtimes.llamacpp.probe import gguf_problem

# type name -> (llama.cpp's LLAMA_FTYPE_* constant, pure): pure writes every tensor in that type, as measured
QUANT_TYPES = {
    "q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", True),
    "q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", True),
    "q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", True),
    "q5_1": ("LLAMA_FTYPE_MOSTLY_Q5_1", True),
    "q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", True),
    "iq4_nl": ("LLAMA_FTYPE_MOSTLY_IQ4_NL", True),
    "f16": ("LLAMA_FTYPE_MOSTLY_F16", True),
    "bf16": ("LLAMA_FTYPE_MOSTLY_BF16", True),
    "q4_k_s": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", False),
    "q4_k_m": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
    "q5_k_m": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
    "q6_k": ("LLAMA_FTYPE_MOSTLY_Q6_K", False),
}


class QuantizeError(ValueError):
    """A quantization that cannot be made: the source is missing or not a GGUF file, the type is unknown, or
    llama.cpp's quantizer failed (the message names which)."""


def quantized_path(src: str | os.PathLike, qtype: str, cache: str | os.PathLike | None = None) -> Path:
    """Where :func:`quantize` keeps ``src`` in ``qtype``: ``<cache>/quantized/<stem>-<digest>.<qtype>.gguf``, the
    digest naming the source file (resolved path, size, modification time), so an edited source gets a new copy."""
    path = Path(src).resolve()
    st = path.stat()
    digest = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    root = Path(cache) if cache is not None else cache_dir()
    return root / "quantized" / f"{path.stem}-{digest}.{qtype}.gguf"


def check_source(src: str | os.PathLike, qtype: str) -> tuple[Path, str]:
    """``src`` as a GGUF file that exists and ``qtype`` as a known type name (lower case).

    Raises:
        QuantizeError: the file is missing, unreadable or not a GGUF file; the type is not in :data:`QUANT_TYPES`.
    """
    name = str(qtype).lower()
    if name not in QUANT_TYPES:
        raise QuantizeError(f"type {qtype!r}: expected one of {', '.join(QUANT_TYPES)}")
    path = Path(src)
    if path.is_dir():
        raise QuantizeError(f"model {path}: a directory (expected a .gguf file)")
    if not path.is_file():
        raise QuantizeError(f"model {path}: no such file (expected a .gguf file)")
    try:
        check_model_spec(path)  # readable, with the GGUF magic
    except ModelLoadError as e:
        raise QuantizeError(f"model {e}") from e
    why = gguf_problem(path)
    if why:
        raise QuantizeError(f"model {path}: {why}")
    return path, name

def quantize(src: str | os.PathLike, qtype: str, out: str | os.PathLike | None = None, *, threads: int | None = None,
             force: bool = False) -> tuple[Path, bool]:
    """Write ``src`` in ``qtype`` with llama.cpp's quantizer (requantizing an already quantized file is allowed).

    Args:
        src: a GGUF file; qtype: a :data:`QUANT_TYPES` name; out: where to write (default
            :func:`quantized_path`); threads: quantizer threads (default every core); force: write again even when
            ``out`` exists.
    Returns:
        (the written or reused path, whether it was written now).
    Raises:
        QuantizeError: see :func:`check_source`, or llama.cpp's quantizer returned an error (nothing is left at
            ``out`` then).
        LlamaCppError: the ``llama`` extra is missing.
    """
    path, name = check_source(src, qtype)
    dest = Path(out) if out is not None else quantized_path(path, name)
    if dest.is_file() and not force:
        return dest, False
    from redraft.runtimes.llamacpp.lib import import_llama_cpp, init_backend

    lib = import_llama_cpp()
    init_backend(lib)  # silences llama.cpp's log of every tensor
    const, pure = QUANT_TYPES[name]
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, const)
    params.allow_requantize = True
    params.pure = pure
    params.nthread = int(threads or os.cpu_count() or 1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(dest)
    try:
        rc = lib.llama_model_quantize(str(path).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            raise QuantizeError(f"llama.cpp's quantizer could not write {path.name} as {name} (status {rc}): a type "
                                "this llama.cpp build or this model's tensor shapes do not take")
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest, True
