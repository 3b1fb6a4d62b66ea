"""Progress of a long phase: tqdm's bar on a terminal, one summary line anywhere else.

tqdm redraws its bar in place with carriage returns. Written to a file or a pipe (``make demo > demo.log``, a CI
log) every redraw stays: ~60 copies of the bar per phase. :class:`Progress` draws the bar only when its stream is a
terminal (tqdm's own test, ``disable=None``) and otherwise prints one line when the phase starts and one when it
ends, such as ``1/3 plain greedy: 12 questions ...`` then ``1/3 plain greedy: 12 questions, 4.1 s`` (a log without
the first line looked hung through a long phase).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO


class Progress:
    """A tqdm bar shown only on a terminal; elsewhere a ``DESC: N NOUNs ...`` line at the start (N when known) and a
    ``DESC: N NOUNs, S s`` line at :meth:`close`.

    Use it as tqdm: iterate over it (``for q in Progress(questions, ...)``) or call :meth:`update`, and close it (or
    use it as a context manager; iterating to the end closes it). ``enabled=False`` shows nothing at all (a
    caller's ``progress=False``); ``summary=False`` leaves no line off a terminal, for a transient bar
    (``leave=False``) that leaves nothing on one either. ``noun`` names what is counted in the summary (singular;
    an ``s`` is added for any count but 1), ``unit`` by default. Other keywords go to tqdm.
    """

    def __init__(self, iterable: Iterable | None = None, *, desc: str, unit: str = "it", noun: str | None = None,
                 file: TextIO | None = None, enabled: bool = True, summary: bool = True, **tqdm_kwargs: Any) -> None:
        from tqdm import tqdm

        self.file = sys.stderr if file is None else file  # the stream current now (a test may have replaced it)
        self.desc, self.noun = desc, noun or unit
        self.iterable = iterable
        self.count = 0
        self.started = time.perf_counter()
        self.bar = tqdm(iterable, desc=desc, unit=unit, file=self.file, disable=None if enabled else True,
                        **tqdm_kwargs)
        self.shown = not self.bar.disable
        self.summary = enabled and summary and not self.shown
        self.closed = False
        if self.summary:
            total = self.bar.total
            print(f"{desc}: {self._counted(int(total)) + ' ' if total is not None else ''}...", file=self.file,
                  flush=True)

    def __iter__(self) -> Iterator:
        for item in (self.bar if self.shown else self.iterable if self.iterable is not None else ()):
            self.count += 1
            yield item
        self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more (tqdm's ``update``)."""
        self.count += n
        self.bar.update(n)

    def set_postfix(self, **kwargs: Any) -> None:
        """tqdm's ``set_postfix``: figures after the bar (nothing off a terminal)."""
        self.bar.set_postfix(**kwargs)

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        """tqdm's ``set_postfix_str`` (nothing off a terminal)."""
        self.bar.set_postfix_str(s, refresh=refresh)

    def write(self, line: str) -> None:
        """Print ``line`` to the bar's stream without breaking the bar (tqdm's ``write``)."""
        self.bar.write(line, file=self.file)

    def close(self) -> None:
        """End the phase: close the bar, or print the summary line off a terminal (once)."""
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.summary:
            seconds = time.perf_counter() - self.started
            print(f"{self.desc}: {self._counted(self.count)}, {seconds:.1f} s", file=self.file, flush=True)

    def _counted(self, n: int) -> str:
        """'1 question', '5 questions': ``n`` and the noun, plural but for 1."""
        return f"{n} {self.noun if n == 1 else self.noun + 's'}"
