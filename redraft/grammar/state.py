"""One generation's grammar state: a matcher that follows the committed tokens and forks along the token tree.

:class:`GrammarState` is a logits processor in transformers' calling convention (``processor(input_ids, scores)``):
``sampling.TokenChooser`` appends it to the generation's processors and calls it once per group of verify rows,
each row with its own context (prompt + committed output + the tree node's ancestors and itself). For each row the
state takes the matcher after the committed output, forks it (``LLMatcher.deep_copy``), consumes the node's
ancestors and itself, and sets every token the grammar does not allow next to -inf. A forked state is cached per
token path within a step, so a tree of N nodes costs N token advances and N masks, whatever its depth.

Because every row sees exactly the mask plain decoding would see at that position, constrained speculative
decoding chooses the same tokens as constrained plain decoding (greedy), or the same seeded sample (sampling).
A row below a drafted token the grammar refuses gets no mask: its node cannot be accepted (its ancestor can never
be chosen), and an all -inf row would not be a distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from redraft.grammar.errors import GrammarError


class GrammarState:
    """The grammar state of one generation (built by :meth:`Constraint.start <redraft.grammar.Constraint.start>`).

    Args:
        constraint: the :class:`~redraft.grammar.Constraint`.
        prompt_length: prompt tokens; the grammar constrains what follows them.
    Attributes:
        committed: output ids the matcher has consumed (:meth:`commit`).
        masks: rows masked so far (for statistics and tests).
    """

    def __init__(self, constraint, prompt_length: int) -> None:
        self.constraint = constraint
        self.prompt_length = int(prompt_length)
        self.vocab = constraint.vocab_size
        self.matcher = constraint.matcher()
        self.committed: list[int] = []
        self.masks = 0
        self._forks: dict[tuple[int, ...], object] = {(): self.matcher}

    def commit(self, tokens: list[int]) -> None:
        """Advance past newly committed output ids (the chooser's ``commit``); drops the step's forks."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        self.matcher.consume_tokens(tokens)  # an error state only follows ids the mask forbade (forced by a caller)
        self.committed.extend(tokens)
        self._forks = {(): self.matcher}

    def state_after(self, extra: tuple[int, ...]):
        """The matcher after the committed output plus ``extra`` (a node's ancestors and itself); cached.
        Never mutate the result: it may be the committed matcher itself."""
        m = self._forks.get(extra)
        if m is None:
            parent = self.state_after(extra[:-1])
            m = parent.deep_copy()
            m.consume_token(extra[-1])
            self._forks[extra] = m
        return m

    def bitmask(self, extra: tuple[int, ...] = ()) -> np.ndarray | None:
        """uint8 [ceil(V / 32) * 4]: the allowed tokens after the committed output plus ``extra``, one bit per token
        (little-endian within each byte, llguidance's layout); None when ``extra`` leaves the grammar (no constraint
        applies there). Raises GrammarError when no token at all may follow the committed output (a grammar this
        vocabulary cannot spell, or whose matcher fails there: never an unconstrained committed output)."""
        m = self.state_after(extra)
        bits = None if m.is_error() else np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if bits is None or m.is_error():  # the matcher failed before this mask or while computing it
            if extra:
                return None
            raise GrammarError(f"{self.constraint.description}: the grammar failed after {len(self.committed)} output "
                               f"tokens ({m.get_error()})")
        if not bits.any():
            if extra:
                return None  # a drafted path into a dead end: plain decoding never gets there unless it is forced
            raise GrammarError(f"{self.constraint.description}: no token of this vocabulary can continue the "
                               f"output after {len(self.committed)} tokens")
        return bits

    def allowed(self, extra: tuple[int, ...] = ()) -> np.ndarray | None:
        """Bool [V]: the tokens the grammar allows after the committed output plus ``extra`` (see :meth:`bitmask`;
        None when no constraint applies there)."""
        bits = self.bitmask(extra)
        if bits is None:
            return None
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the committed output (its only possible continuation;
        llguidance's fast-forward tokens), [] when the next token is a choice."""
        m = self.matcher
        if m.is_error() or m.is_stopped() or limit <= 0:
            return []
        return [int(t) for t in m.compute_ff_tokens()[:limit]]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Mask rows of ``scores`` [R, V] (float) by the grammar state of ``input_ids`` [R, L] (int64; each row a
        full context: prompt + committed output + the row's own tree path). Returns the masked scores (a new
        tensor; the input is not changed)."""
        start = self.prompt_length + len(self.committed)
        if input_ids.shape[1] < start:
            raise ValueError(f"grammar state: a row of {input_ids.shape[1]} ids is shorter than the prompt and the "
                             f"committed output ({start}); commit() was not called with the emitted tokens")
        extra = input_ids[:, start:].tolist()
        V = scores.shape[1]
        masks = [self.bitmask(tuple(path)) for path in extra]
        rows = [r for r, m in enumerate(masks) if m is not None]
        if not rows:
            return scores
        keep = np.unpackbits(np.stack([masks[r] for r in rows]), axis=1, bitorder="little")[:, :V].astype(bool)
        if keep.shape[1] < V:  # ids past the grammar's vocabulary are never allowed
            keep = np.pad(keep, ((0, 0), (0, V - keep.shape[1])))
        self.masks += len(rows)
        out = scores.clone()
        out[rows] = scores[rows].masked_fill(~torch.from_numpy(keep), float("-inf"))
        return out
