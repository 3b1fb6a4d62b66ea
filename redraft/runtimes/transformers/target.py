"""The target model behind a narrow interface: forward token ids with positions and a tree mask, keep or drop KV.

Everything model-specific in the decode loop goes through :class:`HFTarget`, so another runtime (llama.cpp,
vLLM) can host the same drafters and verifier by implementing these methods (reset, forward, crop, keep, and
verified_kv for drafters that read the target's cache).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence

import torch

from redraft.runtimes.base import PrefixKV, Target


def cache_kwarg(model) -> str:
    """The forward keyword that takes a transformers KV cache object for ``model``: ``"cache"`` (transformers 5.2x,
    which deprecates the other) or ``"past_key_values"`` (earlier 5.x releases, e.g. the GPU machine's 5.17, which
    ignore an unknown ``cache=`` silently). Read from the forward's signature."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(cls) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def sdpa_gqa_on_cpu() -> None:
    """Let transformers' SDPA attention hand grouped-query heads to torch as they are (``enable_gqa=True``) for every
    forward, masked ones included, by setting ``TRANSFORMERS_SDPA_FORCE_GQA=1`` unless the environment already sets
    it (process-wide; transformers reads it at each call). Only for models on the CPU.

    Without it transformers passes ``enable_gqa`` only when no mask is given (a one-token step): on CUDA a masked
    GQA call falls back to the math kernel. Every multi-row forward (a prompt, a verify forward, a tree) then first
    copies each layer's keys and values once per query head of their group (``repeat_kv``): at 1,028 cached
    positions SmolLM2-135M's 30 layers copy ~144 MB into fresh memory for a 20-row forward. torch's CPU flash
    kernel takes grouped heads with a mask and computes each head over the same values in the same order: the
    logits are bit-identical (prefill, a 20-row forward at 1,028 positions, a tree-masked forward and the step after
    them, measured on SmolLM2-135M fp32), and the 20-row forward ran in 124-157 ms against 173-205 ms. On a VM whose
    fresh pages fault slowly (a second server started beside others) those copies took 446 of a forward's 619 ms of
    CPU (docs/serving.md, "Prefix KV on disk").
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


class HFTarget(Target):
    """A transformers causal LM with its own KV cache (batch size 1).

    Attributes:
        model: the transformers model (eval mode).
        length: tokens currently held in the KV cache.
        vocab_size: rows of the LM head.
        max_length: context length in tokens (``max_position_embeddings``) or None.
        sliding_window: attention window of sliding-window layers, or None. Token trees need a custom mask that
            would have to repeat each layer's window, so the engine verifies chains only on such models
            (``chain_only``).
        numerics: the weights' dtype name ("float32", ...): the key of exact mode's measured noise.
        last_forward_plain: whether the last forward ran in plain decoding's own shape (always, here; a target
            that packs several sequences' rows into one forward, :class:`redraft.runtimes.transformers.batching.StepBatcher`,
            sets it False after such a forward, and exact mode then judges its rows like verify rows).
        carried_rows: rows the last forward carried for other sequences, plus one (1 alone; set by the batcher).
        solo_depth: > 0 inside :meth:`solo`: forwards asked for must run alone, in plain decoding's shape.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.cache = None
        self.length = 0
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.sliding_window = _sliding_window(model.config)
        self.cache_kwarg = cache_kwarg(model)
        self.numerics = str(self.dtype).removeprefix("torch.")  # exact mode's noise key: the weights' dtype
        self.chain_only = self.sliding_window is not None
        if self.device.type == "cpu":
            sdpa_gqa_on_cpu()

    def reset(self) -> None:
        """Drop the whole KV cache (start of a new sequence).

        The cache is built without the config on purpose: for sliding-window models transformers would create
        layers that forget old positions and cannot be cropped. Full layers can be cropped, and the model's own
        mask still limits attention to the window.
        """
        from redraft.runtimes.transformers.kvcache import growing_cache

        self.cache = growing_cache()
        self.length = 0

    def seed(self, prefix: PrefixKV) -> None:
        """Start a new sequence whose KV cache holds ``prefix``'s entries (``length`` = its token count).

        Raises:
            ValueError: ``prefix.kv`` has another number of layers than the model, or entries of another length.
        """
        from redraft.runtimes.transformers.kvcache import growing_cache

        n_layers = getattr(self.model.config, "num_hidden_layers", len(prefix.kv))
        if len(prefix.kv) != n_layers:
            raise ValueError(f"seed: the prefix has KV entries for {len(prefix.kv)} layers; the model has {n_layers}")
        if any(k.shape[-2] != prefix.length or v.shape[-2] != prefix.length for k, v in prefix.kv):
            raise ValueError(f"seed: KV entries do not hold the prefix's {prefix.length} positions")
        self.cache = growing_cache()
        for i, (k, v) in enumerate(prefix.kv):
            self.cache.update(k[:, :, :0], v[:, :, :0], i)  # creates layer i (its dtype and device) empty
            layer = self.cache.layers[i]
            # shared, not copied (copying every layer would cost each request time; docs/measurements.md): the
            # first forward moves them into a buffer of the layer's own (redraft.runtimes.transformers.kvcache), never writing
            # into them
            layer.keys, layer.values = k, v
        self.length = prefix.length

    def snapshot(self, ids: Sequence[int]) -> PrefixKV:
        """The cached entries of the first ``len(ids)`` positions, which must hold exactly ``ids``, as a
        :class:`PrefixKV`: views whose positions the cache never writes again (copy on write), or copies where a view
        would keep much unused room allocated (:func:`redraft.runtimes.transformers.kvcache.held_views`).

        Raises:
            ValueError: more ids than cached positions.
        """
        n = len(ids)
        if not 0 < n <= self.length:
            raise ValueError(f"snapshot: {n} positions asked, {self.length} cached")
        from redraft.runtimes.transformers.kvcache import held_views

        return PrefixKV(tuple(int(t) for t in ids), tuple(held_views(layer, n) for layer in self.cache.layers))

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                n_logits: int = 1) -> torch.Tensor:
        """Run ids through the model, appending all of them to the KV cache.

        Args:
            ids: S token ids.
            positions: LongTensor [1, S] or None for consecutive positions after the cache.
            mask: additive FloatTensor [1, 1, S, length + S] or None for plain causal attention.
            n_logits: how many trailing rows need logits (the LM head is a large share of the cost).
        Returns:
            FloatTensor [n_logits, vocab] logits of the last n_logits input rows, on the CPU (a model on a GPU
            gets its inputs moved there; acceptance runs on the CPU either way).
        """
        if self.cache is None:
            self.reset()
        dev = self.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        if dev.type != "cpu":
            positions = None if positions is None else positions.to(dev)
            mask = None if mask is None else mask.to(dev)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=n_logits, **{self.cache_kwarg: self.cache})
        self.length += len(ids)
        return out.logits[0].cpu()

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        drop = self.length - length
        if drop > 0:
            self.cache.crop(-drop)
            self.length = length

    def verified_kv(self, layers: Sequence[int], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached keys and values of the first ``n`` positions of the chosen layers (GliDe's cross-attention).

        Between verify forwards the cache holds exactly the verified prefix, which is what a drafter that reads
        the target's cache must see. Keys are stored after the model's rotary encoding, as the model attends.

        Args:
            layers: decoder layer indices (0-based, negative counts from the last layer).
            n: positions to read, 0 < n <= ``length``.
        Returns:
            per layer, (keys, values): views [1, H_kv, n, D] in the model dtype, valid until the next
            ``forward``, ``crop``, ``keep`` or ``reset`` (copy them to keep them longer).
        Raises:
            ValueError: n outside 1..length, or a layer index out of range.
        """
        if not 0 < n <= self.length:
            raise ValueError(f"verified_kv: n={n} outside 1..{self.length} cached positions")
        cached = self.cache.layers
        bad = [i for i in layers if not -len(cached) <= i < len(cached)]
        if bad:
            raise ValueError(f"verified_kv: layer(s) {bad} out of range for a {len(cached)}-layer cache")
        return [(cached[i].keys[:, :, :n], cached[i].values[:, :, :n]) for i in layers]

    def keep(self, prefix: int, extra: list[int]) -> None:
        """Keep cached positions [0, prefix) plus ``extra`` (ascending absolute indices >= prefix); drop the rest.

        A contiguous ``extra`` starting at ``prefix`` is a cheap crop; anything else (an accepted tree path that
        skips siblings) gathers the kept rows in place, so no re-forward is needed.
        """
        if not extra or extra == list(range(prefix, prefix + len(extra))):
            self.crop(prefix + len(extra))
            return
        idx = torch.tensor(list(range(prefix)) + extra, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        self.length = len(idx)


def _sliding_window(config) -> int | None:
    """The attention window in tokens when any layer uses sliding-window attention, else None."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def as_target(model) -> Target:
    """``model`` itself when it is a :class:`Target` (either runtime), else a transformers causal LM wrapped in an
    :class:`HFTarget` (a fresh, empty KV cache)."""
    return model if isinstance(model, Target) else HFTarget(model)
