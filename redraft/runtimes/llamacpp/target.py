"""The target model on llama.cpp: a GGUF file run as it is quantized, through llama.cpp's C API.

The same interface as :class:`redraft.runtimes.transformers.target.HFTarget` (reset, forward, crop, keep, seed, snapshot, solo),
so the engine, its drafters, the cost-aware policy and exact mode run unchanged on llama.cpp's forward. It reaches
llama.cpp through llama-cpp-python's ctypes bindings of the C API (``llama_decode`` on a ``llama_batch``,
``llama_get_logits_ith``, ``llama_memory_seq_rm``): the binding's high-level ``Llama`` class samples inside its own
loop and cannot verify a draft. The ``llama`` extra installs it (``make llama``, docs/llama-cpp.md).

Plain decoding here is llama.cpp's own: the prompt in batches of ``n_batch`` tokens with one output row, then one
token per ``llama_decode`` (what ``Llama.generate`` does with the same context settings), so its rows are bit for bit
llama.cpp's plain greedy rows. A verify forward is one ``llama_decode`` over the pending tokens and the draft, with an
output row for each verified token; rejected rows leave the KV cache by ``llama_memory_seq_rm``.

Whether a verify row equals plain decoding's row depends on the build. ggml's own CPU kernels compute each row of
a batch as they compute a single row, so a build without llamafile's sgemm (``-DGGML_LLAMAFILE=OFF``, what
``make llama`` builds) gives verify rows bit-identical to plain decoding's at any batch size, and exact mode has
nothing to settle. llamafile's sgemm (the binding's default build) computes batch rows from the fifth on another way:
they move by up to ~1.4 logits on the bundled Q4_1 model (docs/llama-cpp.md); so do repacked kernels of some types
(``q4_K_8x8``). A probe at load time, in a child process (:mod:`redraft.runtimes.llamacpp.probe`), tells them apart,
finds a build whose batched decode crashes (ggml's AMX kernels where they cannot run) before this process decodes
anything, and chooses whether llama.cpp's extra weight buffers (repacked layouts, AMX) are used; ``numerics`` names
the measured noise exact mode then uses: ``"llama.cpp batch-invariant"`` (zero) or ``"llama.cpp"``
(``defaults.EXACT_GAP_NOISE``).

Chains only: a token tree needs a node in every sequence whose path passes through it (llama.cpp's tree
speculation), which this target does not build yet (``chain_only``); the engine then verifies each proposal's first
path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from redraft.runtimes.base import PrefixKV, Target
from redraft.runtimes.llamacpp.lib import (
    LlamaCppError,
    import_llama_cpp,
    init_backend,
    row_kernel,
    set_tiled_matmul,
    tiled_matmul_fixed,
)
from redraft.runtimes.llamacpp.probe import ProbeFailed, batch_report, library_signature, settle
from redraft.runtimes.llamacpp.rows import copy_rows, lent_rows, put_tokens
from redraft.runtimes.llamacpp.state import SequenceState

log = logging.getLogger(__name__)

NOISE_KEY = "llama.cpp"  # this runtime's entry in defaults.EXACT_ROW_NOISE / EXACT_GAP_NOISE
INVARIANT_KEY = "llama.cpp batch-invariant"  # the entry for a build whose rows do not depend on the batch
PROBE_ROWS = 8  # batch rows of the load-time probe (a build with llamafile's sgemm differs from row 4 on)


class LlamaCppTarget(SequenceState, Target):
    """A GGUF model on llama.cpp with its own context and KV cache; this target is sequence 0 of the context.

    With ``n_seq_max`` > 1 the context holds that many sequences of ``n_ctx`` tokens each (:meth:`view` gives a
    target on each, :mod:`redraft.runtimes.llamacpp.batching` batches them); this object then only owns the model
    and the context: it must not decode while views are in use (sequence 0 may be one of them), and closing it
    frees the context under them.

    Args:
        gguf: path of the GGUF file (any quantization llama.cpp loads).
        n_ctx: context length of each sequence in tokens (llama.cpp's ``n_ctx`` is ``n_ctx * n_seq_max``).
        n_threads: CPU threads for decoding and batches (None: ``os.cpu_count()``).
        n_batch: most tokens per ``llama_decode`` (llama.cpp's ``n_batch``; ``n_ubatch`` the same): a prompt is fed
            in batches of this many, as ``Llama.eval`` feeds it, and a verify forward must fit in one.
        n_seq_max: sequences in the context (1: one, whose cache is reset with ``llama_memory_clear``).
        extra_bufts: llama.cpp's extra weight buffer types (repacked ``*_8x8`` layouts, AMX) on or off
            (``llama_model_params.use_extra_bufts``; llama.cpp's ``--no-repack`` turns them off). None (the default):
            as :func:`redraft.runtimes.llamacpp.probe.settle` chose for this build, CPU and file, probing in a child
            process first, so that a build whose batched decode crashes never takes this process down. True or False:
            loaded so without a child probe, batch invariance probed in this process (:meth:`batch_invariant`).
        tiled_matmul: ggml's tiled K-quant matmul on or off (``GGML_CPU_TILED_MM``; process-wide and set once: the
            first target of a process, or the user's environment, decides for all); with ``extra_bufts`` None the
            probe's choice.
    Attributes:
        path: the GGUF file; length: tokens in the KV cache; vocab_size: rows of the output layer; max_length:
            each sequence's ``n_ctx``; dtype: the logits' dtype (float32); numerics: the key of this build's measured noise
            (``"llama.cpp batch-invariant"`` when the load-time probe found verify rows equal to plain rows, else
            ``"llama.cpp"``); invariant: that probe's verdict; chain_only: True (see the module docstring); description: llama.cpp's own one-line
            description of the model (architecture, size, quantization); build: a digest of the llama.cpp build
            (:func:`~redraft.runtimes.llamacpp.probe.library_signature`) and its few-row kernel's limit
            (:func:`~redraft.runtimes.llamacpp.lib.row_kernel`); extra_bufts, tiled_matmul: the
            configuration loaded.
    Raises:
        LlamaCppError: the ``llama`` extra is missing, the file does not exist or llama.cpp cannot load it, or
            cannot create a context of that size, or the load probe found no configuration that runs it.
        ValueError: n_seq_max < 1.
    """

    runtime = "llama.cpp"
    lends_logits = True  # forward(borrow=True) returns a view of llama.cpp's output buffer
    _released = False  # a view whose sequence was handed back (:meth:`release`)
    chain_only = True
    sliding_window = None
    dtype = torch.float32

    def __init__(self, gguf: str | os.PathLike, *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = 512, n_seq_max: int = 1, extra_bufts: bool | None = None,
                 tiled_matmul: bool = True) -> None:
        if int(n_seq_max) < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        lib = import_llama_cpp()
        self.path = Path(gguf)
        if not self.path.is_file():
            raise LlamaCppError(f"GGUF file {self.path} does not exist")
        threads = int(n_threads or os.cpu_count() or 1)
        verdict = None
        if extra_bufts is None:  # probed in a child process first: a build that crashes must not take this one down
            try:
                verdict = settle(self.path, threads=threads, tiled_matmul=tiled_matmul_fixed())
            except ProbeFailed as e:
                if e.file_refused:
                    raise LlamaCppError(f"llama.cpp cannot load {self.path}: {e}") from e
                raise LlamaCppError(f"llama.cpp cannot run {self.path} with this build on this CPU ({e}); "
                                    "rebuild the llama extra with `make llama` (docs/llama-cpp.md)") from e
            if verdict.note:
                log.warning("%s: %s", self.path.name, verdict.note)
            extra_bufts, tiled_matmul = verdict.config.extra_bufts, verdict.config.tiled_matmul
        self.tiled_matmul = set_tiled_matmul(bool(tiled_matmul))
        init_backend(lib)
        self._lib = lib
        mparams = lib.llama_model_default_params()
        self.extra_bufts = bool(extra_bufts)
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = self.extra_bufts
        elif not self.extra_bufts:
            raise LlamaCppError("this llama-cpp-python has no use_extra_bufts model parameter: rebuild the llama "
                                "extra with `make llama`")
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {self.path} as a GGUF model (a truncated or foreign file, "
                                "or an architecture this llama.cpp build does not know)")
        self.n_batch = int(min(n_batch, n_ctx))
        cparams = lib.llama_context_default_params()
        self.n_seq_max = int(n_seq_max)
        # several sequences: one KV stream each (kv_unified off), so each sequence's cells lie in position order
        # from cell 0, as in a context of its own: its attention sums run in plain decoding's order
        cparams.n_ctx = int(n_ctx) * self.n_seq_max
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.n_seq_max = self.n_seq_max
        if self.n_seq_max > 1:
            cparams.kv_unified = False
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama-cpp-python's Llama sets it
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            size = f"{n_ctx} tokens" if self.n_seq_max == 1 else (
                f"{self.n_seq_max} sequences of {n_ctx} tokens ({cparams.n_ctx} in all)")
            raise LlamaCppError(f"llama.cpp could not create a context of {size} for {self.path} (not enough memory, "
                                "or more sequences than this llama.cpp build allows)")
        self._mem = lib.llama_get_memory(self._ctx)
        self.cache = self._mem  # never None: the step loop resets a target whose cache is None
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.max_length = int(lib.llama_n_ctx(self._ctx)) // self.n_seq_max  # each sequence's own context
        self.n_threads = threads
        buf = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self._model, buf, 256)
        self.description = buf.value.decode(errors="replace")
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.seq = 0  # this target's sequence id in the context (other ids: :meth:`view`)
        self._owner: LlamaCppTarget | None = None  # the target that owns the model and context (None: this one)
        self._on_release = None
        self.length = 0
        self.ids: list[int] = []  # the tokens the KV cache holds, in order
        self.solo_depth = 0
        # the probe was offered only this process's tiled-matmul setting; kernels the caller chose are measured here
        self.invariant = verdict.invariant if verdict is not None else self.batch_invariant()
        self.numerics = INVARIANT_KEY if self.invariant else NOISE_KEY
        kernel = row_kernel()  # REDRAFT_GGML_ROWS changes what a batch of rows costs, not the libraries
        self.build = library_signature() + (f"|rows<={kernel.max_rows}" if kernel is not None else "")

    # -- the Target interface ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop this sequence's whole KV cache (start of a new sequence).

        Raises:
            LlamaCppError: a view whose sequence was released (its id may serve another request now).
        """
        self._check_live()
        if self.n_seq_max == 1:
            # metadata only: zeroing the data buffers too (data=True) took ~10 ms for the bundled model's 4096-token
            # cache, a new sequence's whole first step; cells past the sequence are masked out whatever they hold,
            # and llama-cpp-python's own reset keeps them as well
            self._lib.llama_memory_clear(self._mem, False)
        else:
            self._lib.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
        self.length = 0
        self.ids = []

    def forward(self, ids: list[int], positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                n_logits: int = 1, *, borrow: bool = False) -> torch.Tensor:
        """Run ``ids`` through llama.cpp after the cached tokens, appending all of them to the KV cache.

        Args:
            ids: S >= 1 token ids, fed in ``llama_decode`` batches of at most ``n_batch``.
            positions, mask: must be None (consecutive positions, causal attention: chains only).
            n_logits: trailing rows that get an output row (1..S; plain decoding's forwards ask for 1).
            borrow: return a view of llama.cpp's output buffer instead of a copy when the forward is one
                ``llama_decode`` (S <= ``n_batch``): valid until this context's next decode, for a caller that reads
                it before then and keeps no reference (the engine's verify step). Saves copying every row (134 MB
                for a 128-token replay on Gemma 3's 262,144-token vocabulary, ~10% of that forward).
        Returns:
            FloatTensor [n_logits, vocab] (float32, CPU): the logits of the last ``n_logits`` rows.
        Raises:
            NotImplementedError: a tree's positions or mask was given.
            ValueError: the tokens would overflow the context, or n_logits is outside 1..S.
            LlamaCppError: ``llama_decode`` failed.
        """
        self._check_live()
        if positions is not None or mask is not None:
            raise NotImplementedError("the llama.cpp target verifies chains only (no tree positions or mask)")
        s = len(ids)
        if not 1 <= n_logits <= s:
            raise ValueError(f"forward: n_logits={n_logits} outside 1..{s} fed tokens")
        if self.length + s > self.max_length:
            raise ValueError(f"forward: {self.length} cached + {s} new tokens exceed n_ctx={self.max_length}")
        lib, first_out = self._lib, s - n_logits
        if borrow and s <= self.n_batch:
            self._decode(ids, first_out)
            return lent_rows(lib.llama_get_logits(self._ctx), n_logits, self.vocab_size)
        out = torch.empty(n_logits, self.vocab_size, dtype=torch.float32)
        row = 0  # output rows copied so far
        for start in range(0, s, self.n_batch):
            chunk = ids[start:start + self.n_batch]
            self._decode(chunk, first_out - start)
            n_out = min(len(chunk), start + len(chunk) - first_out)
            if n_out > 0:  # the batch's output rows, in batch order, copied once into the result
                copy_rows(out, row, lib.llama_get_logits(self._ctx), n_out)
                row += n_out
        return out

    def _decode(self, chunk: list[int], first_logit: int) -> None:
        """One ``llama_decode`` of ``chunk`` (at most ``n_batch`` ids) after the cached tokens, with output rows
        from its ``first_logit``-th token on; the cache then holds them (LlamaCppError, and nothing kept, if not)."""
        batch = self._batch
        batch.n_tokens = len(chunk)
        put_tokens(batch, 0, self.seq, self.length, chunk, first_logit)
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            self._lib.llama_memory_seq_rm(self._mem, self.seq, self.length, -1)
            raise LlamaCppError(f"llama_decode returned {rc} on {len(chunk)} tokens at position {self.length}")
        self.length += len(chunk)
        self.ids.extend(int(t) for t in chunk)

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (``llama_memory_seq_rm`` of the rest)."""
        self._check_live()
        if length < self.length:
            if not self._lib.llama_memory_seq_rm(self._mem, self.seq, int(length), -1):
                raise LlamaCppError(f"llama.cpp could not drop KV positions {length}.. of the sequence")
            self.length = int(length)
            del self.ids[length:]

    def keep(self, prefix: int, extra: list[int]) -> None:
        """Keep cached positions [0, prefix) plus ``extra`` (ascending absolute indices >= prefix), which must be the
        contiguous run ``prefix, prefix + 1, ...`` (an accepted chain). Raises ValueError for anything else."""
        if extra and extra != list(range(prefix, prefix + len(extra))):
            raise ValueError("keep: the llama.cpp target keeps contiguous chains only")
        self.crop(prefix + len(extra))

    def seed(self, prefix: PrefixKV) -> None:
        """Start a new sequence on ``prefix``'s tokens. When the cache already begins with them (the previous
        sequence shared that prefix) the rest is dropped and nothing is recomputed; otherwise the prefix is
        prefilled as plain decoding's prompt is (one forward in ``n_batch`` batches).

        The KV entries of a prefix left by an earlier sequence were written by its forwards, verify forwards
        included: the engine judges rows on them as verify rows (as for :class:`PrefixKV`)."""
        ids = [int(t) for t in prefix.ids]
        if len(ids) <= self.length and self.ids[:len(ids)] == ids:
            self.crop(len(ids))
            return
        self.reset()
        self.forward(ids, n_logits=1)

    def snapshot(self, ids: Sequence[int]) -> PrefixKV:
        """A :class:`PrefixKV` naming the first ``len(ids)`` cached tokens (no entries: llama.cpp keeps them in its
        own cache, which :meth:`seed` reuses while it still holds them). Raises ValueError: more ids than cached, or
        ids that are not the cached ones."""
        n = len(ids)
        if not 0 < n <= self.length or [int(t) for t in ids] != self.ids[:n]:
            raise ValueError(f"snapshot: the {n} ids are not the first of the {self.length} cached tokens")
        return PrefixKV(tuple(self.ids[:n]), ())

    def verified_kv(self, layers: Sequence[int], n: int):
        """Not available: llama.cpp's KV cache is not a torch tensor (GliDe drafts need the transformers runtime).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("GliDe drafts read the target's KV cache: use the transformers runtime for them")

    def batch_invariant(self, rows: int = PROBE_ROWS) -> bool:
        """Whether this build computes every row of a batch bit for bit as it computes that token alone: ``rows``
        tokens fed as one batch after a 4-token prefix against the same tokens fed one at a time (about ``2 *
        rows`` single-token forwards; the cache is reset after).
        """
        return bool(batch_report(self, batches=(rows,), prefix=4, steps=1)["invariant"])

    # -- several sequences in one context ----------------------------------------------------------------------

    def view(self, seq: int, on_release=None) -> LlamaCppTarget:
        """A target on sequence ``seq`` of this context (0 <= seq < ``n_seq_max``): the same model, context and
        batch, its own tokens. It starts empty; :meth:`release` empties it and calls ``on_release(seq)``. Views are
        advanced by one thread (a step loop), never concurrently.

        Raises:
            ValueError: ``seq`` outside 0..n_seq_max - 1.
        """
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"view: sequence {seq} outside 0..{self.n_seq_max - 1}")
        owner = self._owner or self
        v = object.__new__(LlamaCppTarget)
        v.__dict__.update({k: val for k, val in owner.__dict__.items() if k not in ("ids", "length", "solo_depth")})
        v.seq, v._owner, v._on_release, v._released = int(seq), owner, on_release, False
        v.ids, v.length, v.solo_depth = [], 0, 0
        v.last_forward_plain, v.carried_rows = True, 1
        v.reset()
        return v

    def _check_live(self) -> None:
        if self._released:
            raise LlamaCppError(f"llama.cpp sequence {self.seq} was released: this target no longer holds it")

    def release(self) -> None:
        """This sequence ended: drop its KV entries and hand its id back (``on_release`` of :meth:`view`). A view
        is released once (its id may already serve another request); the context's own target only empties."""
        if self._owner is None:
            self.reset()
            return
        if self._released:
            return
        self.reset()
        self._released, self.cache = True, None
        if self._on_release is not None:
            self._on_release(self.seq)

    # -- llama.cpp's own facts -------------------------------------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        """Whether llama.cpp's vocabulary marks ``token`` as an end of generation."""
        return bool(self._lib.llama_vocab_is_eog(self._vocab, int(token)))

    def eog_ids(self) -> list[int]:
        """Every end-of-generation id of the GGUF's vocabulary (EOS, EOT, ...)."""
        return [t for t in range(self.vocab_size) if self.is_eog(t)]

    def token_text(self, token: int) -> str:
        """The vocabulary's text of ``token`` (llama.cpp's ``llama_vocab_get_text``)."""
        return self._lib.llama_vocab_get_text(self._vocab, int(token)).decode(errors="replace")

    def close(self) -> None:
        """Free the context, the batch and the model (idempotent); a view (:meth:`view`) only releases its
        sequence."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_owner", None) is not None:
            self.release()
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        if getattr(self, "_owner", None) is not None:
            return  # a view: the owner frees the context; its sequence was released when its request ended
        try:  # not contextlib.suppress: at interpreter exit this module's globals may already be None
            self.close()
        except Exception:  # noqa: BLE001, SIM105 (nothing to report at exit)
            pass


def decode_together(parts: Sequence[tuple[LlamaCppTarget, list[int], int]]) -> list[torch.Tensor]:
    """ONE ``llama_decode`` over several sequences' new tokens (llama.cpp's multi-sequence batch), each token under
    its own sequence id at its sequence's next positions.

    Args:
        parts: per sequence, (its target, a view of one shared context; the token ids to append, S >= 1; n_logits,
            the trailing rows that get an output row, 1..S). Distinct sequences; their tokens fit one batch
            (``n_batch``). The batch lays them out by ascending sequence id.
    Returns:
        per part, in the order given, FloatTensor [n_logits, vocab] (float32, CPU).
    Raises:
        ValueError: the parts do not share one context, repeat a sequence, overflow the batch or a context, or ask
            for n_logits outside 1..S (nothing is decoded then).
        LlamaCppError: a part's sequence was released, or ``llama_decode`` failed (every sequence is left as it
            was).
    """
    first = parts[0][0]
    owner = first._owner or first
    total = sum(len(ids) for _, ids, _ in parts)
    if len({t.seq for t, _, _ in parts}) != len(parts) or any((t._owner or t) is not owner for t, _, _ in parts):
        raise ValueError("decode_together: the parts must be distinct sequences of one context")
    if total > owner.n_batch:
        raise ValueError(f"decode_together: {total} tokens exceed the batch of {owner.n_batch}")
    for t, ids, n_logits in parts:  # every part checked before the batch is filled: a bad one fails alone
        t._check_live()
        if not 1 <= n_logits <= len(ids):
            raise ValueError(f"decode_together: n_logits={n_logits} outside 1..{len(ids)} fed tokens")
        if t.length + len(ids) > t.max_length:
            raise ValueError(f"decode_together: {t.length} cached + {len(ids)} new tokens exceed n_ctx={t.max_length}")
    # in ascending sequence ids: llama.cpp splits a batch over per-sequence KV streams into one pass per run of
    # consecutive ids (and per distinct length), so this order keeps the passes fewest
    order = sorted(range(len(parts)), key=lambda k: parts[k][0].seq)
    lib, batch, j = owner._lib, owner._batch, 0
    for k in order:
        t, ids, n_logits = parts[k]
        j = put_tokens(batch, j, t.seq, t.length, ids, len(ids) - n_logits)
    batch.n_tokens = total
    rc = lib.llama_decode(owner._ctx, batch)
    if rc != 0:
        for t, _, _ in parts:
            lib.llama_memory_seq_rm(owner._mem, t.seq, t.length, -1)
        raise LlamaCppError(f"llama_decode returned {rc} on a batch of {total} tokens over {len(parts)} sequences")
    n_out = sum(n for _, _, n in parts)
    rows = torch.empty(n_out, owner.vocab_size, dtype=torch.float32)  # output rows in batch order
    copy_rows(rows, 0, lib.llama_get_logits(owner._ctx), n_out)
    out: list[torch.Tensor] = [rows[:0]] * len(parts)
    at = 0
    for k in order:
        t, ids, n_logits = parts[k]
        out[k] = rows[at:at + n_logits]
        at += n_logits
        t.length += len(ids)
        t.ids.extend(int(x) for x in ids)
    return out
