"""Timing verify forwards: the one measurement behind ``redraft bench cost`` and the policy's cost curve.

After a prefix is in the KV cache, one forward over S tokens is timed with logits for all S rows (what a verify
forward over the root plus S - 1 drafted tokens computes), and the cache is cropped back to the prefix after each.
Every timed forward sits between two 1-token reference forwards (a plain step), and its cost is the ratio to their
mean, so another job's burst of work on a shared machine cancels out of the ratio instead of landing in one size
of the curve (Measurements: docs/measurements.md#redraft-pricing-measure). Each repeat visits the sizes in a fresh random order, so a burst lands on sizes at random
rather than on neighbours. On llama.cpp, which keeps the compute graph of its last forward and builds one for each
new shape, a forward is priced as a decode loop meets it: after one-row steps, with the next one-row step's extra
time added (a verify forward costs a graph of its own and the plain step after it one more: docs/llama-cpp.md,
"Pricing the change of shape"). The cost curve is fitted from the ratios by :func:`redraft.pricing.fit.fit_costs`
(median per size, then non-decreasing and sub-additive where the samples' spread allows).

The target is duck-typed (``forward``, ``crop``, ``reset``, ``max_length``, ``vocab_size``, ``chain_only``,
``runtime``; the :class:`~redraft.runtimes.transformers.target.Target` protocol), so pricing sits below the decode step: a
caller holding a bare transformers model wraps it first (``HFTarget(model)``), and the tree verifier's mask and
positions come in as a function (``tree_inputs``) rather than from :mod:`redraft.decoding.verify`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from redraft.defaults import COST_PREFIX, COST_REPEATS, COST_SIZES
from redraft.pricing.curve import CostCurve
from redraft.pricing.fit import CostFit, fit_costs


def fit_prefix(target, prefix_ids: Sequence[int], max_s: int) -> list[int]:
    """``prefix_ids`` as ints, cut so that the prefix plus a forward of ``max_s`` tokens fits the context."""
    limit = target.max_length or (len(prefix_ids) + max_s + 1)
    return [int(t) for t in prefix_ids][:max(1, limit - max_s)]


def time_forwards(target, sizes: Sequence[int], *, prefix_ids: Sequence[int], repeats: int = COST_REPEATS,
                  tree_inputs: Callable[[Sequence[int], int], tuple] | None = None, seed: int = 0,
                  progress: bool = False, desc: str = "cost") -> dict[str, dict[int, list[float]]]:
    """Seconds per forward of S tokens for each S in ``sizes``, after ``prefix_ids`` is cached.

    Args:
        target: a :class:`~redraft.runtimes.transformers.target.Target` (duck-typed; its KV cache is reset).
        sizes: forward sizes S >= 1 in tokens (root + S - 1 draft tokens).
        prefix_ids: token ids cached before every timed forward (at least one; cut so prefix + max S fits the
            model's context).
        repeats: timings per size.
        tree_inputs: ``tree_inputs(draft ids after the root, prefix length) -> (position ids, 4D mask)``, the tree
            verifier's inputs for a chain draft: each S is also timed with them (not on a ``chain_only`` target);
            None: chain forwards only.
        seed: the random draft ids' seed.
    Returns:
        {"chain": {S: [seconds] * repeats}, ["tree mask": {...}], "reference": {S: [seconds] * repeats}}:
        "reference" holds, per timed sample of S, the mean of the two 1-token forwards timed right before and right
        after it (:func:`ratios` divides by it). On a runtime that keeps the compute graph of its last forward
        (llama.cpp) a sample is instead what the forward adds to a plain decoding stream: its own time, right after
        one-row steps, plus what the one-row step after it takes beyond the reference (zero when it takes less),
        the reference being the median of the last three one-row steps after one-row steps. Sizes are visited in a
        random order per repeat (``seed``).
    Raises:
        ValueError: empty sizes, a size < 1, repeats < 1 or an empty prefix.
    """
    import torch

    from redraft.io.progress import Progress

    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1 or repeats < 1 or len(prefix_ids) == 0:
        raise ValueError(f"time_forwards needs sizes >= 1, repeats >= 1 and a prefix; got sizes {sizes}, "
                         f"repeats {repeats}, prefix of {len(prefix_ids)} ids")
    tree_mask = tree_inputs is not None and not target.chain_only
    max_s = max(sizes)
    prefix = fit_prefix(target, prefix_ids, max_s)
    n_prefix = len(prefix)
    draft = np.random.default_rng(seed).integers(0, target.vocab_size, max_s).tolist()
    variants = ["chain"] + (["tree mask"] if tree_mask else [])

    def inputs(variant: str, s: int):
        if variant == "chain" or tree_inputs is None:
            return None, None
        return tree_inputs(draft[1:s], n_prefix)

    prepared = {(v, s): inputs(v, s) for v in variants for s in sizes}
    # llama.cpp keeps the compute graph of its last forward and builds a new one when the shape changes: in a decode
    # loop a verify forward follows plain one-row steps and is followed by one, so both pay for a graph of their
    # own (0.3-0.6 ms against a 13 ms step, 1 thread; docs/llama-cpp.md, "Pricing the change of shape")
    switch = target.runtime != "transformers"
    device = getattr(target, "device", None)
    # an accelerator runs asynchronously: wait for the forward, or only its launch is timed
    sync = (lambda: torch.cuda.synchronize(device)) if getattr(device, "type", "cpu") == "cuda" else (lambda: None)
    target.reset()
    target.forward(prefix, n_logits=1)
    for s in (1, max_s, 1, max_s):  # warm-up: first-call allocations
        target.forward(draft[:s], n_logits=s)
        target.crop(n_prefix)
    samples: dict[str, dict[int, list[float]]] = {v: {s: [] for s in sizes} for v in variants + ["reference"]}
    order_rng = np.random.default_rng(seed + 1)

    def timed(tokens, pos=None, mask=None) -> float:
        t0 = time.perf_counter()
        target.forward(tokens, pos, mask, n_logits=len(tokens))
        sync()
        elapsed = time.perf_counter() - t0
        target.crop(n_prefix)
        return elapsed

    bar = Progress(total=repeats * len(sizes) * len(variants), desc=desc, unit="fwd", noun="forward",
                   enabled=progress)
    recent: list[float] = []
    if switch:  # the reference is then the median of the last three one-row steps after one-row steps (graph
        # reused): one step slowed by the machine would otherwise skew a whole round, or make an extra negative
        timed(draft[:1])
        recent = [timed(draft[:1]) for _ in range(3)]
    ref = float(np.median(recent)) if switch else timed(draft[:1])
    for _ in range(repeats):
        for s in order_rng.permutation(sorted(set(sizes))).tolist():
            for v in variants:
                pos, mask = prepared[(v, s)]
                elapsed = timed(draft[:s], pos, mask)
                if switch:  # the next plain step's extra (its one-row graph built again); never below nothing: a
                    # step faster than the reference is the machine's jitter
                    elapsed += max(0.0, timed(draft[:1]) - ref)
                samples[v][s].append(elapsed)
                bar.update()
            after = timed(draft[:1])
            samples["reference"][s].append(ref if switch else 0.5 * (ref + after))
            if switch:
                recent = recent[1:] + [after]
                ref = float(np.median(recent))
            else:
                ref = after
    bar.close()
    target.reset()
    return samples


def ratios(samples: dict[str, dict[int, list[float]]], variant: str = "chain") -> dict[int, list[float]]:
    """Per size S, each sample's time over its reference 1-token forwards' (unitless), from :func:`time_forwards`."""
    ref = samples["reference"]
    return {s: [t / r for t, r in zip(ts, ref[s], strict=True)] for s, ts in samples[variant].items()}


def measure_cost_curve(target, sizes: Sequence[int] = COST_SIZES, *, prefix: int = COST_PREFIX,
                       repeats: int = COST_REPEATS, seed: int = 0, progress: bool = False) -> CostCurve:
    """Measure c(n) at ``sizes`` draft tokens (chain verify forwards, median of ``repeats``).

    Args:
        target: a :class:`~redraft.runtimes.transformers.target.Target` (duck-typed, either runtime).
        sizes: draft token counts n (0 is added when missing); a forward of 1 + n tokens is timed for each. Sizes
            whose forward does not fit the model's context are left out (:class:`CostCurve` extends its last
            segment past them).
        prefix: random ids cached before each timed forward (cut so the largest forward fits the context).
    Returns:
        :class:`CostCurve` with c(0) = 1, fitted by :func:`redraft.pricing.fit.fit_costs` (median ratio per
        size, non-decreasing and sub-additive where the samples' spread allows). Takes roughly
        repeats x (sum(c(n)) + len(sizes)) x t(1) seconds (Measurements: docs/measurements.md#redraft-pricing-measure).
    """
    return measure_cost_fit(target, sizes, prefix=prefix, repeats=repeats, seed=seed, progress=progress).curve


def measure_cost_fit(target, sizes: Sequence[int] = COST_SIZES, *, prefix: int = COST_PREFIX,
                     repeats: int = COST_REPEATS, seed: int = 0, progress: bool = False) -> CostFit:
    """As :func:`measure_cost_curve`, returning the whole :class:`~redraft.pricing.fit.CostFit` (the medians and
    interquartile ranges beside the fitted curve)."""
    ns = sorted(set(int(n) for n in sizes) | {0})
    if target.max_length:  # a forward of 1 + n tokens after at least one cached id must fit the context
        ns = [n for n in ns if n + 2 <= target.max_length]
    prefix_ids = np.random.default_rng(seed).integers(0, target.vocab_size, max(1, prefix)).tolist()
    samples = ratios(time_forwards(target, [n + 1 for n in ns], prefix_ids=prefix_ids, repeats=repeats,
                                   seed=seed + 1, progress=progress, desc="cost curve"))
    return fit_costs(ns, [samples[n + 1] for n in ns])
