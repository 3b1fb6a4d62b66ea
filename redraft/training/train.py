"""Training loop for GliDe (and vanilla) drafts: frozen target, self-distillation, resumable checkpoints.

``redraft glide train --out DIR`` runs :func:`run_training`: it builds (or reuses) the cached training records
(:mod:`redraft.training.data`), initialises the draft from the target's last layer(s), and trains with AdamW
(linear warm-up, cosine decay) on the block-masked next-token loss (:mod:`redraft.training.objective`). Every
``ckpt_every`` steps, and when the step or time budget ends, it writes a checkpoint (weights + JSON config with
the target fingerprint + optimizer state) and prints the held-out acceptance estimate. ``--resume`` continues from
the checkpoint in DIR: same data order, same optimizer moments, same schedule.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from redraft.glide.checkpoint import check_target, read_meta, save_draft
from redraft.glide.config import GlideConfig
from redraft.glide.network import GlideDraft, build_draft, init_from_target
from redraft.io.atomic import atomic_path, write_json
from redraft.training.data import Record, batches_by_length
from redraft.training.objective import collate, draft_loss, estimate_acceptance
from redraft.training.recipe import build_training_data

OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "train_state.json"


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (all recorded in the checkpoint).

    Attributes:
        max_steps: optimizer steps in total (a resumed run continues up to this count).
        max_minutes: stop (and checkpoint) after this much training wall-clock, None = no limit.
        lr, min_lr_ratio, warmup: AdamW peak learning rate, cosine floor as a fraction of it, warm-up steps.
        weight_decay, grad_clip: AdamW decay; gradient-norm clip.
        batch_tokens, max_batch: padded tokens and records per batch.
        block, offset_jitter: block size of the cross-attention mask; draw the block phase at random per batch.
        train_vocab: 0 = full-vocabulary loss; N = loss over the N most frequent tokens (cheaper per step).
        prompt_weight: loss weight of prompt positions relative to target-generated ones (0 = generated only).
        gamma: chain depth of the held-out acceptance estimate.
        ckpt_every: steps between checkpoints.
        n_layers, vanilla, init: draft layers; no cross-attention (the baseline); "target" or "random" start.
        cross_recency: GliDe draft with the learned recency bias on its cross-attention (ours, see
            :class:`redraft.glide.network.CrossAttention`).
        cross_newest: GliDe draft that also reads the newest visible target entry directly (ours, see
            :func:`redraft.glide.network.newest_entry`).
        cross_gate: GliDe draft whose cross-attention output has a learned, zero-initialised size (ours, see
            :class:`redraft.glide.network.CrossAttention`); on by default (False = the ungated drafts of docs/glide.md).
        soft_weight: weight of the target's top-k distribution in the loss (0 = greedy labels only; needs
            records with top-k, see :func:`redraft.training.objective.draft_loss`).
        device: where the draft trains ("cpu", "cuda", "cuda:1", ...); the records stay in CPU memory.
    """

    max_steps: int = 3600
    max_minutes: float | None = None
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    batch_tokens: int = 512
    max_batch: int = 16
    block: int = 5
    offset_jitter: bool = True
    train_vocab: int = 16384
    prompt_weight: float = 0.3
    gamma: int = 4
    ckpt_every: int = 400
    seed: int = 0
    n_layers: int = 1
    vanilla: bool = False
    init: str = "target"
    cross_recency: bool = False
    cross_newest: bool = False
    cross_gate: bool = True
    soft_weight: float = 0.0
    device: str = "cpu"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- optimizer state as safetensors --------------------------------------------------------------------------------

def save_optimizer(path: Path, draft: GlideDraft, opt: torch.optim.Optimizer) -> None:
    from safetensors.torch import save_file

    t = {}
    for name, p in draft.named_parameters():
        st = opt.state.get(p)
        if st:
            t[f"{name}.exp_avg"] = st["exp_avg"].cpu().contiguous()
            t[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].cpu().contiguous()
            t[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    with atomic_path(path) as tmp:
        save_file(t, str(tmp))


def load_optimizer(path: Path, draft: GlideDraft, opt: torch.optim.Optimizer) -> None:
    from safetensors.torch import load_file

    t = load_file(str(path))
    for name, p in draft.named_parameters():
        if f"{name}.exp_avg" in t:
            opt.state[p] = {"step": t[f"{name}.step"].reshape(()).clone(),
                            "exp_avg": t[f"{name}.exp_avg"].to(p.device),
                            "exp_avg_sq": t[f"{name}.exp_avg_sq"].to(p.device)}


# ---- the trainer ------------------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    """Where a run stands (``train_state.json``)."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    loss_ema: float | None = None
    history: list = field(default_factory=list)


class Trainer:
    """Trains one draft for one target on in-memory records.

    Args:
        target: the transformers target model (frozen; supplies embeddings, head, rope, fingerprint).
        records: training records; ``heldout``: held-out target generations for the acceptance estimate.
        cfg: :class:`TrainConfig`.
        out: checkpoint directory.
        vocab_rank: token ids by descending frequency (stored with the checkpoint; cuts the train_vocab head).
        data_info: JSON-able description of the data, recorded in the checkpoint.
    """

    def __init__(self, target, records: Sequence[Record], cfg: TrainConfig, out: str | os.PathLike, *,
                 heldout: Sequence[Record] = (), vocab_rank: torch.Tensor | None = None,
                 data_info: dict | None = None) -> None:
        for p in target.parameters():
            p.requires_grad_(False)
        self.target, self.records, self.heldout, self.cfg = target, list(records), list(heldout), cfg
        self.out = Path(out).expanduser()
        self.vocab_rank = vocab_rank
        self.data_info = data_info or {}
        gcfg = GlideConfig.from_target(target.config, n_layers=cfg.n_layers, cross_attention=not cfg.vanilla,
                                       block_size=cfg.block, cross_recency=cfg.cross_recency and not cfg.vanilla,
                                       cross_newest=cfg.cross_newest and not cfg.vanilla,
                                       cross_gate=cfg.cross_gate and not cfg.vanilla)
        self.draft = build_draft(target, gcfg)
        if cfg.init == "target":
            init_from_target(self.draft, target)
        elif cfg.init != "random":
            raise ValueError(f"init must be 'target' or 'random', got {cfg.init!r}")
        self.device = torch.device(cfg.device)
        self.draft.to(self.device)
        self.opt = torch.optim.AdamW([p for p in self.draft.parameters() if p.requires_grad], lr=cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.state = TrainState()
        self.head, self.lut = None, None
        if 0 < cfg.train_vocab < self.draft.head_weight.shape[0]:  # else: the full vocabulary
            if vocab_rank is None:
                raise ValueError("train_vocab needs a vocabulary ranking")
            ids = torch.sort(vocab_rank[:cfg.train_vocab]).values
            self.head = self.draft.head_weight.index_select(0, ids.to(self.device)).contiguous()
            self.lut = torch.full((self.draft.head_weight.shape[0],), -100, dtype=torch.long)
            self.lut[ids] = torch.arange(len(ids))
            self.lut = self.lut.to(self.device)

    # -- checkpoints --
    def resume(self) -> None:
        """Load weights, optimizer moments and state from ``out``.

        Raises:
            redraft.glide.checkpoint.CheckpointError / TargetMismatchError: no usable checkpoint for this target.
            ValueError: the checkpoint is a different kind of draft (vanilla vs GliDe, layer count).
        """
        from safetensors.torch import load_file

        meta = read_meta(self.out)
        check_target(meta, self.target, self.out)
        saved = GlideConfig.from_dict(meta["config"])
        kind = ("cross_attention", "n_layers", "cross_recency", "cross_newest", "cross_gate")
        if [getattr(saved, k) for k in kind] != [getattr(self.draft.cfg, k) for k in kind]:
            raise ValueError(f"{self.out} holds a {'GliDe' if saved.cross_attention else 'vanilla'} draft with "
                             f"{saved.n_layers} layer(s); this run trains another kind")
        tensors = load_file(str(self.out / "draft.safetensors"), device=str(self.device))
        tensors.pop("vocab_rank", None)
        self.draft.load_state_dict(tensors, strict=False)
        if (self.out / OPTIM_FILE).is_file():
            load_optimizer(self.out / OPTIM_FILE, self.draft, self.opt)
        if (self.out / STATE_FILE).is_file():
            self.state = TrainState(**json.loads((self.out / STATE_FILE).read_text()))

    def checkpoint(self) -> dict:
        """Estimate held-out acceptance, write the checkpoint, return the estimate."""
        est = estimate_acceptance(self.draft, self.heldout, gamma=self.cfg.gamma) if self.heldout else {}
        self.state.history.append({"step": self.state.step, "tokens": self.state.tokens,
                                   "seconds": round(self.state.seconds, 1), "loss": self.state.loss_ema, **est})
        training = {"config": asdict(self.cfg), "data": self.data_info, **asdict(self.state)}
        save_draft(self.out, self.draft, self.target, vocab_rank=self.vocab_rank, training=training)
        save_optimizer(self.out / OPTIM_FILE, self.draft, self.opt)
        write_json(self.out / STATE_FILE, asdict(self.state), indent=1)
        return est

    # -- data order --
    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.records)))
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        lengths = [len(r) for r in self.records]
        return batches_by_length(order, lengths, self.cfg.batch_tokens, self.cfg.max_batch)

    def _batches(self):
        """Endless (epoch, batch records, block offset) stream, deterministic given the seed; skips done steps."""
        step, epoch = 0, 0
        while True:
            for idx in self._epoch_batches(epoch):
                if step >= self.state.step:
                    rng = random.Random(self.cfg.seed * 7919 + step)
                    offset = rng.randrange(self.cfg.block) if self.cfg.offset_jitter else 0
                    yield epoch, [self.records[j] for j in idx], offset
                step += 1
            epoch += 1

    # -- the loop --
    def step(self, records: Sequence[Record], offset: int = 0) -> tuple[float, int]:
        """One optimizer step on ``records``; returns (loss, tokens in the loss)."""
        batch = collate(records, block=self.cfg.block, offset=offset, with_kv=not self.cfg.vanilla,
                        prompt_weight=self.cfg.prompt_weight).to(self.device)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.state.step, self.cfg)
        self.opt.zero_grad(set_to_none=True)
        loss, n = draft_loss(self.draft, batch, head=self.head, lut=self.lut, soft_weight=self.cfg.soft_weight)
        if n:
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip)
            self.opt.step()
        return loss, n

    def train(self, *, progress: bool = True, log=None, until: int | None = None) -> TrainState:
        """Run until ``max_steps`` or ``max_minutes``; checkpoint every ``ckpt_every`` steps and at the end.

        ``until`` stops earlier, at that step, without changing the schedule (as an interruption would).
        """
        log = sys.stderr if log is None else log  # the stream current at the call
        from redraft.io.progress import Progress

        cfg = self.cfg
        torch.manual_seed(cfg.seed + self.state.step)
        self.draft.train()
        t_start = time.perf_counter()
        sec0 = self.state.seconds
        bar = Progress(total=cfg.max_steps, initial=self.state.step, desc="glide train" if not cfg.vanilla else
                   "vanilla train", unit="step", file=log, enabled=progress, dynamic_ncols=True)
        stream = self._batches()
        last_ckpt = self.state.step
        try:
            while self.state.step < min(cfg.max_steps, until or cfg.max_steps):
                if cfg.max_minutes is not None and time.perf_counter() - t_start >= cfg.max_minutes * 60:
                    break
                epoch, recs, offset = next(stream)
                t0 = time.perf_counter()
                loss, n = self.step(recs, offset)
                dt = time.perf_counter() - t0
                self.state.step += 1
                self.state.tokens += n
                self.state.seconds = sec0 + time.perf_counter() - t_start
                ema = self.state.loss_ema
                self.state.loss_ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                bar.update(1)
                bar.set_postfix(loss=f"{self.state.loss_ema:.3f}", tok_s=f"{n / dt:.0f}", epoch=epoch)
                if self.state.step - last_ckpt >= cfg.ckpt_every:
                    est = self.checkpoint()
                    last_ckpt = self.state.step
                    if est:
                        bar.write(_est_line(self.state, est))
        except KeyboardInterrupt:
            bar.write("interrupted: writing a checkpoint")
        finally:
            bar.close()
        if self.state.step != last_ckpt or not (self.out / STATE_FILE).is_file():
            est = self.checkpoint()
            if est:
                print(_est_line(self.state, est), file=log)
        return self.state


def _est_line(state: TrainState, est: dict) -> str:
    loss = "-" if state.loss_ema is None else f"{state.loss_ema:.3f}"
    return (f"step {state.step}: loss {loss}, held-out chain acceptance {est['acceptance']:.1%} "
            f"({est['tokens_per_forward']:.2f} tokens/forward est., top-1 {est['top1']:.1%}, "
            f"{est['blocks']} blocks), {state.tokens} tokens in {state.seconds / 60:.1f} min")


# ---- the command ---------------------------------------------------------------------------------------------------

def run_training(loaded, out: str | os.PathLike, cfg: TrainConfig, *, resume: bool = False,
                 data_minutes: float = 90.0, max_new_tokens: int = 128, text_windows: int = 0,
                 data_dir: str | os.PathLike | None = None, threads: int | None = 1, progress: bool = True,
                 samples: int = 8, sample_temperature: float = 0.7, sample_max_prompt: int = 384,
                 self_questions: int = 0, topk: int = 8, command: str | None = None, log=None) -> TrainState:
    """Build/reuse the training records for ``loaded`` (a LoadedModel), then train a draft into ``out``.

    Args:
        data_minutes: wall-clock budget for generating new training answers in this call (cached ones are reused).
        max_new_tokens: answer length of the training generations.
        text_windows: stdlib text windows (256 tokens, teacher-forced: one target forward labels a window) added
            to the training data (store ``text-k<topk>``).
        self_questions: N > 0 = first have the target write N training questions of its own
            (:mod:`redraft.training.selfprompt`, saved as ``self-questions.json``) and answer them greedily
            (store ``self-k<topk>``), within ``data_minutes``, before any Spec-Bench answer.
        topk: the target's top-k next tokens kept per position in the self-question and text stores (for
            ``cfg.soft_weight``).
        samples: sampled answer sets (``sample_temperature``, top-40) generated after the greedy answers, each
            for the training questions whose prompt has at most ``sample_max_prompt`` tokens (short prompts decode
            in large batches, so they give the most target-written tokens per second). Stored under
            ``train-s1``, ``train-s2``, ... (``train-t<T>-s1``, ... at another temperature); every stored set is
            used for training; labels stay the target's greedy choices.
        data_dir: feature cache (default ``<cache>/glide/data/<target fingerprint>-L<layers>-n<max_new>``).
        threads: torch threads (1 keeps a shared 2-core machine usable; None = leave as is).
        command: the command line that started the run, recorded in the checkpoint.
    """
    log = sys.stderr if log is None else log  # the stream current at the call
    if threads:
        torch.set_num_threads(threads)
    records, heldout, rank, info = build_training_data(
        loaded, n_layers=cfg.n_layers, data_minutes=data_minutes, max_new_tokens=max_new_tokens,
        text_windows=text_windows, data_dir=data_dir, progress=progress, samples=samples,
        sample_temperature=sample_temperature, sample_max_prompt=sample_max_prompt, self_questions=self_questions,
        topk=topk, command=command, log=log)
    model, layers = loaded.model, info["layers"]
    trainer = Trainer(model, records, cfg, out, heldout=heldout, vocab_rank=rank, data_info=info)
    if resume:
        if (Path(out).expanduser() / "glide.json").is_file():
            trainer.resume()
            print(f"resuming at step {trainer.state.step} ({trainer.state.tokens} tokens)", file=log)
        else:
            print(f"--resume: no checkpoint in {out} yet, starting fresh", file=log)
    print(f"training a {'vanilla' if cfg.vanilla else 'GliDe'} draft: {trainer.draft.n_trainable / 1e6:.2f} M "
          f"trainable parameters, target layers {layers if not cfg.vanilla else '-'}, threads "
          f"{torch.get_num_threads()}", file=log)
    return trainer.train(progress=progress, log=log)
