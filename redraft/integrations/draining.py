"""Which requests of a draining batch hold it up: the share of the step's fixed cost their accepted tokens save.

A batch whose requests all came in together and that no other request waits to join (vLLM's offline ``generate``
over fewer prompts than ``max_num_seqs``) runs until its slowest request is done, every step paying the step's fixed
cost. An accepted token of a request that is ahead of the slowest saves only its own row in a later step; the step
itself (its fixed cost) goes away only when every one of the slowest advances. The load rule prices a draft with
that value (:func:`redraft.pricing.load.load_costs`, argument ``share``): for each of the m slowest requests the chance
that the other m - 1 advance too (:func:`tied_shares`), 0 for the others. Anywhere else (a request joined later, or
the batch is full and finished requests are replaced from a queue) every request keeps its row's share of the step
(None: c_B), which is also the price that minimises the sum of the requests' latencies. The slowest are those with
the fewest generated tokens: with a common length limit they finish last (a guess an early EOS breaks, so a draft the
policy trusts keeps its row's share wherever it stands: CONFIDENT_CHANCE). numpy-free; used by
:class:`redraft.integrations.vllm_proposer.RedraftProposer` once per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from redraft.pricing.load import SHARE_FLOOR

# Requests first seen within this many calls of each other count as one batch (a prefill split over steps).
COHORT_CALLS = 4
# Requests within this many generated tokens of the slowest count among the slowest.
SLACK_TOKENS = 0
# A draft whose first token the policy trusts at least this much keeps at least its row's share of the step, wherever
# its request stands: "the fewest generated tokens finish last" is a guess that a request ending early (EOS) breaks,
# and a replay ahead of a short novel answer may well be the one the batch waits for.
CONFIDENT_CHANCE = 0.95


def critical_counts(rows: Sequence[tuple[int, int] | None], full: bool, *, cohort_calls: int = COHORT_CALLS,
                    slack: int = SLACK_TOKENS) -> list[int | None]:
    """Per row, how many requests hold a draining batch up if this row is one of them.

    Args:
        rows: per batch row, (generated tokens so far, number of the call that first saw the request), or None for a
            row without a tracked request (a prefill chunk: a request is still coming in).
        full: the batch holds as many requests as the runtime schedules at once (others may be waiting to join).
        cohort_calls: the most calls between the first sightings of the batch's requests for it to count as draining.
        slack: requests within this many tokens of the fewest generated count among the slowest.
    Returns:
        one entry per row: None everywhere unless the batch is draining (no row without a request, not full, at
        least two requests, all first seen within ``cohort_calls`` calls); then m (>= 1) for each of the m slowest
        requests and 0 for the others.
    """
    if full or len(rows) < 2 or any(r is None for r in rows):
        return [None] * len(rows)
    firsts = [r[1] for r in rows]
    if max(firsts) - min(firsts) > cohort_calls:
        return [None] * len(rows)
    least = min(r[0] for r in rows) + slack
    m = sum(1 for r in rows if r[0] <= least)
    return [m if r[0] <= least else 0 for r in rows]


def batch_critical(requests: Sequence, sampled: Sequence, max_num_seqs: int | None) -> list[int | None]:
    """:func:`critical_counts` for one proposer call.

    Args:
        requests: per batch row, its tracked request (``n`` ids so far, ``n_prompt``, ``first_call``) or None.
        sampled: per batch row, the ids vLLM sampled this step (empty for a prefill chunk).
        max_num_seqs: the most requests vLLM schedules at once (None: unknown, the batch never counts as full).
    Returns:
        per row, as :func:`critical_counts` (the input of :func:`tied_shares`).
    """
    full = max_num_seqs is not None and len(requests) >= max_num_seqs
    return critical_counts([(r.n - r.n_prompt, r.first_call) if r is not None and sampled[i] else None
                            for i, r in enumerate(requests)], full)


def tied_shares(critical: Sequence[int | None], chance: Callable[[int], float], *,
                floor: float = SHARE_FLOOR) -> list[float | None]:
    """Per row, ``share`` for :func:`redraft.pricing.load.load_costs`: the part of the step's fixed cost an accepted
    token of this row saves.

    The fixed cost goes away only if every one of the m slowest requests advances, so a slowest request's accepted
    token saves it with the chance that the other m - 1 advance too: the product of their chances. Rows ahead of
    the slowest save none of it (0), a lone slowest request all of it (1), and outside a draining batch (None) every
    row keeps its row's share.

    Args:
        critical: per row, :func:`critical_counts` (None, 0, or m >= 1 for each of the m slowest).
        chance: row -> P(the row's next draft has its first token accepted), 0 where it has none; called for the
            slowest rows in order, only when there are two or more, and no further once every share is known to be
            below ``floor`` (a request without a draft settles it at once).
        floor: shares below it count as 0 (the load rule's grid prices them as 0 anyway).
    Returns:
        per row, None or a share within 0..1.
    """
    slow = [i for i, m in enumerate(critical) if m]
    chances: dict[int, float] = {}
    if len(slow) > 1:
        product, least = 1.0, 1.0
        for i in slow:
            q = chance(i)
            chances[i] = q = max(0.0, min(1.0, q)) if q == q else 0.0  # NaN: no chance
            product, least = product * q, min(least, q)
            # every share, asked for or not, is at most the product of the chances seen without the smallest one
            if q == 0.0 or (len(chances) > 1 and product < floor * least):
                return [None if m is None else 0.0 for m in critical]
    out: list[float | None] = []
    for i, m in enumerate(critical):
        if m is None:
            out.append(None)  # not a draining batch: the row's share
        elif m == 0:
            out.append(0.0)  # ahead of the slowest
        else:
            out.append(math.prod(q for j, q in chances.items() if j != i))  # 1 for a lone slowest request
    return out
