"""The llama.cpp runtime warns when it takes every core of a machine that is busy already, or more threads than\nthere are cores."""

from __future__ import annotations

import os

from redraft.compose import runtime


def test_every_core_of_a_busy_machine_and_more_threads_than_cores_are_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.4, 2.0, 1.0))
    with caplog.at_level("WARNING", logger="redraft.compose.runtime"):
        msg = runtime.warn_busy_cores(2)
    assert msg is not None and "--threads 1" in msg and "2.4" in msg and msg in caplog.text
    assert runtime.warn_busy_cores(1) is None  # fewer threads than cores: nothing to say
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert runtime.warn_busy_cores(2) is None  # an idle machine
    more = runtime.warn_busy_cores(3)  # more threads than cores, even there
    assert more is not None and "3 threads on 2 cores" in more and "--threads 2" in more

