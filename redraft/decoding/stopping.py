"""Stop strings: cut the output at the first occurrence of any stop string, also across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Finds the first stop string in the decoded output.

    After a hit, ``text`` is the output text up to (not including) the stop string and ``n_tokens`` the fewest
    output ids whose decoding contains it; the engine emits exactly those ids, so usage counts equal what was
    emitted (as OpenAI-style servers count a stop sequence's last token).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        stops: the stop strings (empty strings are ignored).
    """

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.text: str | None = None
        self.n_tokens: int | None = None

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check(self, output_ids: list[int]) -> int | None:
        """Return how many of ``output_ids`` to keep when a stop string occurs, else None.

        The cut is plain decoding's, which checks after every token: the fewest ids whose text holds any stop
        string (binary search: decoded text grows with the ids), cut before the earliest-starting stop string in
        that text. So a step that emits several tokens at once stops where one token at a time would: with stop
        strings "abc" and "b", text "abc" stops after "a" ("b" completes first), not before "abc".
        """
        text = self._decode(output_ids)
        if not any(s in text for s in self.stops):
            return None
        lo, hi = 1, len(output_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            head = self._decode(output_ids[:mid])
            if any(s in head for s in self.stops):
                hi = mid
            else:
                lo = mid + 1
        head = self._decode(output_ids[:lo])
        cut = min(i for s in self.stops if (i := head.find(s)) >= 0)
        self.text, self.n_tokens = head[:cut], lo
        return lo
