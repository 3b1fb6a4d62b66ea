"""A stand-in for llama-cpp-python's C API bindings: the functions :class:`redraft.runtimes.llamacpp.target.LlamaCppTarget`
calls, over a tiny deterministic "model" (each logit a function of the token, its position and the previous token),
so the load probe is tested without building llama.cpp. ``FAKE_LLAMA`` chooses how it misbehaves:

- ``crash-extra``: a decode of more than one row dies by SIGILL while the extra buffer types are on (ggml's AMX
  kernels on a CPU that cannot run them);
- ``crash-all``: a decode of more than one row dies by SIGSEGV in every configuration;
- ``noisy-extra``: batch rows move by 1e-3 while the extra buffer types are on (a repacked kernel that is not
  batch-invariant);
- ``noisy-both``: that, and batches of 8 rows or more move too unless ``GGML_CPU_TILED_MM=0`` (ggml's tiled K-quant
  matmul);
- anything else: a well-behaved, batch-invariant build.
"""

import ctypes
import math
import os
import signal
import time

VOCAB = 64
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0


class _Params:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Batch:
    def __init__(self, n):
        self.token = [0] * n
        self.pos = [0] * n
        self.n_seq_id = [0] * n
        self.seq_id = [[0] for _ in range(n)]
        self.logits = [False] * n
        self.n_tokens = 0


class _Model:
    def __init__(self, extra):
        self.extra = extra


class _Ctx:
    def __init__(self, model, n_ctx):
        self.model, self.n_ctx, self.seqs, self.out = model, n_ctx, {}, None


def llama_backend_init():
    pass


def llama_log_callback(fn):
    return fn


def llama_log_set(callback, user):
    pass


def llama_model_default_params():
    return _Params(use_extra_bufts=True)


def llama_context_default_params():
    return _Params(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1, n_seq_max=1, kv_unified=True,
                   flash_attn_type=-1)


def llama_model_load_from_file(path, params):
    with open(path, "rb") as f:
        if f.read(8) == b"GGUF bad":  # a file llama.cpp refuses (truncated, foreign)
            return None
    return _Model(params.use_extra_bufts)


def llama_init_from_model(model, params):
    return _Ctx(model, params.n_ctx)


def llama_get_memory(ctx):
    return ctx


def llama_model_get_vocab(model):
    return model


def llama_vocab_n_tokens(vocab):
    return VOCAB


def llama_n_ctx(ctx):
    return ctx.n_ctx


def llama_model_desc(model, buf, n):
    buf.value = b"fake 1M F32"


def llama_batch_init(n, embd, n_seq):
    return _Batch(n)


def llama_batch_free(batch):
    pass


def llama_free(ctx):
    pass


def llama_model_free(model):
    pass


def _row(tok, pos, prev):
    return [math.sin(0.37 * v + 1.3 * tok + 0.11 * pos + 0.7 * prev) for v in range(VOCAB)]


def llama_decode(ctx, batch):
    mode = os.environ.get("FAKE_LLAMA", "")
    n = batch.n_tokens
    if n > 1 and (mode == "crash-all" or (mode == "crash-extra" and ctx.model.extra)):
        os.kill(os.getpid(), signal.SIGSEGV if mode == "crash-all" else signal.SIGILL)
    noise = 1e-3 if n > 1 and mode in ("noisy-extra", "noisy-both") and ctx.model.extra else 0.0
    if n >= 8 and mode == "noisy-both" and os.environ.get("GGML_CPU_TILED_MM") != "0":
        noise += 2e-3
    out = []
    for i in range(n):
        seq = ctx.seqs.setdefault(batch.seq_id[i][0], {})
        seq[batch.pos[i]] = batch.token[i]
        if batch.logits[i]:
            prev = seq.get(batch.pos[i] - 1, 0)
            out.extend(x + noise for x in _row(batch.token[i], batch.pos[i], prev))
    ctx.out = (ctypes.c_float * max(len(out), 1))(*out)
    time.sleep(0.005)  # a step of steady length: the probe's timings compare configurations of equal speed
    return 0


def llama_get_logits(ctx):
    return ctypes.cast(ctx.out, ctypes.POINTER(ctypes.c_float))


def llama_memory_clear(mem, data):
    mem.seqs.clear()


def llama_memory_seq_rm(mem, seq, p0, p1):
    cells = mem.seqs.setdefault(seq, {})
    for p in [p for p in cells if p >= p0 and (p1 < 0 or p < p1)]:
        del cells[p]
    return True


def llama_vocab_is_eog(vocab, tok):
    return tok == 2


def llama_vocab_get_text(vocab, tok):
    return f"t{tok}".encode()
