"""Draft sources. Each proposes tokens for the verifier; none of them can change the output, only its speed.

The drafters keep their classes here; :mod:`redraft.compose` instantiates them (``build_drafters``).
"""

from __future__ import annotations

from redraft.drafters.base import AcceptanceGuard, Drafter
from redraft.drafters.frozen_corpus import CorpusDrafter
from redraft.drafters.ngram import NgramDrafter

__all__ = ["AcceptanceGuard", "Drafter", "CorpusDrafter", "NgramDrafter"]

