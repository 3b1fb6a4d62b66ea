"""`redraft bench cost`: the verify cost curve c(S) = time(S tokens) / time(1 token) on the chosen model.

After a prefix (default ~200 tokens) is in the KV cache, one forward over S tokens is timed for S = 1..max_s, with
logits for all S rows (what a verify forward over the root plus S-1 drafted tokens computes), and the cache is
cropped back to the prefix after each. Repeats sweep S up and down alternately, so slow drift on a shared machine
lands on every S alike; each S reports the median. A draft of d tokens pays only when it yields more than c(d+1)
tokens per forward, so this curve says how deep drafts may go. The timing loop is the speculation policy's
(:func:`redraft.decoding.costmeasure.time_forwards`): this table and the policy's cost curve measure the same way.
"""

from __future__ import annotations

import statistics

import numpy as np


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
    from redraft.decoding.costmeasure import fit_prefix, time_forwards
    from redraft.decoding.target import HFTarget

    target = model if isinstance(model, HFTarget) else HFTarget(model)
    rng = np.random.default_rng(seed)
    if prefix_ids is None:
        prefix_ids = rng.integers(0, target.vocab_size, prefix).tolist()
    n_prefix = len(fit_prefix(target, prefix_ids, max_s))
    samples = time_forwards(target, range(1, max_s + 1), prefix_ids=prefix_ids, repeats=repeats,
                            tree_mask=tree_mask, seed=seed + 1, progress=progress)
    variants = list(samples)
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
