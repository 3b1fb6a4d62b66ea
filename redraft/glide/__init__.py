"""GliDe draft models (arXiv 2402.02082): architecture, checkpoints, training data, training and evaluation.

The drafter that uses a trained draft during decoding lives in :mod:`redraft.drafters.glide` (with CaPE in
:mod:`redraft.drafters.cape`); ``redraft glide train|eval`` is defined in :mod:`redraft.cli.glide`.
"""

from redraft.glide.model import GlideConfig, GlideDraft, block_mask, build_draft, prefix_mask, target_rope

__all__ = ["GlideConfig", "GlideDraft", "block_mask", "build_draft", "prefix_mask", "target_rope"]
