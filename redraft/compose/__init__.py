"""The one composition point: a :class:`SpeculationConfig` in, drafters + policy + Engine out.

- :mod:`redraft.compose.env`: the one reader of ``REDRAFT_*`` / ``COLI_*`` variables.
- :mod:`redraft.compose.config`: :class:`SpeculationConfig`, every knob once with its default and the policy rule.
- :mod:`redraft.compose.build`: :func:`build_engine`, :func:`build_drafters`, :func:`build_policy`,
  :func:`glide_drafter`, :func:`plain_engine`.
- :mod:`redraft.compose.runtime`: :func:`load_target`, the target on transformers or llama.cpp.

Nothing else in redraft constructs an Engine, a drafter or a policy (tests/compose/test_composition.py). Importing this
package loads no torch.
"""

from redraft.compose.build import (
    build_drafters,
    build_engine,
    build_policy,
    drafters_for,
    engine_with,
    glide_drafter,
    glide_from_config,
    plain_engine,
    policy_for,
)
from redraft.compose.config import GlideSettings, SpeculationConfig
from redraft.compose.env import EnvError
from redraft.compose.runtime import RUNTIMES, load_target

__all__ = ["RUNTIMES", "EnvError", "GlideSettings", "SpeculationConfig", "build_drafters", "build_engine", "build_policy",
           "drafters_for", "engine_with", "glide_drafter", "glide_from_config", "load_target", "plain_engine", "policy_for"]
