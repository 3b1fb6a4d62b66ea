"""Streamed text (redraft/decoding/textstream.py, used by ``redraft run`` and the server): the deltas are never taken
back, concatenate to exactly the final text, hold back an unfinished multi-byte character and a possible stop-string
start, and stop before a stop string that spans tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.decoding.stopping import StopStrings
from redraft.decoding.textstream import TextStream


class ByteTokenizer:
    """Token id = one byte of UTF-8 (ids >= 256 are special tokens, decoded as nothing when skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        special = "" if skip_special_tokens else "<eos>"
        out, buf = [], bytearray()
        for i in ids:
            if i >= 256:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(special)
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def stream_through(text: str, chunks: list[int], stops: list[str]) -> tuple[list[str], str, str]:
    """Feed ``text``'s bytes in chunks of the given sizes as the engine would (stop check before each emit).
    Returns (deltas, the finish() rest, the final text)."""
    tok = ByteTokenizer()
    ids = list(text.encode())
    stop = StopStrings(tok, stops)
    stream = TextStream(tok, stop)
    deltas, out, i = [], [], 0
    for size in chunks + [len(ids)]:
        new = ids[i:i + max(1, size)]
        if not new:
            break
        cut = stop.check(out + new) if stop else None
        if cut is not None:
            new = new[:max(0, cut - len(out))]
        out += new
        i += len(new)
        deltas.append(stream.feed(new))
        if cut is not None:
            break
    final = stop.text if stop.text is not None else tok.decode(out)
    return deltas, stream.finish(final), final


def test_a_split_multibyte_character_is_held_back():
    tok = ByteTokenizer()
    stream = TextStream(tok, StopStrings(tok, []))
    e_acute = list("é".encode())  # two bytes
    assert stream.feed([ord("a")] + e_acute[:1]) == "a"  # "a\ufffd": the half character waits
    assert stream.feed(e_acute[1:]) == "é"
    assert stream.finish() == ""


def test_a_possible_stop_string_start_is_held_back_then_released():
    tok = ByteTokenizer()
    stop = StopStrings(tok, ["END"])
    stream = TextStream(tok, stop)
    assert stream.feed(list(b"abcEN")) == "abc"  # "EN" may become "END"
    assert stream.feed(list(b"x")) == "E"  # the last len("END") - 1 characters always wait
    assert stream.feed(list(b"yz")) == "Nx"
    assert stream.finish("abcENxyz") == "yz"


def test_stop_string_across_tokens_is_never_shown():
    deltas, rest, final = stream_through("hello STOP world", [3, 4, 2, 5], ["STOP"])
    assert final == "hello "
    assert "".join(deltas) + rest == "hello "
    assert "S" not in "".join(deltas)


def test_special_tokens_follow_skip_special_tokens():
    tok = ByteTokenizer()
    shown = TextStream(tok, StopStrings(tok, []), skip_special_tokens=False)
    skipped = TextStream(tok, StopStrings(tok, []))
    assert shown.feed([ord("a"), 300]) == "a<eos>"
    assert skipped.feed([ord("a"), 300]) == "a"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab é€\n")), max_size=40),
       chunks=st.lists(st.integers(1, 5), max_size=30),
       stops=st.lists(st.text(alphabet=st.sampled_from(list("ab é")), min_size=1, max_size=4), max_size=2))
def test_deltas_are_never_taken_back_and_add_up_to_the_final_text(text, chunks, stops):
    deltas, rest, final = stream_through(text, chunks, stops)
    shown = ""
    for d in deltas:
        shown += d
        assert final.startswith(shown)  # every prefix shown so far belongs to the final text
        assert "\ufffd" not in d or "\ufffd" in final
    assert shown + rest == final
