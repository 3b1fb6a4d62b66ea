"""The one reader of redraft's environment variables (``REDRAFT_*``, and Colibri's ``COLI_*`` aliases).

Precedence everywhere: a command-line flag (or a Python argument) beats ``REDRAFT_*``, which beats ``COLI_*``
(the order of each name tuple below). Colibri's convention for the draft depth is kept: a ``REDRAFT_CORPUS_K`` /
``COLI_CORPUS_K`` outside 1..48 is clamped with one warning naming the variable. A value that is not a number
raises :class:`EnvError` naming the variable and what was expected.

:func:`check_depth` is the one rule for a draft depth, wherever it comes from (a flag, a variable, a
:class:`~redraft.compose.SpeculationConfig` field, the vLLM proposer's settings, the engine's cap).

Standard library and :mod:`redraft.defaults` only: every front end (the CLI before torch loads, the vLLM proposer's
numpy-only hot path) can import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from redraft.defaults import DepthError, check_depth

ENV_CORPUS = ("REDRAFT_DRAFT_CORPUS", "COLI_DRAFT_CORPUS")
ENV_K = ("REDRAFT_CORPUS_K", "COLI_CORPUS_K")
ENV_K_MAX = ("REDRAFT_CORPUS_K_MAX",)  # a vLLM proposer's adaptive depth cap (the CLI's --k-max)
ENV_MINACC = ("REDRAFT_CORPUS_MINACC", "COLI_CORPUS_MINACC")
ENV_NGRAM = ("REDRAFT_NGRAM",)
ENV_LEARN = ("REDRAFT_LEARN_CORPUS",)
ENV_TENANT = ("REDRAFT_LEARN_TENANT",)  # the tenant directory a vLLM proposer learns into
ENV_FORCE = ("REDRAFT_CORPUS_FORCE",)


class EnvError(ValueError):
    """An environment variable holds something other than what it must; the message names it and the expectation."""


def first_set(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(name, value) of the first of ``names`` that is set and not empty in ``environ`` (default ``os.environ``);
    (names[0], None) when none is."""
    environ = os.environ if environ is None else environ
    for n in names:
        v = environ.get(n)
        if v not in (None, ""):
            return n, v
    return names[0], None


def env(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the first of ``names`` that is set and not empty, or None."""
    return first_set(names, environ)[1]


def _label(names: tuple[str, ...]) -> str:
    return "/".join(names)


def int_env(names: tuple[str, ...], default: int, environ: Mapping[str, str] | None = None) -> int:
    """An integer from :func:`env`, or ``default`` when unset.

    Raises:
        EnvError: the value is not an integer (the message names the variables).
    """
    v = env(names, environ)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise EnvError(f"{_label(names)}={v!r} is not an integer") from None


def percent_env(names: tuple[str, ...], environ: Mapping[str, str] | None = None) -> float | None:
    """A percentage 0..100 from :func:`env` as a fraction (50 -> 0.5), or None when unset.

    Raises:
        EnvError: not a number, or outside 0..100.
    """
    v = env(names, environ)
    if v is None:
        return None
    try:
        x = float(v)
    except ValueError:
        raise EnvError(f"{_label(names)}: {v!r} is not a number (expected a percentage 0..100)") from None
    if not 0 <= x <= 100:
        raise EnvError(f"{_label(names)}: {v} is outside 0..100 (a percentage)")
    return x / 100.0


def flag_env(names: tuple[str, ...], default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A 0/1 switch from :func:`env`, or ``default`` when unset.

    Raises:
        EnvError: the value is neither 0 nor 1.
    """
    name, v = first_set(names, environ)
    if v is None:
        return default
    if v not in ("0", "1"):
        raise EnvError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


@dataclass(frozen=True)
class DraftEnv:
    """What the environment says about drafting: ``corpus`` path, ``k`` (1..48 after clamping) and ``minacc``
    (a fraction), each None when its variables are unset."""

    corpus: str | None = None
    k: int | None = None
    minacc: float | None = None

    @property
    def fixed(self) -> bool:
        """True when the environment sets a fixed draft setting (a depth or a guard threshold): no policy."""
        return self.k is not None or self.minacc is not None


def read_draft_env(environ: Mapping[str, str] | None = None) -> DraftEnv:
    """The draft variables (corpus, K, MINACC) of ``environ`` (default ``os.environ``).

    Raises:
        EnvError: a K that is not an integer, a MINACC that is not a percentage.
    """
    name, k = first_set(ENV_K, environ)
    try:
        depth = None if k is None else check_depth(name, k, text=True, out_of_range="warn")
    except DepthError as e:  # an environment variable's error, in the one rule's words
        raise EnvError(str(e)) from None
    return DraftEnv(corpus=env(ENV_CORPUS, environ), k=depth, minacc=percent_env(ENV_MINACC, environ))


__all__ = ["DepthError", "DraftEnv", "ENV_CORPUS", "ENV_FORCE", "ENV_K", "ENV_K_MAX", "ENV_LEARN", "ENV_MINACC",
           "ENV_NGRAM", "ENV_TENANT", "EnvError", "check_depth", "env", "first_set", "flag_env", "int_env", "percent_env", "read_draft_env"]
