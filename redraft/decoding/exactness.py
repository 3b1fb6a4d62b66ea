"""Exact mode's near-tie test: how far a row computed with drafts may be from plain decoding's row, per dtype.

Plain greedy decoding feeds the prompt in one forward, then one token per forward. A verify forward computes the
same positions several rows at a time, and every later forward reads KV entries that such wider forwards wrote.
Kernels round differently by shape (on the CPU a one-row matrix product takes another path than a two-row one;
attention blocks by query count), so the rows differ. One rounding flip early in the network decorrelates every
later rounding, so the difference scales with the dtype's precision and the size of the logits, as a fraction of
the row's largest |logit|: :func:`measure_row_noise` measures it per dtype, and ``defaults.EXACT_ROW_NOISE`` holds
1.5x the largest measured (:func:`row_noise`). A row's choice can only differ from plain decoding's where the row
moved the gap between plain decoding's choice and a rival by more than the row's own top-2 gap, and the logits of
the closest rivals move largely together, so those gaps' changes (:func:`measure_gap_noise`) stay below twice the
row-noise bound; ``defaults.EXACT_GAP_NOISE`` holds 1.5x the largest measured (:func:`gap_noise`). A row's choice
is trusted only when its top-2 gap
exceeds that bound times a safety factor (:func:`near_tie_threshold`; dtypes without a measured gap bound, and rows
reshaped by logits processors, use twice the row-noise bound); closer rows are recomputed exactly the way plain
decoding computes them (:class:`redraft.decoding.exact_mode.ExactMode`).

One token fed alone on a cache that verify forwards wrote (exact mode's draft-free recompute) runs plain decoding's
own forward shape; only the cached entries differ. :func:`measure_settle_noise` measures those rows apart at every
position; they are judged against the same bound as verify rows (with ``defaults.EXACT_SETTLE_SAFETY``).

Measurements: docs/measurements.md#redraft-decoding-exactness
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from redraft.decoding.verify import tree_attention_mask, tree_positions
from redraft.defaults import EXACT_GAP_NOISE, EXACT_ROW_NOISE
from redraft.runtimes.transformers.target import HFTarget
from redraft.tree import TokenTree

# dtypes the measurement has not covered: this many machine epsilons of the largest |logit| (float32 measured ~21)
UNMEASURED_NOISE_EPS = 64


def _key(numerics: torch.dtype | str) -> str:
    """The noise tables' key: a runtime's own (``Target.numerics``, e.g. "llama.cpp") or a dtype's name."""
    return numerics if isinstance(numerics, str) else str(numerics).removeprefix("torch.")


def row_noise(dtype: torch.dtype | str) -> float:
    """Bound on |verify row - plain row| as a fraction of the row's largest |logit|, for weights of ``dtype`` (or the
    runtime a ``Target.numerics`` key names).

    Measured values from ``defaults.EXACT_ROW_NOISE``; a torch dtype it lacks gets UNMEASURED_NOISE_EPS machine
    epsilons. Raises KeyError for a runtime key the table lacks (no runtime is trusted unmeasured).
    """
    name = _key(dtype)
    if name in EXACT_ROW_NOISE:
        return EXACT_ROW_NOISE[name]
    if isinstance(dtype, str) and not hasattr(torch, name):
        raise KeyError(f"no measured verify-row noise for the {name!r} runtime (defaults.EXACT_ROW_NOISE)")
    return UNMEASURED_NOISE_EPS * torch.finfo(dtype if not isinstance(dtype, str) else getattr(torch, name)).eps


def gap_noise(dtype: torch.dtype | str) -> float:
    """Bound on how much a row computed with drafts moves the gap l[a] - l[c] between plain decoding's choice a and
    one of its closest rivals c, as a fraction of the row's largest |logit|, for weights of ``dtype``.

    Measured values from ``defaults.EXACT_GAP_NOISE`` (:func:`measure_gap_noise`); a dtype it lacks gets the bound that
    :func:`row_noise` implies (each of the two logits moving by at most that: twice it).
    """
    name = _key(dtype)
    if name in EXACT_GAP_NOISE:
        return EXACT_GAP_NOISE[name]
    return 2.0 * row_noise(dtype)


def near_tie_threshold(logits: torch.Tensor, dtype: torch.dtype | str, safety: float, gaps: bool = True) -> torch.Tensor:
    """Top-2 gap (logit units) below which each row's choice may differ from plain decoding's.

    A row chooses another token c than plain decoding's a only if its gap to the runner-up is at most the change of
    l[a] - l[c] between the two rows (its own gap l[c] - l[a] >= 0 is then that change minus plain decoding's gap
    l[a] - l[c] >= 0), so a top-2 gap above the bound on that change picks plain decoding's token: :func:`gap_noise`
    times the row's largest |logit|. With ``gaps=False`` the bound is the one every logit's own change implies,
    2 x :func:`row_noise` x the largest |logit|: for rows reshaped by logits processors that are not invariant to a
    shift of every logit (a repetition penalty scales positive and negative logits apart), where the gaps' bound
    does not carry over.

    Args:
        logits: FloatTensor [R, V] (any float dtype), the rows whose choices are judged.
        dtype: the target model's weight dtype, or its runtime's ``Target.numerics`` key.
        safety: multiple of that bound (>= 1).
        gaps: the measured bound on gap changes (True) or the one each logit's change implies (False).
    Returns:
        FloatTensor [R] (float32): ``safety * bound * max |logits[r]|``.
    """
    bound = gap_noise(dtype) if gaps else 2.0 * row_noise(dtype)
    if bound == 0.0:  # a batch-invariant runtime: every row is plain decoding's row, no pass over the logits
        return torch.zeros(logits.shape[0], dtype=torch.float32)
    # max |x| as max(max x, -min x): two reductions, no |logits| copy (equal bit for bit: both are exact)
    largest = torch.maximum(logits.amax(-1), logits.amin(-1).neg()).float()
    return largest * (safety * bound)


def _rows(target: HFTarget, seq: Sequence[int], n_prompt: int, chunks: Sequence[int]) -> torch.Tensor:
    """Logits (float32, [len(seq) - n_prompt, V]) of the rows choosing positions n_prompt.., fed in these chunks.

    The first chunk is the prompt plus chunks[0] tokens; each later one chunks[i] tokens (the last chunk repeats).
    """
    target.reset()
    first = chunks[0]
    out = [target.forward(list(seq[:n_prompt + first]), n_logits=first + 1).float()]
    i, c = n_prompt + first, chunks[-1]
    while i < len(seq):
        step = min(c, len(seq) - i)
        out.append(target.forward(list(seq[i:i + step]), n_logits=step).float())
        i += step
    return torch.cat(out)[:len(seq) - n_prompt]


def _tree_rows(target: HFTarget, seq: Sequence[int], n_prompt: int, depth: int, branches: int) -> torch.Tensor:
    """Rows of the right path when each verify forward holds the true next ``depth`` tokens plus ``branches``
    wrong siblings at every depth (a tree mask, as merged drafts give); the accepted path is kept, as the engine
    keeps it."""
    target.reset()
    vocab = target.vocab_size
    pending, n_ctx, out = list(seq[:n_prompt]), n_prompt, []
    while n_ctx < len(seq):
        tree, path, parent = TokenTree(), [], -1
        for t in seq[n_ctx:n_ctx + depth]:
            node = tree.add_node(parent, int(t), "true")
            for b in range(branches):
                tree.add_node(parent, (int(t) + 1 + b) % vocab, "wrong")
            path.append(node)
            parent = node
        n_past, n_pend = target.length, len(pending)
        logits = target.forward(pending + tree.tokens, tree_positions(tree, n_past, n_pend),
                                tree_attention_mask(tree, n_past, n_pend, target.dtype), n_logits=len(tree) + 1)
        out.append(logits[[0] + [i + 1 for i in path]].float())
        target.keep(n_past + n_pend, [n_past + n_pend + i for i in path])
        n_ctx += len(path) + 1
        pending = [int(seq[n_ctx - 1])] if n_ctx <= len(seq) else []
    return torch.cat(out)[:len(seq) - n_prompt]


def _settle_rows(target: HFTarget, seq: Sequence[int], n_prompt: int, depth: int,
                 first: int | None = None) -> torch.Tensor:
    """Rows of one token fed alone on a cache that chain verify forwards of ``depth`` drafts wrote (what exact
    mode's draft-free recompute sees), one per forward; NaN rows where none was computed.

    The first forward holds the prompt and ``first`` output tokens (default ``depth``); each later one re-feeds the
    last token alone (the row measured), then the next ``depth + 1`` tokens.
    """
    target.reset()
    first = depth if first is None else first
    out = torch.full((len(seq) - n_prompt, target.vocab_size), float("nan"))
    target.forward(list(seq[:n_prompt + first]), n_logits=1)
    i = n_prompt + first
    while i < len(seq):
        target.crop(target.length - 1)  # the last token again, alone
        out[i - n_prompt] = target.forward([int(seq[i - 1])], n_logits=1)[0].float()
        step = min(depth + 1, len(seq) - i)
        target.forward(list(seq[i:i + step]), n_logits=step)
        i += step
    return out


def _recompute_rows(target: HFTarget, seq: Sequence[int], n_prompt: int, depth: int, first: int) -> torch.Tensor:
    """Rows of each output position's last token fed alone on the cache that chain verify forwards of ``depth``
    drafts wrote (the first holding the prompt and ``first`` output tokens): exact mode's draft-free recompute right
    after a verify forward was cut. Computed from the last position back, each one cropping the cache to its own
    prefix; NaN for the first output token (its row is the prompt forward's).
    """
    _rows(target, seq, n_prompt, [first, depth + 1])
    out = torch.full((len(seq) - n_prompt, target.vocab_size), float("nan"))
    for j in range(len(seq) - n_prompt - 1, 0, -1):
        target.crop(n_prompt + j - 1)
        out[j] = target.forward([int(seq[n_prompt + j - 1])], n_logits=1)[0].float()
    return out


def measure_row_noise(target: HFTarget, seq: Sequence[int], n_prompt: int, depths: Sequence[int] = (1, 2, 4, 8, 16),
                      branches: int = 2) -> dict[str, tuple[float, float]]:
    """Largest difference between rows computed with drafts and plain decoding's rows, by way of computing.

    Args:
        target: the target model (its cache is reset).
        seq: prompt + plain greedy output (token ids), the output at least 2 tokens.
        n_prompt: prompt length.
        depths: chain draft depths to try (always-right drafts: every row is a verify row); those not shorter than
            the output are skipped.
        branches: wrong siblings per depth in the tree measurement (at the largest depth).
    Returns:
        {kind: (relative, absolute)}: max over rows of max |row - plain row|, divided by the plain row's largest
        |logit| (relative) and in logit units (absolute). Kinds: "chain K=k", "tree", "single after drafts"
        (one token alone on a cache verify forwards wrote; absent on a ``chain_only`` target) and "plain again" (plain decoding repeated: 0 unless
        the kernels are not deterministic).
    """
    depths = [k for k in depths if k < len(seq) - n_prompt] or [1]  # a first forward holds the prompt + K drafts
    plain = _rows(target, seq, n_prompt, [0, 1])
    scale = plain.abs().amax(-1)
    found: dict[str, torch.Tensor] = {"plain again": _rows(target, seq, n_prompt, [0, 1])}
    for k in depths:
        found[f"chain K={k}"] = _rows(target, seq, n_prompt, [k, k + 1])
    if not target.chain_only:  # a target that verifies chains only has no tree rows to measure
        found["tree"] = _tree_rows(target, seq, n_prompt, max(depths), branches)
    found["single after drafts"] = _settle_rows(target, seq, n_prompt, min(depths[-1], 4))
    out = {}
    for kind, rows in found.items():
        ok = ~rows.isnan().any(-1)
        diff = (rows[ok] - plain[ok]).abs().amax(-1)
        out[kind] = ((diff / scale[ok]).max().item(), diff.max().item()) if ok.any() else (0.0, 0.0)
    target.reset()
    return out


def measure_settle_noise(target: HFTarget, seq: Sequence[int], n_prompt: int,
                         depths: Sequence[int] = (1, 2, 4, 8, 16, 32, 48)) -> dict[str, tuple[float, float, int]]:
    """How far a draft-free row on a cache that verify forwards wrote is from plain decoding's row, by draft depth.

    Exact mode recomputes a near-tie verify row as one token fed alone on the cache as it is (its KV entries written
    by the prompt's forward with drafts and by later verify forwards): the row's own forward is shaped as plain
    decoding's, only the cached entries differ. This measures that difference at every output position: for each
    depth K, chain verify forwards of K always-right drafts write the cache (the first one holding the prompt and
    ``o`` output tokens, for every offset ``o`` in 1..K+1), and each position's last token is fed again alone.
    The verify rows themselves (chain K, first forward holding the prompt + K drafts) are measured alongside.

    Args:
        target: the target model (its cache is reset).
        seq: prompt + plain greedy output (token ids), the output at least 2 tokens.
        n_prompt: prompt length.
        depths: chain draft depths; those not shorter than the output are skipped.
    Returns:
        {kind: (relative, absolute, rows)}: max over rows of max |row - plain row| divided by the plain row's largest
        |logit| (relative) and in logit units (absolute), and how many rows were compared. Kinds: "single after
        K=k" (draft-free rows), "chain K=k" (verify rows).
    """
    n_out = len(seq) - n_prompt
    depths = [k for k in depths if k < n_out] or [1]
    plain = _rows(target, seq, n_prompt, [0, 1])
    scale = plain.abs().amax(-1)
    out: dict[str, tuple[float, float, int]] = {}

    def worst(rows: torch.Tensor) -> tuple[float, float, int]:
        ok = ~rows.isnan().any(-1)
        if not ok.any():
            return 0.0, 0.0, 0
        diff = (rows[ok] - plain[ok]).abs().amax(-1)
        return (diff / scale[ok]).max().item(), diff.max().item(), int(ok.sum())

    for k in depths:
        single = torch.full_like(plain, float("nan"))
        for first in range(1, min(k + 1, n_out - 1) + 1):
            rows = _settle_rows(target, seq, n_prompt, k, first)
            fill = ~rows.isnan().any(-1)
            single[fill] = rows[fill]
        out[f"single after K={k}"] = worst(single)
        out[f"chain K={k}"] = worst(_rows(target, seq, n_prompt, [k, k + 1]))
    target.reset()
    return out


def measure_gap_noise(target: HFTarget, seq: Sequence[int], n_prompt: int, depths: Sequence[int] = (4, 16, 48),
                      pairs: int = 8, branches: int = 2) -> dict[str, torch.Tensor]:
    """How much rows computed with drafts change the gap between plain decoding's choice and its closest rivals.

    A verify row can choose another token than plain decoding's row only where, for that token c and plain
    decoding's choice a, the row's gap l[a] - l[c] moved by at least the row's own top-2 gap: a flip needs
    ``gap_row <= |(l_row[a] - l_row[c]) - (l_plain[a] - l_plain[c])|`` with c among the tokens closest to a in
    plain decoding's row. This measures that change for a and each of plain decoding's next ``pairs`` tokens, at
    every output position, for rows computed three ways: verify rows of chain drafts (K always-right drafts per
    forward, the first forward holding the prompt and K drafts), verify rows of a tree (the largest K with
    ``branches`` wrong siblings per depth), and draft-free rows (each position's last token fed alone on the cache
    chain verify forwards of K drafts wrote, the first forward holding the prompt and K, then K // 2, output tokens).

    Args:
        target: the target model (its cache is reset).
        seq: prompt + plain greedy output (token ids), the output at least 2 tokens.
        n_prompt: prompt length.
        depths: chain draft depths; those not shorter than the output are skipped.
        pairs: rivals per row (plain decoding's 2nd..(pairs+1)-th tokens).
        branches: wrong siblings per depth in the tree rows.
    Returns:
        {kind: FloatTensor [rows, pairs]}: |change of l[a] - l[c]| divided by plain decoding's row's largest |logit|,
        one row per output position computed that way (draft-free: one per position and first forward). Kinds:
        "verify K=k", "tree K=k" (not on a ``chain_only`` target), "draft-free after K=k".
    """
    n_out = len(seq) - n_prompt
    depths = [k for k in depths if k < n_out] or [1]
    plain = _rows(target, seq, n_prompt, [0, 1])
    scale = plain.abs().amax(-1, keepdim=True)
    top = plain.topk(pairs + 1, dim=-1).indices  # [n_out, pairs + 1]: a, then its rivals

    def change(rows: torch.Tensor) -> torch.Tensor:
        ok = ~rows.isnan().any(-1)
        gap_rows = rows.gather(-1, top[:, :1]) - rows.gather(-1, top[:, 1:])
        gap_plain = plain.gather(-1, top[:, :1]) - plain.gather(-1, top[:, 1:])
        return ((gap_rows - gap_plain).abs() / scale)[ok]

    out: dict[str, torch.Tensor] = {}
    for k in depths:
        out[f"verify K={k}"] = change(_rows(target, seq, n_prompt, [k, k + 1]))
        out[f"draft-free after K={k}"] = torch.cat([change(_recompute_rows(target, seq, n_prompt, k, first))
                                                     for first in sorted({k, max(k // 2, 1)})])
    if not target.chain_only:
        out[f"tree K={depths[-1]}"] = change(_tree_rows(target, seq, n_prompt, depths[-1], branches))
    target.reset()
    return out
