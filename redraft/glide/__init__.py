"""The GliDe draft model (arXiv 2402.02082): configuration, positions and masks, network, checkpoints.

A leaf under the drafters: nothing here imports the engine. The drafter that uses a trained draft during decoding
lives in :mod:`redraft.drafters.glide` (with CaPE in :mod:`redraft.drafters.cape`); training and evaluation, which
run the target and the engine, live in :mod:`redraft.training`; ``redraft glide train|eval`` is defined in
:mod:`redraft.cli.glide`.
"""

from redraft.glide.config import GlideConfig
from redraft.glide.network import GlideDraft, build_draft
from redraft.glide.positions import block_mask, prefix_mask, target_rope

__all__ = ["GlideConfig", "GlideDraft", "block_mask", "build_draft", "prefix_mask", "target_rope"]
