"""Draft checkpoints: safetensors weights + a JSON config that records which target the draft was trained for.

A checkpoint directory holds:

- ``glide.json``: format tag, :class:`GlideConfig`, the target's fingerprint and description, training summary.
- ``draft.safetensors``: the trainable weights only (the frozen embeddings and LM head are the target's) plus
  ``vocab_rank`` (int64 [vocab]: token ids by descending training frequency), from which a reduced-vocabulary
  head of any size N is cut at load time (its ids = the first N of the ranking).
- while training, ``optimizer.safetensors`` and ``train_state.json`` for ``--resume``.

A draft reads the target's embeddings, LM head and KV cache, so it is only meaningful for the exact target it was
trained for: :func:`load_draft` compares fingerprints and refuses any other target with :class:`TargetMismatchError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from redraft.defaults import SHIPPED_GLIDE_DIR
from redraft.glide.config import GlideConfig
from redraft.glide.network import GlideDraft, build_draft
from redraft.io.atomic import atomic_path, write_json

FORMAT = "redraft-glide"
VERSION = 1
CONFIG_FILE = "glide.json"
WEIGHTS_FILE = "draft.safetensors"

# config fields that define the architecture (others, such as dtype or the attention backend, may differ freely)
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
              "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "hidden_act")


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, unreadable or of another format; the message names the path."""


class TargetMismatchError(CheckpointError):
    """The checkpoint was trained for another target model; the message names both."""


def _tensor_stats(t: torch.Tensor) -> str:
    t = t.detach().cpu().double()  # on the CPU: the same sums whatever device the target runs on
    flat = t.flatten()
    n = flat.numel()
    picks = flat[torch.tensor([i * (n - 1) // 6 for i in range(7)])]
    return (f"{list(t.shape)} sum={t.sum().item():.6e} abs={t.abs().sum().item():.6e} "
            f"pick={[float(f'{x:.6e}') for x in picks.tolist()]}")


def target_fingerprint(model) -> str:
    """A 16-hex-digit hash of a target's architecture config and a few weight statistics.

    Statistics (shape, sum, absolute sum, 7 evenly spaced values, to 7 significant digits) of the input
    embeddings, the first layer's q_proj, the last layer's v_proj, the final norm and the LM head: two different
    checkpoints of the same architecture differ here, while dtype/attention-backend choices do not matter.
    """
    cfg = model.config.to_dict()
    arch = {k: cfg[k] for k in _ARCH_KEYS if k in cfg}
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    layers = model.base_model.layers
    tensors = [model.get_input_embeddings().weight, layers[0].self_attn.q_proj.weight,
               layers[-1].self_attn.v_proj.weight, model.base_model.norm.weight, model.get_output_embeddings().weight]
    for t in tensors:
        h.update(_tensor_stats(t).encode())
    return h.hexdigest()[:16]


def target_description(model) -> str:
    """Human-readable target name for error messages, e.g. ``llama 30 layers, hidden 576, vocab 49152 (path)``."""
    c = model.config
    name = getattr(c, "_name_or_path", "") or getattr(model, "name_or_path", "") or ""
    desc = f"{c.model_type} {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"
    return f"{desc} ({name})" if name else desc


def save_draft(out: str | os.PathLike, draft: GlideDraft, target, *, vocab_rank: torch.Tensor | None = None,
               training: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``glide.json`` + ``draft.safetensors`` into ``out`` (created if needed), atomically per file.

    Args:
        draft: the draft (only its trainable parameters are written).
        target: the transformers target model it was trained for (its fingerprint goes into the config).
        vocab_rank: LongTensor [vocab] token ids by descending frequency, or None.
        training: JSON-able training summary (steps, tokens, loss, held-out acceptance, seconds, data).
        dtype: store the weights in this float dtype (e.g. torch.float16 for a compact shipped checkpoint; they
            are cast back to the target's dtype at load) and the ranking as int32; None = as they are.
    Returns:
        the directory.
    """
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()
               if k not in ("embed_weight", "head_weight") and not k.startswith("rotary.")}
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if vocab_rank is not None:
        tensors["vocab_rank"] = vocab_rank.to(torch.long if dtype is None else torch.int32).contiguous()
    cfg = draft.cfg.to_dict()
    cfg["head_vocab"] = 0  # the head size is chosen at load time from vocab_rank
    meta = {"format": FORMAT, "version": VERSION, "config": cfg,
            "target": {"fingerprint": target_fingerprint(target), "description": target_description(target)},
            "training": training or {}}
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp))
    write_json(out / CONFIG_FILE, meta)
    return out


def read_meta(path: str | os.PathLike) -> dict:
    """The parsed ``glide.json`` of a checkpoint directory.

    Raises:
        CheckpointError: no such directory/file, bad JSON, or another format.
    """
    p = Path(path).expanduser()
    f = p / CONFIG_FILE
    if not f.is_file():
        raise CheckpointError(f"{p}: not a GliDe draft checkpoint (no {CONFIG_FILE}; train one with "
                              f"'redraft glide train --out {p}')")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: bad JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{f}: format {got!r}, expected {FORMAT!r}")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{f}: no 'config' object")
    return meta


def config_of(meta: dict, path: str | os.PathLike) -> GlideConfig:
    """The :class:`GlideConfig` in a checkpoint's parsed ``glide.json`` (from :func:`read_meta`).

    Raises:
        CheckpointError: a field is missing.
    """
    try:
        return GlideConfig.from_dict(meta["config"])
    except TypeError as e:  # a missing field
        raise CheckpointError(f"{Path(path).expanduser() / CONFIG_FILE}: bad 'config' ({e})") from e


def check_target(meta: dict, target, path: str | os.PathLike = "") -> None:
    """Refuse a checkpoint trained for another target.

    Raises:
        TargetMismatchError: fingerprints differ; the message names the checkpoint's target and this one.
    """
    want = meta.get("target", {})
    fp = target_fingerprint(target)
    if want.get("fingerprint") != fp:
        raise TargetMismatchError(
            f"GliDe draft {path} was trained for target {want.get('description', '?')} "
            f"[fingerprint {want.get('fingerprint')}], but the target model is {target_description(target)} "
            f"[fingerprint {fp}]; train a draft for this target with 'redraft glide train'")


def load_draft(path: str | os.PathLike, target, *, head_vocab: int | None = None) -> GlideDraft:
    """Load a draft checkpoint for ``target`` (a transformers causal LM), in eval mode.

    Args:
        path: checkpoint directory.
        target: the target model; must be the one the draft was trained for.
        head_vocab: N > 0 = reduced-vocabulary head over the N most frequent training tokens; 0 = full head;
            None = full head.
    Raises:
        CheckpointError: unreadable checkpoint, or ``head_vocab`` > 0 without a stored ranking.
        TargetMismatchError: the checkpoint belongs to another target.
    """
    from safetensors.torch import load_file

    meta = read_meta(path)
    check_target(meta, target, path)
    cfg = config_of(meta, path)
    try:
        tensors = load_file(str(Path(path).expanduser() / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises several types for a bad file
        raise CheckpointError(f"{path}: cannot read {WEIGHTS_FILE} ({type(e).__name__}: {e})") from e
    rank = tensors.pop("vocab_rank", None)
    rank = None if rank is None else rank.long()
    draft = build_draft(target, cfg)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k not in ("embed_weight", "head_weight") and not k.startswith("rotary.")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    if head_vocab:
        if head_vocab < 0 or head_vocab > draft.head_weight.shape[0]:
            raise CheckpointError(f"a reduced head needs 1..{draft.head_weight.shape[0]} tokens, got {head_vocab}")
        if rank is None:
            raise CheckpointError(f"{path}: no vocab_rank stored, cannot build a {head_vocab}-token head")
        draft.set_vocab(torch.sort(rank[:head_vocab]).values)
    draft.vocab_rank = rank
    draft.meta = meta
    return draft.eval()


def shipped_draft_dir() -> Path:
    """Where the GliDe draft shipped inside the package for the default target lives (it may be absent)."""
    return SHIPPED_GLIDE_DIR


def export_draft(src: str | os.PathLike, dst: str | os.PathLike, target) -> Path:
    """Copy the checkpoint in ``src`` into ``dst`` as a compact one (fp16 weights, int32 ranking, no optimizer).

    ``glide.json`` keeps the training summary (command, data recipe, minutes) and records the export.
    Raises:
        CheckpointError / TargetMismatchError: as :func:`load_draft`.
    """
    draft = load_draft(src, target)
    meta = draft.meta
    training = dict(meta.get("training") or {})
    training["exported_from"] = str(src)
    return save_draft(dst, draft, target, vocab_rank=draft.vocab_rank, training=training, dtype=torch.float16)
