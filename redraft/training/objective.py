"""The training objective and the held-out acceptance estimate of a GliDe draft.

- :func:`collate`: records -> one right-padded batch (ids, labels, positions, target KV, block mask).
- :func:`draft_loss`: next-token cross-entropy of the draft against the target's greedy labels
  (self-distillation), over the positions whose block sees at least one target KV entry; the vocabulary
  projection runs in row chunks so the [tokens x 49,152] logits never exist at once.
- :func:`estimate_acceptance`: what a chain of ``gamma`` drafts would get accepted on held-out target generations,
  computed teacher-forced in one pass (exact for greedy chains, see the function).

The block-wise mask (arXiv 2402.02082, section 3.1; blocks of 5): query i sees target KV j only if
block(j) < block(i), simulating inference, where every draft token of a step sees the target cache only up to
the step's root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from redraft.glide.network import GlideDraft
from redraft.glide.positions import block_mask
from redraft.training.data import Record


@dataclass
class Batch:
    """A right-padded batch.

    Attributes:
        ids: LongTensor [B, S] (padding 0).
        labels: LongTensor [B, S] target token ids, -100 at padding.
        pos: LongTensor [B, S] absolute positions 0..S-1.
        kv: per draft layer (keys, values) FloatTensor [B, Hkt, S, D], or None (vanilla / no KV stored).
        mask: BoolTensor [1, 1, S, S] block mask (True = attend).
        rows: BoolTensor [B, S] positions that count in the loss (real, labelled, sees >= 1 target KV entry,
            non-zero weight).
        weights: FloatTensor [B, S] loss weight per position (1 on generated positions, ``prompt_weight`` on
            the others).
        top_ids: LongTensor [B, S, k] the target's k most likely next tokens (-1 at padding), or None when the
            records carry none.
        top_p: FloatTensor [B, S, k] their probabilities renormalised over the k, or None.
    """

    ids: torch.Tensor
    labels: torch.Tensor
    pos: torch.Tensor
    kv: list | None
    mask: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_p: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.rows.sum())

    def to(self, device) -> Batch:
        """This batch with every tensor on ``device`` (a torch device or its name)."""
        def mv(t):
            return None if t is None else t.to(device)

        kv = None if self.kv is None else [(mv(k), mv(v)) for k, v in self.kv]
        return Batch(mv(self.ids), mv(self.labels), mv(self.pos), kv, mv(self.mask), mv(self.rows),
                     mv(self.weights), mv(self.top_ids), mv(self.top_p))


def collate(records: Sequence[Record], *, block: int = 5, offset: int = 0, with_kv: bool = True,
            dtype: torch.dtype = torch.float32, prompt_weight: float = 1.0) -> Batch:
    """Pad ``records`` into one :class:`Batch` with the block mask ``block(i) = (i + offset) // block``.

    ``prompt_weight`` weighs the positions before a record's generated part (whose labels are the target's
    predictions on human-written text) relative to the generated ones (the distribution drafts are used on);
    0 drops them from the loss.
    """
    B, S = len(records), max(len(r) for r in records)
    ids = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    weights = torch.zeros(B, S)
    for b, r in enumerate(records):
        ids[b, :len(r)] = r.ids
        labels[b, :len(r)] = r.labels
        # the last prompt position predicts the first generated token; text records have no generated part
        g = max(0, r.gen_start - 1) if r.gen_start < len(r) else len(r)
        weights[b, :g] = prompt_weight
        weights[b, g:len(r)] = 1.0
    kv = None
    if with_kv and records[0].k is not None:
        n_layers, hkt, _, d = records[0].k.shape
        kv = []
        for layer in range(n_layers):
            k = torch.zeros(B, hkt, S, d, dtype=dtype)
            v = torch.zeros(B, hkt, S, d, dtype=dtype)
            for b, r in enumerate(records):
                k[b, :, :len(r)] = r.k[layer].to(dtype)
                v[b, :, :len(r)] = r.v[layer].to(dtype)
            kv.append((k, v))
    top_ids = top_p = None
    if all(r.top_ids is not None for r in records):
        k = records[0].top_ids.shape[1]
        top_ids = torch.full((B, S, k), -1, dtype=torch.long)
        top_p = torch.zeros(B, S, k)
        for b, r in enumerate(records):
            top_ids[b, :len(r)] = r.top_ids.long()
            top_p[b, :len(r)] = torch.softmax(r.top_logp.float(), -1)
    mask = block_mask(S, S, block, offset)
    rows = (labels != -100) & mask.any(-1)[None, :] & (weights > 0)
    pos = torch.arange(S)[None].expand(B, S)
    return Batch(ids, labels, pos, kv, mask[None, None], rows, weights, top_ids, top_p)


def draft_loss(draft: GlideDraft, batch: Batch, *, head: torch.Tensor | None = None,
               lut: torch.Tensor | None = None, chunk: int = 1024, backward: bool = True,
               soft_weight: float = 0.0) -> tuple[float, int]:
    """Weighted mean next-token cross-entropy over ``batch.rows``; with ``backward`` also accumulates gradients.

    With ``soft_weight`` w > 0 and top-k targets in the batch, each position's loss is
    ``(1 - w) * CE(greedy label) + w * CE(target's top-k distribution)``: the second term is the cross-entropy
    against the target's probabilities renormalised over its k most likely tokens (those outside ``head`` are
    dropped), i.e. distillation of the target's distribution (Hinton et al. 2015) truncated to its top k.

    Args:
        head: [N, H] rows of the LM head used by the loss (default: the draft's own head, full or reduced).
        lut: LongTensor [vocab] token id -> row of ``head`` (-100 = not in it: the position is skipped).
        chunk: rows per vocabulary projection.
        soft_weight: weight of the top-k distillation term in [0, 1] (ignored when the batch has no top-k).
    Returns:
        (weighted mean loss in nats, number of positions it averages over).
    """
    h = draft(batch.ids, batch.pos, batch.kv, batch.mask)  # [B, S, H]
    if head is None:
        head = draft.sub_head if draft.vocab_ids is not None else draft.head_weight
        lut = None if draft.vocab_ids is None else draft.to_head_index(torch.arange(draft.head_weight.shape[0]))
    y = batch.labels[batch.rows]  # [R]
    if lut is not None:
        y = lut[y]
    keep = y >= 0
    n = int(keep.sum())
    if n == 0:
        return 0.0, 0
    hd = h.detach().requires_grad_(backward)
    x_all = hd[batch.rows][keep]  # [n, H]
    y = y[keep]
    w = batch.weights[batch.rows][keep]  # [n]
    w_sum = float(w.sum())
    soft = soft_weight > 0 and batch.top_ids is not None
    if soft:
        t_ids = batch.top_ids[batch.rows][keep]  # [n, k] token ids
        t_p = batch.top_p[batch.rows][keep]  # [n, k]
        if lut is not None:
            t_ids = torch.where(t_ids >= 0, lut[t_ids.clamp(min=0)], torch.full_like(t_ids, -100))
        t_p = torch.where(t_ids >= 0, t_p, torch.zeros_like(t_p))
        t_p = t_p / t_p.sum(-1, keepdim=True).clamp(min=1e-12)  # renormalise over the tokens the head has
        t_ids = t_ids.clamp(min=0)
    total = 0.0
    for s in range(0, n, chunk):
        logits = x_all[s:s + chunk] @ head.T  # [c, N]
        ce = F.cross_entropy(logits.float(), y[s:s + chunk], reduction="none")  # [c]
        if soft:
            logq = torch.log_softmax(logits.float(), -1).gather(-1, t_ids[s:s + chunk])  # [c, k]
            ce = (1 - soft_weight) * ce - soft_weight * (t_p[s:s + chunk] * logq).sum(-1)
        loss = (ce * w[s:s + chunk]).sum() / w_sum
        if backward:
            loss.backward(retain_graph=s + chunk < n)
        total += float(loss.detach())
    if backward:
        h.backward(hd.grad)
    return total, n


@torch.no_grad()
def estimate_acceptance(draft: GlideDraft, records: Sequence[Record], *, gamma: int = 4) -> dict:
    """Chain acceptance of ``gamma``-token drafts on held-out target generations, teacher-forced.

    With blocks of gamma + 1 positions, the block's first position r plays the root: the draft's predictions at
    r .. r+gamma-1 (each seeing target KV < r, as the block mask gives) are the chain it would propose, because
    every input after r is the target's own greedy token as long as the chain is still being accepted. A block
    counts if it lies in the generated part (inputs = the target's choices); its accepted count is the number of
    leading predictions equal to the target's labels. Every block phase is used (gamma + 1 passes per record),
    so every generated position serves as a root once.

    Returns:
        {"acceptance": accepted / (gamma x blocks), "tokens_per_forward": 1 + mean accepted, "blocks": n,
         "top1": per-position agreement over the same positions, "top1_by_depth": [gamma] agreement at draft
         depth 0 (the token after the root) .. gamma-1}.
    """
    was = draft.training
    draft.eval()
    device = draft.head_weight.device
    acc = blocks = agree = seen = 0
    by_depth = [0] * gamma
    size = gamma + 1
    for r in records:
        n = len(r)
        for phase in range(size):
            b = collate([r], block=size, offset=phase).to(device)
            h = draft(b.ids, b.pos, b.kv, b.mask)[0]  # [N, H]
            pred = draft.to_token_ids(draft.logits(h).argmax(-1)).cpu()  # [N]
            start = max(r.gen_start - 1, size)
            # roots are the block starts: positions s with (s + phase) % size == 0
            first = start + (-(start + phase)) % size
            for s in range(first, n - gamma, size):
                if not torch.equal(r.labels[s:s + gamma - 1], r.ids[s + 1:s + gamma]):
                    continue  # not on the target's own path
                ok = (pred[s:s + gamma] == r.labels[s:s + gamma]).tolist()
                a = 0
                while a < gamma and ok[a]:
                    a += 1
                acc += a
                blocks += 1
                agree += sum(ok)
                seen += gamma
                for d in range(gamma):
                    by_depth[d] += ok[d]
    draft.train(was)
    return {"acceptance": acc / (gamma * blocks) if blocks else 0.0,
            "tokens_per_forward": 1 + acc / blocks if blocks else 1.0,
            "blocks": blocks, "top1": agree / seen if seen else 0.0,
            "top1_by_depth": [round(x / blocks, 4) if blocks else 0.0 for x in by_depth]}
