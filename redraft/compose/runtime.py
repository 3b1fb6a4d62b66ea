"""Where the target runs: transformers (a Hugging Face directory, or a GGUF dequantised once to fp32) or llama.cpp
(a GGUF file run as it is quantized, :class:`redraft.runtimes.llamacpp.target.LlamaCppTarget`).

:func:`load_target` is the one loader every command and the Python API use; what it returns,
:class:`~redraft.io.loading.LoadedModel`, says which runtime it holds (``runtime``), and everything downstream (the
engine, the policy's cost curve, exact mode) takes its ``model`` either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from redraft.io.loading import (
    LoadedModel,
    ModelLoadError,
    gguf_tokenizer_dir,
    load_model,
    quiet_transformers,
    resolve_gguf,
)

log = logging.getLogger(__name__)

RUNTIMES = ("transformers", "llama.cpp")
LLAMA_N_CTX = 4096  # llama.cpp context tokens by default (the bundled model's training context is 8192)


def load_target(spec: str | os.PathLike | None = None, *, runtime: str = "transformers", dtype: str = "float32",
                quiet: bool = False, n_ctx: int | None = None, threads: int | None = None,
                sequences: int = 1) -> LoadedModel:
    """Load the target model and its tokenizer on ``runtime``.

    Args:
        spec: a HF model directory, a ``.gguf`` file, or None for the bundled SmolLM2-135M-Instruct (Q4_1 GGUF).
        runtime: "transformers" (:func:`redraft.io.loading.load_model`) or "llama.cpp" (a ``.gguf`` file only; the
            ``llama`` extra must be installed).
        dtype: transformers weight dtype (llama.cpp runs the file's own quantization and refuses another dtype).
        n_ctx: llama.cpp context length in tokens (default LLAMA_N_CTX); threads: llama.cpp CPU threads (default
            ``torch.get_num_threads()``, the thread count transformers would use); sequences: llama.cpp sequences
            in its context (``n_seq_max``; each of ``n_ctx`` tokens), one per request a server runs at once.

    On llama.cpp, torch is left one intra-op thread (``torch.set_num_threads(1)``, process-wide): torch then only
    post-processes a step's logits, and its OpenMP workers, which spin after each parallel op on a [rows, vocab]
    verify result, take cores from llama.cpp's threads in the next forward (Measurements: docs/measurements.md#redraft-compose-runtime). Load a transformers model in
    the same process under
    :func:`torch_threads` to give it its threads back.
    Raises:
        ModelLoadError: an unknown runtime, a dtype llama.cpp cannot honour, a path that is not a GGUF file for
            llama.cpp, the ``llama`` extra missing, or a file llama.cpp cannot load (each names what was expected).
    """
    if runtime not in RUNTIMES:
        raise ModelLoadError(f"runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if runtime == "transformers":
        return load_model(spec, dtype=dtype, quiet=quiet)
    if dtype != "float32":
        raise ModelLoadError(f"--dtype {dtype}: the llama.cpp runtime runs the GGUF file's own quantization "
                             "(leave --dtype at float32)")
    path = resolve_gguf(spec)
    import torch

    from redraft.runtimes.llamacpp.target import LlamaCppError, LlamaCppTarget

    n_threads = threads or torch.get_num_threads()
    warn_busy_cores(n_threads)  # before the load: its first probe of a file runs at that pace too
    try:
        target = LlamaCppTarget(path, n_ctx=n_ctx or LLAMA_N_CTX, n_threads=n_threads, n_seq_max=sequences)
    except LlamaCppError as e:
        raise ModelLoadError(str(e)) from e
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok_dir = gguf_tokenizer_dir(path, quiet=quiet)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if len(tok) > target.vocab_size:
        raise ModelLoadError(f"{path}: its tokenizer has {len(tok)} tokens but llama.cpp's vocabulary "
                             f"{target.vocab_size}")
    name = "default" if spec is None or str(spec) in ("", "default") else str(spec)
    return LoadedModel(model=target, tokenizer=tok, name=name, path=path, runtime="llama.cpp")


def warn_busy_cores(threads: int) -> str | None:
    """Warn (and return the warning) when llama.cpp gets more threads than the machine has cores, or every core of
    a machine that is busy already: ggml's threads wait on each other at every operation, so one core taken by
    another process (or by another of its own threads) stalls each step (on the 2-core development VM with a test
    run beside it: 3-8 tokens/s on 2 threads against 86-93 on 1; 3 threads on its 2 cores took 28 s for 4 tokens).
    None otherwise, or when the load average is unknown and the threads fit the cores."""
    cores = os.cpu_count() or 1
    if threads > cores:
        msg = (f"llama.cpp runs {threads} threads on {cores} cores: its threads wait on each other at every step, "
               f"so each step waits for a thread that has no core; this can be hundreds of times slower than "
               f"--threads {cores} (or fewer), and the first load of a file probes it that slowly too")
    else:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
        if cores < 2 or threads < cores or load < 0.5 * cores:
            return None
        msg = (f"llama.cpp runs {threads} threads on {cores} cores while the machine's load average is {load:.1f}: "
               "its threads wait on each other at every step, so a core another process takes stalls them all; "
               "--threads 1 (or fewer than the cores) may be several times faster here")
    log.warning(msg)
    return msg


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the count (a transformers model beside a
    llama.cpp target, which leaves torch one thread: :func:`load_target`). Raises ValueError: n < 1."""
    import torch

    if n < 1:
        raise ValueError(f"torch_threads: n={n}, expected >= 1")
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)
