"""Progress bars (``redraft.io.progress.Progress``): tqdm's bar only on a terminal; written to a file or a pipe, one
summary line per phase and no carriage return (a log of ``make demo`` once held ~60 redraws of each bar)."""

from __future__ import annotations

import io
import re

from redraft.io.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def phases(stream) -> list[int]:
    """The demo's three phases over ``stream``, as ``redraft demo`` runs them."""
    seen = [sum(1 for _ in Progress(range(5), desc="1/3 plain greedy", unit="q", noun="question", file=stream))]
    with Progress(total=4, desc="2/3 replay", unit="fwd", noun="forward", file=stream, mininterval=0) as bar:
        for _ in range(4):
            bar.update()
    seen.append(bar.count)
    seen.append(sum(1 for _ in Progress(["q"], desc="3/3 other questions", unit="q", noun="question", file=stream)))
    return seen


def test_off_a_terminal_each_phase_is_a_start_line_and_a_summary_line():
    log = io.StringIO()
    assert phases(log) == [5, 4, 1]
    text = log.getvalue()
    assert "\r" not in text, repr(text)
    lines = text.splitlines()
    assert len(lines) == 6, lines
    for (start, end), want in zip(zip(lines[::2], lines[1::2], strict=True), ("1/3 plain greedy: 5 questions",
                                                                 "2/3 replay: 4 forwards",
                                                                 "3/3 other questions: 1 question"), strict=True):
        assert start == want + " ...", start  # a long phase's log shows what runs before it ends
        assert re.fullmatch(re.escape(want) + r", \d+\.\d s", end), end
    unsized = io.StringIO()
    with Progress(desc="reading", unit="B", file=unsized) as bar:
        bar.update(3)
    assert unsized.getvalue().splitlines()[0] == "reading: ..."


def test_on_a_terminal_the_bar_is_drawn_and_no_summary_added():
    tty = Terminal()
    phases(tty)
    text = tty.getvalue()
    assert "\r" in text and "1/3 plain greedy" in text and "2/3 replay" in text
    assert not re.search(r"questions?, \d+\.\d s", text)


def test_disabled_shows_nothing_and_writes_pass_through():
    log = io.StringIO()
    with Progress(total=3, desc="glide train", unit="step", file=log, enabled=False) as bar:
        bar.update(3)
        bar.set_postfix(loss="1.0")
        bar.write("checkpoint written")
    assert log.getvalue() == "checkpoint written\n"
    quiet = io.StringIO()
    assert list(Progress([1, 2], desc="parsing", unit="B", file=quiet, summary=False)) == [1, 2]
    assert quiet.getvalue() == ""
