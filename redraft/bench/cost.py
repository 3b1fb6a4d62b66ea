"""`redraft bench cost`: the verify cost curve c(S) = time(S tokens) / time(1 token) on the chosen model.

After a prefix (default ~200 tokens) is in the KV cache, one forward over S tokens is timed for S = 1..max_s, with
logits for all S rows (what a verify forward over the root plus S-1 drafted tokens computes), and the cache is
cropped back to the prefix after each. Repeats sweep S up and down alternately, so slow drift on a shared machine
lands on every S alike; each S reports the median. A draft of d tokens pays only when it yields more than c(d+1)
tokens per forward, so this curve says how deep drafts may go.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

from redraft.tree import TokenTree


def cost_curve(model, *, max_s: int = 64, prefix: int = 200, repeats: int = 5, tree_mask: bool = False,
               seed: int = 0, prefix_ids=None, progress: bool = True) -> dict:
    """Measure c(S) for S = 1..max_s.

    Args:
        model: a transformers causal LM (or an HFTarget).
        prefix: cached tokens before each timed forward (random ids unless ``prefix_ids`` is given).
        repeats: timings per S (median reported).
        tree_mask: also time each S with the explicit 4D tree mask and position ids the tree verifier uses.
    Returns:
        {"prefix", "max_s", "repeats", "t1_s", "curves": {name: {"s": [...], "median_s": [...], "c": [...],
        "samples_s": [[...], ...]}}}.
    """
    # torch-bound: `redraft bench` imports this module while registering its flags
    from redraft.target import HFTarget
    from redraft.verify import tree_attention_mask, tree_positions

    target = model if isinstance(model, HFTarget) else HFTarget(model)
    rng = np.random.default_rng(seed)
    limit = target.max_length or (prefix + max_s + 1)
    if prefix_ids is None:
        prefix_ids = rng.integers(0, target.vocab_size, prefix).tolist()
    prefix_ids = [int(t) for t in prefix_ids][:max(1, limit - max_s)]
    n_prefix = len(prefix_ids)
    draft = rng.integers(0, target.vocab_size, max_s).tolist()
    variants = ["chain"] + (["tree mask"] if tree_mask else [])

    def inputs(variant: str, s: int):
        if variant == "chain":
            return None, None
        tree = TokenTree()
        tree.add_chain(draft[1:s], "bench")
        return (tree_positions(tree, n_prefix, 1), tree_attention_mask(tree, n_prefix, 1, target.dtype))

    prepared = {(v, s): inputs(v, s) for v in variants for s in range(1, max_s + 1)}
    target.reset()
    target.forward(prefix_ids, n_logits=1)
    for s in (1, max_s, 1, max_s):  # warm-up: first-call allocations
        target.forward(draft[:s], n_logits=s)
        target.crop(n_prefix)
    samples = {v: {s: [] for s in range(1, max_s + 1)} for v in variants}
    total = repeats * max_s * len(variants)
    bar = tqdm(total=total, desc="cost", unit="fwd", file=sys.stderr, disable=not progress)
    for r in range(repeats):
        order = list(range(1, max_s + 1))
        if r % 2:
            order.reverse()
        for s in order:
            for v in variants:
                pos, mask = prepared[(v, s)]
                t0 = time.perf_counter()
                target.forward(draft[:s], pos, mask, n_logits=s)
                dt = time.perf_counter() - t0
                target.crop(n_prefix)
                samples[v][s].append(dt)
                bar.update()
    bar.close()
    curves = {}
    t1 = statistics.median(samples["chain"][1])
    for v in variants:
        ss = list(range(1, max_s + 1))
        med = [statistics.median(samples[v][s]) for s in ss]
        curves[v] = {"s": ss, "median_s": med, "c": [m / t1 for m in med],
                     "samples_s": [samples[v][s] for s in ss]}
    return {"prefix": n_prefix, "max_s": max_s, "repeats": repeats, "t1_s": t1, "curves": curves}


def cost_markdown(cost: dict) -> str:
    """A table of c(S) at a few S values (all of them are in the JSON)."""
    names = list(cost["curves"])
    picks = [s for s in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128) if s <= cost["max_s"]]
    lines = [f"Verify cost c(S) = time(S) / time(1) after a {cost['prefix']}-token prefix on {cost['model']} "
             f"(median of {cost['repeats']}; t(1) = {1000 * cost['t1_s']:.1f} ms)", "",
             "| S | " + " | ".join(f"c(S) {n}" for n in names) + " | ms (chain) |",
             "| ---: |" + " ---: |" * (len(names) + 1)]
    for s in picks:
        cells = [f"{cost['curves'][n]['c'][s - 1]:.2f}" for n in names]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {1000 * cost['curves']['chain']['median_s'][s - 1]:.1f} |")
    return "\n".join(lines)
