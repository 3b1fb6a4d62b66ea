"""GliDe drafter: a small draft model that cross-attends to the target's KV cache of the verified prefix.

Inference as in arXiv 2402.02082 (section 3.1): the target's bonus token (the live context's last token) is the
root; the draft proposes ``gamma`` tokens greedily, running its own small self-attention KV cache while its
cross-attention queries read the target's cache, which at ``propose`` time holds exactly the verified prefix
(every context token but the root). After drafting, the draft's cache is cut back to the verified context, so
nothing drafted survives into the next step. With :class:`~redraft.drafters.cape.CapeBins` the chain is widened
into a CaPE token tree (section 3.2).

The drafter needs the engine's :class:`~redraft.runtimes.transformers.target.HFTarget` (the same object the engine verifies with): the
engine binds it before every generation (:meth:`GlideDrafter.bind`); pass it at construction to draft outside an
engine. The target's cache is read only through :meth:`HFTarget.verified_kv <redraft.runtimes.transformers.target.HFTarget.verified_kv>`.
"""

from __future__ import annotations

import numpy as np
import torch

from redraft.defaults import GLIDE_GAMMA
from redraft.drafters.base import AcceptanceGuard
from redraft.drafters.cape import CapeBins, expand
from redraft.glide.network import DraftCache, GlideDraft
from redraft.glide.positions import prefix_mask
from redraft.tree import TokenTree


class GlideDrafter:
    """Proposes GliDe drafts (a chain, or a CaPE tree).

    Args:
        draft: a trained :class:`GlideDraft` (or a vanilla one: then the target cache is not read).
        target: an HFTarget, or None: the engine binds its own before every generation.
        gamma: draft depth (tokens along the greedy spine), default 4.
        cape: CaPE confidence bins, or None for a plain chain.
        guard: optional acceptance guard (pauses the drafter while its drafts keep failing).
        name: source name in the engine's statistics.
    """

    def __init__(self, draft: GlideDraft, target=None, *, gamma: int = GLIDE_GAMMA, cape: CapeBins | None = None,
                 guard: AcceptanceGuard | None = None, name: str = "glide") -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.draft = draft.eval()
        self.target = target
        self.gamma, self.cape, self.guard, self.name = gamma, cape, guard, name
        self._depth = 0  # levels of the last proposal (what the guard counts as proposed)
        self.layers = draft.cfg.target_layers
        self.begin(np.zeros(0, dtype=np.int64))

    def bind(self, target) -> None:
        """Read the verified KV cache of ``target`` (the engine's :class:`~redraft.runtimes.transformers.target.HFTarget`)."""
        self.target = target

    def begin(self, prompt: np.ndarray) -> None:
        """A new sequence: an empty draft cache, a re-armed guard."""
        self.cache = DraftCache(self.draft.cfg.n_layers)
        self.ids: list[int] = []  # tokens whose draft KV is in self.cache, in order
        if self.guard is not None:
            self.guard.rearm()

    def _sync(self, ctx: list[int]) -> int:
        """Cut the draft cache back to its longest prefix shared with ``ctx``, leaving the root to feed.

        Returns m, the number of leading context tokens whose draft KV is kept (m <= len(ctx) - 1).
        """
        m, limit = 0, min(len(self.ids), len(ctx) - 1)
        while m < limit and self.ids[m] == ctx[m]:
            m += 1
        if m < self.cache.length:
            self.cache.crop(m)
        self.ids = self.ids[:m]
        return m

    @torch.inference_mode()
    def propose(self, context: np.ndarray, max_depth: int) -> TokenTree | None:
        """Draft up to ``min(gamma, max_depth)`` tokens after ``context`` (whose last token is the root).

        Returns None at prefill (the target cache is still empty), while the guard pauses the drafter, or when
        the target cache is not the verified prefix the drafter expects.
        Raises:
            RuntimeError: no target bound.
        """
        if self.target is None:
            raise RuntimeError("GlideDrafter has no target: pass an HFTarget or call bind(target) (the engine does)")
        depth = min(self.gamma, max_depth)
        L, n_vis = len(context), self.target.length
        if depth <= 0 or n_vis == 0 or n_vis >= L:
            return None
        if self.guard is not None and not self.guard.active:
            return None
        ctx = context.tolist()
        m = self._sync(ctx)
        # per draft layer i, target layer L_T - L_D + i: (keys, values) [1, Hkt, n_vis, D]
        kv = self.target.verified_kv(self.layers, n_vis) if self.draft.cfg.cross_attention else None
        draft = self.draft

        # feed the context tokens the draft has not seen (at least the root), at their absolute positions
        dev = draft.embed_weight.device  # the target's device (a GPU run drafts there too)
        ids = torch.tensor([ctx[m:]], dtype=torch.long, device=dev)  # [1, S]
        pos = torch.arange(m, L, device=dev)[None]  # [1, S]
        mask = prefix_mask(pos[0], n_vis)[None, None] if (kv is not None and m < n_vis) else None  # [1,1,S,T]
        h = draft(ids, pos, kv, mask, self.cache)[:, -1]  # [1, H] hidden of the root
        self.ids.extend(ctx[m:])

        spine: list[int] = []
        alts: list[list[int]] = []
        for step in range(depth):
            logits = draft.logits(h)[0]  # [V']
            if self.cape is None:
                tok = int(draft.to_token_ids(logits.argmax()))
            else:
                k = self.cape.max_extras + 1
                probs = torch.softmax(logits.float(), -1)
                top_p, top_i = probs.topk(min(k, probs.shape[0]))
                top_ids = draft.to_token_ids(top_i).tolist()
                tok = top_ids[0]
                alts.append(top_ids[1:1 + self.cape.extras_for(float(top_p[0]))])
            spine.append(tok)
            if step + 1 < depth:  # the last drafted token never needs to be fed
                nxt = torch.tensor([[tok]], dtype=torch.long, device=dev)
                h = draft(nxt, torch.tensor([[L + step]], device=dev), kv, None, self.cache)[:, -1]

        self.cache.crop(L)  # forget the drafted tokens: only the verified context stays
        self._depth = len(spine)
        return TokenTree.chain(spine, self.name) if self.cape is None else expand(spine, alts, self.name)

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        """Feed the guard, if any (see :meth:`redraft.drafters.base.Drafter.observe`)."""
        # the guard judges a CaPE tree by its depth, not its node count: at most one node per level can be
        # accepted, so counting the siblings would pause the drafter at its first tree
        if self.guard is not None:
            self.guard.record(min(proposed, self._depth or proposed), accepted, emitted)

