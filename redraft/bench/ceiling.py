"""The prefill-bound ceiling of a replay: one target forward over prompt + answer.

A lossless replay must verify every answer token with the target model, and the cheapest way to do that is a single
forward over the prompt and the answer, with logits for the rows that choose the answer's tokens: the prompt, then
the answer but its last token drafted after it, the last token coming back as the bonus token. That is exactly the
best an engine replay can do (its first forward carries the prompt and the draft). No drafting can beat it: ``redraft bench run`` times it
for every question right after the methods ran on that question (same process, same threads, same load) and reports
each method's generation time against it (``of_ceiling`` = ceiling seconds / generation seconds, 1.0 = at the ceiling).
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class CeilingTimer:
    """Times one forward over prompt + answer on the target model (the replay ceiling).

    Args:
        model: a transformers causal LM (or an :class:`~redraft.runtimes.transformers.target.HFTarget`); its own KV cache is used
            and reset, so do not share the HFTarget with a generation in progress.
        repeats: forwards timed per call; the fastest counts (the ceiling is a lower bound on time: noise on a
            shared machine only ever makes a forward slower).
    Raises:
        ValueError: repeats < 1.
    """

    def __init__(self, model, repeats: int = 2) -> None:
        from redraft.runtimes.transformers.target import as_target  # torch-bound

        if repeats < 1:
            raise ValueError(f"CeilingTimer: repeats must be >= 1, got {repeats}")
        self.target = as_target(model)
        self.repeats = repeats

    def __call__(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> float | None:
        """Seconds of the fastest of ``repeats`` forwards over ``prompt_ids + answer_ids[:-1]`` (int ids) with logits
        for the ``len(answer_ids)`` rows that choose the answer; None for an empty answer or prompt."""
        import torch

        ids = [int(t) for t in prompt_ids] + [int(t) for t in answer_ids[:-1]]
        if not answer_ids or not prompt_ids:
            return None
        best = None
        # a target that lends its logits (llama.cpp) lends them here too: the engine's verify step reads them in
        # place, so copying them out is no part of the least a replay must spend
        lend = {"borrow": True} if getattr(self.target, "lends_logits", False) else {}
        with torch.inference_mode():
            for _ in range(self.repeats):
                self.target.reset()
                t0 = time.perf_counter()
                self.target.forward(ids, n_logits=len(answer_ids), **lend)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
        self.target.reset()
        return best
