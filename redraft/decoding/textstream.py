"""Streamed text: output ids -> text deltas that never need to be taken back (``redraft run``'s stdout, the
server's streamed chunks).

Decoding a growing id list and printing what is new is not enough: the last token may be the first bytes of a
multi-byte character (decoded as U+FFFD until the next token completes it), and the last characters may be the
start of a stop string that the next token completes (the stop string and what follows are never shown). So the
newest text is held back until it can no longer change, the way Hugging Face's ``TextStreamer`` holds back an
unfinished character and OpenAI-compatible servers (vLLM's detokenizer) hold back a possible stop-string prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.decoding.stopping import StopStrings


class TextStream:
    """Turns a growing list of output ids into text deltas that concatenate to exactly the non-streamed text.

    A trailing U+FFFD is held back (the next token may complete a multi-byte character), and so are the last
    ``len(longest stop string) - 1`` characters (they may begin a stop string); once the engine finds a stop string
    (``stop.text`` is set) the text is cut before it.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        stop: the generation's :class:`~redraft.decoding.stopping.StopStrings` (the same object the engine checks).
        skip_special_tokens: passed to ``decode`` (True: control tokens such as EOS are not text).
    """

    def __init__(self, tokenizer, stop: StopStrings, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.stop, self.skip_special_tokens = tokenizer, stop, skip_special_tokens
        self.hold = max((len(s) for s in stop.stops), default=1) - 1
        self.ids: list[int] = []
        self.shown = 0  # characters of the text already given out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def feed(self, new: Sequence[int]) -> str:
        """The delta for newly emitted ids ('' when everything new must still be held back)."""
        self.ids.extend(int(t) for t in new)
        if self.stop.text is not None:  # this step completed a stop string: exactly what precedes it
            text, safe = self.stop.text, len(self.stop.text)
        else:
            text = self.decode(self.ids)
            safe = len(text.rstrip("\ufffd")) - self.hold
        if safe <= self.shown:
            return ""
        delta, self.shown = text[self.shown:safe], safe
        return delta

    def final_text(self) -> str:
        """The whole output text: cut before the stop string when one was found, else all ids decoded."""
        return self.stop.text if self.stop.text is not None else self.decode(self.ids)

    def finish(self, final: str | None = None) -> str:
        """What remains of ``final`` (default :meth:`final_text`) after the deltas already given."""
        return (self.final_text() if final is None else final)[self.shown:]
