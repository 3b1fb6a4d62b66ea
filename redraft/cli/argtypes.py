"""argparse types for the command line: each parses one value or raises ``argparse.ArgumentTypeError`` with a
one-line reason, so a bad flag is refused by the parser (exit 2, the flag named) before any work starts.

A leaf (standard library, :mod:`redraft.compose.env` and the torch-free CaPE bins): the commands get these names
through :mod:`redraft.cli.common`, which re-exports them; it lives outside :mod:`redraft.cli` because that
package's shared leaf may import no other module of it.
"""

from __future__ import annotations

import argparse
import os

from redraft.compose.env import DepthError, check_depth
from redraft.drafters.cape import CapeBins


def percent(text: str) -> float:
    """argparse type: a percentage in 0..100 (float)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (expected a percentage 0..100)") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..100 (a percentage)")
    return v


def finite(text: str) -> float:
    """argparse type: a finite float (no nan, no inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return v


def integer(text: str) -> int:
    """argparse type: an integer (the message quotes the text)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def int_at_least(lo: int):
    """argparse type factory: an integer >= lo."""
    def parse(text: str) -> int:
        v = integer(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be at least {lo}")
        return v
    return parse


nonneg = int_at_least(0)
positive = int_at_least(1)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """argparse type: a size in bytes, >= 0: a number with an optional binary unit K, M, G or T (``512M``,
    ``4G``, ``1.5G``; a trailing ``B``/``iB`` is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        v = float(t[:len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (a number of bytes, or with K, M, G or T: "
                                         "512M, 4G)") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite size >= 0")
    return int(v)


def int_in(lo: int, hi: int, what: str):
    """argparse type factory: an integer in lo..hi; ``what`` names the quantity in the message."""
    def parse(text: str) -> int:
        v = integer(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}..{hi} ({what})")
        return v
    return parse


def int_between(lo: int, hi: int):
    """argparse type factory: an integer in lo..hi (both included)."""
    return int_in(lo, hi, f"an integer in {lo}..{hi}")


def draft_depth(text: str) -> int:
    """argparse type of every corpus draft depth flag (run/demo/bench --k, --k-max, bench corpus -k): the one depth
    rule (:func:`redraft.defaults.check_depth`), refused in the parser rather than clamped (a K from the
    environment is clamped with a warning: it cannot be refused at parse time)."""
    try:
        return check_depth(None, text, text=True)
    except DepthError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def float_above(lo: float, *, strict: bool):
    """argparse type factory: a finite number > lo (``strict``) or >= lo."""
    def parse(text: str) -> float:
        v = finite(text)
        if v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {lo:g}")
        return v
    return parse


def probability(text: str) -> float:
    """argparse type: a number in (0, 1] (nucleus sampling's top-p)."""
    v = finite(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1] (1 = off)")
    return v


def stop_string(text: str) -> str:
    """argparse type: a non-empty stop string (an empty one would match before the first token)."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return text


def _check_writable(text: str, directory: str, *, created: bool) -> None:
    """Refuse ``text`` unless ``directory`` (or, when ``created``, its nearest existing ancestor) is a writable
    directory."""
    base = directory
    while created and not os.path.exists(base):
        base = os.path.dirname(base)
    if not os.path.exists(base):
        raise argparse.ArgumentTypeError(f"{text}: directory {base} does not exist")
    if not os.path.isdir(base):
        raise argparse.ArgumentTypeError(f"{text}: {base} is not a directory")
    if not os.access(base, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {base} is not writable")


def output_file(text: str) -> str:
    """argparse type for a file we will write: refuse a directory, a missing or read-only parent up front, not
    after a run."""
    p = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(p):
        raise argparse.ArgumentTypeError(f"{text} is a directory (expected a file path)")
    _check_writable(text, os.path.dirname(p), created=False)
    return text


def output_dir(text: str) -> str:
    """argparse type for a directory we will write files into (created with its parents when missing): refuse an
    existing non-directory, or a path whose nearest existing ancestor is not a writable directory, up front."""
    p = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(p) and not os.path.isdir(p):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory (expected a directory path)")
    _check_writable(text, p, created=True)
    return text


def existing_dir(text: str) -> str:
    """argparse type: a directory that exists."""
    p = os.path.expanduser(text)
    if not os.path.isdir(p):
        why = "is not a directory" if os.path.exists(p) else "does not exist"
        raise argparse.ArgumentTypeError(f"directory {text} {why}")
    return text


def cape_bins(text: str) -> CapeBins:
    """argparse type: CaPE bins, e.g. ``0.3,0.6,0.8:7,5,3,1`` (see :meth:`CapeBins.parse`)."""
    try:
        return CapeBins.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
