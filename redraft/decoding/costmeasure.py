"""Timing verify forwards: the one measurement behind ``redraft bench cost`` and the policy's cost curve.

After a prefix is in the KV cache, one forward over S tokens is timed with logits for all S rows (what a verify
forward over the root plus S - 1 drafted tokens computes), and the cache is cropped back to the prefix after each.
Repeats sweep the sizes up and down alternately, so slow drift on a shared machine lands on every size alike; the
median of the repeats is what counts.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from redraft.defaults import COST_PREFIX, COST_REPEATS, COST_SIZES
from redraft.policy.costcurve import CostCurve


def fit_prefix(target, prefix_ids: Sequence[int], max_s: int) -> list[int]:
    """``prefix_ids`` as ints, cut so that the prefix plus a forward of ``max_s`` tokens fits the context."""
    limit = target.max_length or (len(prefix_ids) + max_s + 1)
    return [int(t) for t in prefix_ids][:max(1, limit - max_s)]


def time_forwards(model, sizes: Sequence[int], *, prefix_ids: Sequence[int], repeats: int = COST_REPEATS,
                  tree_mask: bool = False, seed: int = 0, progress: bool = False,
                  desc: str = "cost") -> dict[str, dict[int, list[float]]]:
    """Seconds per forward of S tokens for each S in ``sizes``, after ``prefix_ids`` is cached.

    Args:
        model: a transformers causal LM or an :class:`~redraft.decoding.target.HFTarget` (its KV cache is reset).
        sizes: forward sizes S >= 1 in tokens (root + S - 1 draft tokens).
        prefix_ids: token ids cached before every timed forward (at least one; cut so prefix + max S fits the
            model's context).
        repeats: timings per size.
        tree_mask: also time each S with the explicit 4D tree mask and position ids the tree verifier uses.
        seed: the random draft ids' seed.
    Returns:
        {"chain": {S: [seconds] * repeats}, ["tree mask": {...}]}.
    Raises:
        ValueError: empty sizes, a size < 1, repeats < 1 or an empty prefix.
    """
    import torch
    from tqdm import tqdm

    from redraft.decoding.target import HFTarget
    from redraft.decoding.verify import tree_attention_mask, tree_positions
    from redraft.tree import TokenTree

    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1 or repeats < 1 or len(prefix_ids) == 0:
        raise ValueError(f"time_forwards needs sizes >= 1, repeats >= 1 and a prefix; got sizes {sizes}, "
                         f"repeats {repeats}, prefix of {len(prefix_ids)} ids")
    target = model if isinstance(model, HFTarget) else HFTarget(model)
    max_s = max(sizes)
    prefix = fit_prefix(target, prefix_ids, max_s)
    n_prefix = len(prefix)
    draft = np.random.default_rng(seed).integers(0, target.vocab_size, max_s).tolist()
    variants = ["chain"] + (["tree mask"] if tree_mask else [])

    def inputs(variant: str, s: int):
        if variant == "chain":
            return None, None
        tree = TokenTree()
        tree.add_chain(draft[1:s], "bench")
        return tree_positions(tree, n_prefix, 1), tree_attention_mask(tree, n_prefix, 1, target.dtype)

    prepared = {(v, s): inputs(v, s) for v in variants for s in sizes}
    param = next(target.model.parameters())
    # an accelerator runs asynchronously: wait for the forward, or only its launch is timed
    sync = (lambda: torch.cuda.synchronize(param.device)) if param.device.type == "cuda" else (lambda: None)
    target.reset()
    target.forward(prefix, n_logits=1)
    for s in (1, max_s, 1, max_s):  # warm-up: first-call allocations
        target.forward(draft[:s], n_logits=s)
        target.crop(n_prefix)
    samples: dict[str, dict[int, list[float]]] = {v: {s: [] for s in sizes} for v in variants}
    bar = tqdm(total=repeats * len(sizes) * len(variants), desc=desc, unit="fwd", file=sys.stderr,
               disable=not progress)
    for r in range(repeats):
        for s in (sorted(sizes, reverse=True) if r % 2 else sorted(sizes)):
            for v in variants:
                pos, mask = prepared[(v, s)]
                t0 = time.perf_counter()
                target.forward(draft[:s], pos, mask, n_logits=s)
                sync()
                samples[v][s].append(time.perf_counter() - t0)
                target.crop(n_prefix)
                bar.update()
    bar.close()
    target.reset()
    return samples


def measure_cost_curve(model, sizes: Sequence[int] = COST_SIZES, *, prefix: int = COST_PREFIX,
                       repeats: int = COST_REPEATS, seed: int = 0, progress: bool = False) -> CostCurve:
    """Measure c(n) at ``sizes`` draft tokens (chain verify forwards, median of ``repeats``).

    Args:
        model: a transformers causal LM or an HFTarget.
        sizes: draft token counts n (0 is added when missing); a forward of 1 + n tokens is timed for each. Sizes
            whose forward does not fit the model's context are left out (:class:`CostCurve` extends its last
            segment past them).
        prefix: random ids cached before each timed forward (cut so the largest forward fits the context).
    Returns:
        :class:`CostCurve` with c(0) = 1. Takes roughly repeats x sum(c(n)) x t(1) seconds (~6 s for the
        defaults on the 2-core development CPU).
    """
    from redraft.decoding.target import HFTarget

    target = model if isinstance(model, HFTarget) else HFTarget(model)
    ns = sorted(set(int(n) for n in sizes) | {0})
    if target.max_length:  # a forward of 1 + n tokens after at least one cached id must fit the context
        ns = [n for n in ns if n + 2 <= target.max_length]
    prefix_ids = np.random.default_rng(seed).integers(0, target.vocab_size, max(1, prefix)).tolist()
    samples = time_forwards(target, [n + 1 for n in ns], prefix_ids=prefix_ids, repeats=repeats, seed=seed + 1,
                            progress=progress, desc="cost curve")["chain"]
    return CostCurve.from_times(ns, [statistics.median(samples[n + 1]) for n in ns])
