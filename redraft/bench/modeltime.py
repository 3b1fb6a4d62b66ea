"""Model time: a run's verify cost in plain steps from its forwards' draft depths and a cost curve, not the clock.

On a shared machine single questions move by +-20-30% between runs while the policy makes the same decisions; the
policy's choices are judged here by what they cost on the curve it decided with. A generation's first forward
carries the prompt: with a prompt of P tokens (m = P - 1 beyond the one a plain step carries) and d drafted tokens
it costs c(m + d); each later forward with d drafted tokens costs c(d). Plain greedy decoding of T tokens costs
c(m) + (T - 1). Per forward, what a draft gained is the tokens it emitted (accepted + 1) minus its cost in plain
steps (on the prompt's forward, minus what the draft added: c(m + d) - c(m) + 1), so a drafted forward that lost
time is one with a negative gain. Works on ``redraft bench run``'s results.json (per run ``prompt_tokens``,
``tokens``, ``draft_depth_per_forward``, ``accepted_per_forward``; the curve under ``cost_curves``).

``python -m redraft.bench.modeltime results.json [--method policy]`` prints per question the model-time speedup and
the drafted forwards that lost. Ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.pricing.curve import CostCurve


@dataclass(frozen=True)
class ModelTime:
    """One generation in model time (plain steps).

    Attributes:
        plain: c(m) + tokens - 1, plain greedy's cost.
        drafted: sum of the forwards' costs (the prompt's forward at c(m + d)).
        speedup: plain / drafted.
        losses: (forward index, draft depth, accepted, gain) for each drafted forward whose gain is negative.
    """

    plain: float
    drafted: float
    speedup: float
    losses: tuple[tuple[int, int, int, float], ...]


def model_time(curve: CostCurve, prompt_tokens: int, tokens: int, depths: Sequence[int],
               accepted: Sequence[int]) -> ModelTime:
    """A generation's model time (see the module doc).

    Args:
        curve: the cost curve the run decided with.
        prompt_tokens: P, prompt length in tokens (>= 1).
        tokens: T, tokens generated (>= 1).
        depths, accepted: per verify forward, draft tokens verified and accepted (same length).
    Raises:
        ValueError: P or T < 1, or lengths differ.
    """
    if prompt_tokens < 1 or tokens < 1 or len(depths) != len(accepted):
        raise ValueError(f"model_time needs prompt_tokens >= 1, tokens >= 1 and one accepted count per forward; "
                         f"got {prompt_tokens}, {tokens}, {len(depths)} depths, {len(accepted)} accepted")
    m = prompt_tokens - 1
    base = curve.cost(m)
    plain = base + tokens - 1
    drafted, losses = 0.0, []
    for i, (d, a) in enumerate(zip(depths, accepted, strict=True)):
        cost = curve.cost(m + d) if i == 0 else curve.cost(d)
        drafted += cost
        step = cost - base + 1 if i == 0 else cost
        gain = a + 1 - step
        if d > 0 and gain < 0:
            losses.append((i, int(d), int(a), round(gain, 3)))
    return ModelTime(plain, drafted, plain / drafted if drafted > 0 else float("nan"), tuple(losses))


def results_model_time(results: dict, method: str = "policy") -> list[dict]:
    """Per run of ``method`` in a ``redraft bench run`` results dict: workload, question, tokens, forwards and
    :class:`ModelTime` fields, with the curve from ``results["cost_curves"][method]``.

    Raises:
        KeyError: no curve recorded for ``method``.
    """
    curve = CostCurve.from_dict(results["cost_curves"][method])
    rows = []
    for workload, wd in results["workloads"].items():
        for r in wd["runs"]:
            if r["method"] != method or not r.get("draft_depth_per_forward"):
                continue
            mt = model_time(curve, r["prompt_tokens"], r["tokens"], r["draft_depth_per_forward"],
                            r["accepted_per_forward"])
            rows.append({"workload": workload, "question_id": r["question_id"], "tokens": r["tokens"],
                         "forwards": r["forwards"], "plain": mt.plain, "drafted": mt.drafted,
                         "speedup": mt.speedup, "losses": mt.losses})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.bench.modeltime", description=__doc__.split("\n")[0])
    p.add_argument("results", help="a `redraft bench run` results.json")
    p.add_argument("--method", default="policy", help="the method to read (default: policy)")
    a = p.parse_args(argv)
    with open(a.results, encoding="utf-8") as f:
        rows = results_model_time(json.load(f), a.method)
    for r in rows:
        lost = ", ".join(f"#{i} d={d} acc={acc} {g:+.2f}" for i, d, acc, g in r["losses"]) or "-"
        print(f"{r['workload']:>7} q{r['question_id']:<4} {r['tokens']:>4} tok {r['forwards']:>4} fwd  "
              f"{r['speedup']:.2f}x  lost: {lost}")
    by = {}
    for r in rows:
        by.setdefault(r["workload"], []).append(r["speedup"])
    for w, xs in by.items():
        print(f"{w}: median {statistics.median(xs):.2f}x, worst {min(xs):.2f}x over {len(xs)} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
