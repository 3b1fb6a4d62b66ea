"""What the numbers in a target's KV entries depend on, as one JSON-serialisable dict: the key under which prefix KV
entries are kept on disk (:mod:`redraft.runtimes.prefix_store`), so an entry is reused only where the same forward
would have computed it.
"""

from __future__ import annotations

import hashlib
import platform

import torch

from redraft.pricing.cache import cpu_model, hf_model, model_fingerprint
from redraft.runtimes.llamacpp.probe import cpu_signature

SCHEMA = "redraft-kv-key/1"


def weights_digest(model, samples: int = 4096) -> str:
    """16 hex digits over every parameter's name, shape, dtype and ``samples`` evenly strided values: two models of
    one architecture with other weights (a fine-tune, random test weights) differ, at a few milliseconds' cost
    instead of hashing every byte."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in hf_model(model).named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def kv_fingerprint(model) -> dict:
    """The KV key of a transformers causal LM (or an HFTarget): model identity and weights, dtype, device, the
    libraries that compute the forward, intra-op threads (a reduction split another way rounds another way) and the
    CPU (model, architecture and feature flags: oneDNN and MKL pick their kernels by them); of a llama.cpp target:
    :func:`llama_fingerprint`."""
    if getattr(model, "runtime", None) == "llama.cpp":
        return llama_fingerprint(model)
    import transformers

    inner = hf_model(model)
    param = next(inner.parameters())
    return {"schema": SCHEMA, "runtime": "transformers", "model": model_fingerprint(inner),
            "weights": weights_digest(inner), "dtype": str(param.dtype), "device": str(param.device),
            "threads": int(torch.get_num_threads()), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu_model(), "arch": platform.machine(),
            "cpu_flags": hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]}


def llama_fingerprint(target) -> dict:
    """The KV key of a :class:`~redraft.runtimes.llamacpp.target.LlamaCppTarget`: the load probe's build key
    (llama.cpp libraries, CPU model and flags, the GGUF file, threads, the tiled-matmul setting), the weight buffers
    in use and llama.cpp's description of the model."""
    from redraft.runtimes.llamacpp.probe import build_key

    return {"schema": SCHEMA, "runtime": "llama.cpp", "file": target.path.name,
            "build": build_key(target.path, target.n_threads, target.tiled_matmul),
            "extra_bufts": bool(target.extra_bufts), "desc": target.description}
