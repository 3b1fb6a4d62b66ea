"""`redraft bench cost`: the verify cost curve c(S) = time(S tokens) / time(1 token) on the chosen model.

After a prefix (default ~200 tokens) is in the KV cache, one forward over S tokens is timed for S = 1..max_s, with
logits for all S rows (what a verify forward over the root plus S-1 drafted tokens computes), and the cache is
cropped back to the prefix after each. Each timed forward sits between two 1-token reference forwards and counts as
its ratio to their mean, and each repeat visits the sizes in a random order, so a burst of another job's work on a
shared machine neither moves one size against the 1-token step nor lands on neighbouring sizes; each S reports the
median ratio (the raw seconds are in the JSON). A draft of d tokens pays only when it yields more than c(d+1)
tokens per forward, so this curve says how deep drafts may go. The timing loop is the speculation policy's
(:func:`redraft.pricing.measure.time_forwards`): this table and the policy's cost curve measure the same way.
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
        "samples_s": [[...], ...]}}}: ``c`` is the median ratio to the reference forwards over the 1-token forward's (so c(1) = 1), ``samples_c``
        the ratios, ``t1_s`` the reference forwards' median.
    """
    # torch-bound: `redraft bench` imports this module while registering its flags
    from redraft.decoding.verify import chain_inputs
    from redraft.pricing.measure import fit_prefix, ratios, time_forwards
    from redraft.runtimes.transformers.target import HFTarget

    target = model if isinstance(model, HFTarget) else HFTarget(model)
    rng = np.random.default_rng(seed)
    if prefix_ids is None:
        prefix_ids = rng.integers(0, target.vocab_size, prefix).tolist()
    n_prefix = len(fit_prefix(target, prefix_ids, max_s))
    samples = time_forwards(target, range(1, max_s + 1), prefix_ids=prefix_ids, repeats=repeats,
                            tree_inputs=chain_inputs(target.dtype) if tree_mask else None, seed=seed + 1,
                            progress=progress)
    variants = [v for v in samples if v != "reference"]
    curves = {}
    t1 = statistics.median(t for ts in samples["reference"].values() for t in ts)
    for v in variants:
        ss = list(range(1, max_s + 1))
        rel = ratios(samples, v)
        one = statistics.median(ratios(samples, "chain")[1])  # the 1-token forward against its references (~1)
        curves[v] = {"s": ss, "median_s": [statistics.median(samples[v][s]) for s in ss],
                     "c": [statistics.median(rel[s]) / one for s in ss], "samples_s": [samples[v][s] for s in ss],
                     "samples_c": [rel[s] for s in ss]}
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
