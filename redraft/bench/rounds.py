"""Merging the rounds of ``redraft bench run --rounds R`` into one run row per (question, method).

On a shared machine one generation's wall-clock moves by +-15% between runs while the methods make the same decisions
(the cost-aware policy decides from its cost curve and the outcomes it saw, never from the clock), so repeating the
whole run and taking per-question medians removes noise without changing what is measured. Each round runs every
method on every question (:func:`redraft.bench.harness.run_methods`); :func:`merge_rounds` folds the rounds' rows:

- ``seconds``: the median over rounds; ``round_seconds``: every round's seconds, in round order; ``tok_s``: tokens
  over the median seconds.
- ``ceiling_seconds`` (when timed): the fastest over rounds (the ceiling is a lower bound on time, each round's figure
  already the fastest of its forwards); ``round_ceiling_seconds``: every round's; ``of_ceiling`` recomputed against
  the median seconds; ``of_ceiling_fastest``: against the fastest round's seconds (both sides of the ratio the
  fastest, so load that slowed some rounds does not count as distance from the ceiling).
- ``rss_peak_mb``: the largest over rounds.
- Forwards, accepted tokens and draft depths per forward, sources, stop reason, order and output ids: round 1's.
  ``rounds_identical`` is False and ``rounds_differing`` lists the rounds (numbered from 1) whose output ids,
  tokens, forwards, accepted tokens or draft depths per forward differ from round 1's.
- ``identical``: the output equals plain greedy's in every round and is the same in every round, so plain greedy
  itself giving other ids in a later round is reported like a method differing from plain greedy. ``first_diff``
  is then that of the first round whose output differs from plain greedy's of that round, or, where the output
  changed between rounds first, the first position where it differs from round 1's; ``output_ids`` holds round 1's
  output and ``round_output_ids`` every round's, when they differ.

Pure: no torch, no clock. Ours.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from redraft.bench.report import BASELINE

# what a round must repeat for its decisions to count as the same as round 1's
DECISIONS = ("tokens", "forwards", "accepted_per_forward", "draft_depth_per_forward", "sources", "stop_reason")


def row_output(row: dict, plain: dict) -> list[int]:
    """A run row's output ids: its own ``output_ids`` when stored (plain greedy, or an output that differs), else
    plain greedy's for the same question and round (a row stores none when identical to it)."""
    ids = row.get("output_ids")
    return list(ids if ids is not None else plain["output_ids"])


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where a and b differ (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def merge_rows(rows: Sequence[dict], plains: Sequence[dict]) -> dict:
    """One (question, method)'s rows, one per round (round 1 first), merged as the module doc says.

    Args:
        rows: the run rows of :func:`redraft.bench.harness.run_methods`, same question and method, in round order.
        plains: plain greedy's rows for the same question, one per round, in round order (``output_ids`` set).
    Raises:
        ValueError: no rows, or not one plain row per round.
    """
    if not rows or len(rows) != len(plains):
        raise ValueError(f"merge_rows: need one row and one plain greedy row per round, got {len(rows)} rows and "
                         f"{len(plains)} plain rows")
    first = rows[0]
    out = dict(first)
    secs = [float(r["seconds"]) for r in rows]
    out["round_seconds"] = secs
    out["seconds"] = float(statistics.median(secs))
    out["tok_s"] = first["tokens"] / out["seconds"] if out["seconds"] > 0 else 0.0
    ceils = [r["ceiling_seconds"] for r in rows if r.get("ceiling_seconds") is not None]
    if ceils:
        out["round_ceiling_seconds"] = [r.get("ceiling_seconds") for r in rows]
        out["ceiling_seconds"] = min(ceils)
        out["of_ceiling"] = out["ceiling_seconds"] / out["seconds"] if out["seconds"] > 0 else None
        out["of_ceiling_fastest"] = out["ceiling_seconds"] / min(secs) if min(secs) > 0 else None
    peaks = [r["rss_peak_mb"] for r in rows if r.get("rss_peak_mb") is not None]
    out["rss_peak_mb"] = max(peaks) if peaks else None
    outputs = [row_output(r, p) for r, p in zip(rows, plains, strict=True)]
    changed = [i + 1 for i, r in enumerate(rows)
               if outputs[i] != outputs[0] or any(r.get(k) != first.get(k) for k in DECISIONS)]
    out["rounds_identical"] = not changed
    out["rounds_differing"] = changed
    unstable = [i for i, ids in enumerate(outputs) if ids != outputs[0]]
    wrong = [i for i, r in enumerate(rows) if not r["identical"]]
    if unstable or wrong:
        bad = min(unstable + wrong)
        out["identical"] = False
        out["first_diff"] = rows[bad]["first_diff"] if bad in wrong else first_diff(outputs[bad], outputs[0])
        out["output_ids"] = outputs[0]
    if unstable:
        out["round_output_ids"] = outputs
    return out


def merge_rounds(rounds: Sequence[dict]) -> dict:
    """Every round's :func:`redraft.bench.harness.run_methods` result (round 1 first) merged into one of the same shape:
    {workload: {"description", "questions", "runs"}} with one row per (question, method), in round 1's row order.

    Raises:
        ValueError: no rounds, or rounds that did not run the same workloads, questions and methods.
    """
    if not rounds:
        raise ValueError("merge_rounds: no rounds to merge")
    out: dict[str, dict] = {}
    for w, wr in rounds[0].items():
        keys = [(r["question_id"], r["method"]) for r in wr["runs"]]
        by_round = []
        for n, rnd in enumerate(rounds, 1):
            runs = {(r["question_id"], r["method"]): r for r in rnd.get(w, {}).get("runs", [])}
            if set(runs) != set(keys):
                raise ValueError(f"merge_rounds: round {n} of workload {w!r} ran other questions or methods than "
                                 f"round 1")
            by_round.append(runs)
        merged = []
        for q, m in keys:
            plains = [runs[(q, BASELINE)] for runs in by_round]
            merged.append(merge_rows([runs[(q, m)] for runs in by_round], plains))
        out[w] = {**wr, "runs": merged}
    return out


def rounds_differing(workloads: dict) -> list[dict]:
    """Every (workload, method) with a question whose decisions or output changed between rounds:
    [{workload, method, questions}] (merged runs with ``rounds_identical``)."""
    out = []
    for w, wr in workloads.items():
        by: dict[str, list] = {}
        for r in wr["runs"]:
            if not r.get("rounds_identical", True):
                by.setdefault(r["method"], []).append(r["question_id"])
        out += [{"workload": w, "method": m, "questions": qs} for m, qs in by.items()]
    return out
