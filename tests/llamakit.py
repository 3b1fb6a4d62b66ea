"""Helpers for the llama.cpp tests: whether the ``llama`` extra is installed, and the marker of tests that need it."""

from __future__ import annotations

import pytest


def has_llama() -> bool:
    """Whether llama-cpp-python (the ``llama`` extra, ``make llama``) imports here."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


SKIP_REASON = "the llama extra (llama-cpp-python) is not installed"
_skip = pytest.mark.skipif(not has_llama(), reason=SKIP_REASON)


def needs_llama(test):
    """Skipped without the llama extra; marked ``llama`` (conftest: a skip fails only with REDRAFT_REQUIRE_LLAMA=1)."""
    return pytest.mark.llama(_skip(test))
