"""SpeculationConfig: every speculation knob once, with its one default (from :mod:`redraft.defaults`).

A front end describes the speculation it wants as a :class:`SpeculationConfig` (from command-line flags with
:meth:`SpeculationConfig.from_args`, from the environment with :meth:`SpeculationConfig.from_env`, or in plain
Python) and :mod:`redraft.compose.build` turns it into drafters, a policy and an :class:`~redraft.decoding.engine.Engine`.

The rule that decides between the two modes lives here and only here (:attr:`SpeculationConfig.policy_on`): the
cost-aware policy (:mod:`redraft.policy`) chooses each step's draft depth unless it is switched off or a fixed
setting is given (a depth ``k``, an adaptive cap ``k_max`` or a guard threshold ``minacc``, from a flag or the
environment); then Colibri's fixed semantics apply (depth K, default 8; pause a source whose acceptance falls below
MINACC, default 50%).

Standard library only (plus :mod:`redraft.defaults` and :mod:`redraft.compose.env`): importing it loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from redraft.compose.env import ENV_CORPUS, check_depth, env, read_draft_env
from redraft.defaults import (
    CORPUS_K_DEFAULT,
    CORPUS_MINACC,
    GLIDE_GAMMA,
    MAX_DRAFT_DEPTH,
    POLICY_MAX_DEPTH,
    TREE_BUDGET,
)


@dataclass(frozen=True)
class GlideSettings:
    """A GliDe draft model source (arXiv 2402.02082; docs/glide.md).

    Attributes:
        path: checkpoint directory (``redraft glide train --out``); None = the draft shipped for the default model.
        cape: widen drafts into CaPE token trees; ``cape_bins`` a :class:`~redraft.drafters.cape.CapeBins` or None
            for the paper's bins.
        gamma: draft depth along the greedy spine (default GLIDE_GAMMA = 4, the paper's gamma).
        draft_vocab: N > 0 = reduced-vocabulary head of N tokens; 0 = the full vocabulary.
    """

    path: str | None = None
    cape: bool = False
    cape_bins: Any = None
    gamma: int = GLIDE_GAMMA
    draft_vocab: int = 0


@dataclass(frozen=True)
class SpeculationConfig:
    """How a target model speculates: draft sources, draft depth, verification and exactness.

    Attributes:
        corpus: frozen corpus file (text or binary) or None; a loaded corpus is handed to the builder instead.
        k: fixed corpus draft depth 1..48 (None = the policy's choice, or CORPUS_K_DEFAULT = 8 without it).
        minacc: fixed acceptance guard threshold as a fraction (None = the policy's choice, or CORPUS_MINACC = 0.5
            without it); the n-gram guard uses min(minacc, NGRAM_MINACC), a GliDe draft min(minacc, GLIDE_MINACC).
        k_max: adaptive corpus depth (double while accepted whole) up to this; None = off.
        policy: use the cost-aware policy unless a fixed setting is given (:attr:`policy_on`).
        ngram: n-gram (prompt lookup) drafts from the live context.
        tree: > 0 = the corpus's ``tree`` most frequent continuations merged with the other drafts into one token tree.
        tree_budget: most draft nodes per verify forward (None = TREE_BUDGET = 32 for token trees; a single chain
            is limited by its depth only: up to 48, or POLICY_MAX_DEPTH = 512 under the policy).
        exact: settle near-tie verify rows the way plain decoding computes them (:mod:`redraft.decoding.exactness`).
        generation_config: shape logits with the model's generation_config as HF ``generate(do_sample=False)``.
        force: use a binary corpus whose tokenizer fingerprint differs from the model's.
        glide: a :class:`GlideSettings`, or None for no draft model.
        grammar: grammar drafts: where a request's output grammar (a JSON schema, a forced tool call) allows one
            continuation only, propose it (first in priority, before the corpus and n-gram drafts).
    """

    corpus: str | None = None
    k: int | None = None
    minacc: float | None = None
    k_max: int | None = None
    policy: bool = True
    ngram: bool = True
    tree: int = 0
    tree_budget: int | None = None
    exact: bool = True
    generation_config: bool = True
    force: bool = False
    glide: GlideSettings | None = field(default=None)
    grammar: bool = True

    def __post_init__(self) -> None:
        """Raises :class:`~redraft.defaults.DepthError` (a ValueError) for a bad ``k`` / ``k_max`` (the one
        depth rule, :func:`~redraft.defaults.check_depth`), ValueError for the other fields."""
        for name in ("k", "k_max"):
            if getattr(self, name) is not None:
                check_depth(f"SpeculationConfig.{name}", getattr(self, name))
        v = self.tree_budget
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"SpeculationConfig.tree_budget={v!r}: expected an integer in 1..inf")
        if self.minacc is not None and not 0.0 <= self.minacc <= 1.0:
            raise ValueError(f"SpeculationConfig.minacc={self.minacc!r}: expected a fraction in 0..1 (0.5 = 50%)")
        if not isinstance(self.tree, int) or self.tree < 0:
            raise ValueError(f"SpeculationConfig.tree={self.tree!r}: expected an integer >= 0")

    # ---- derived settings: each rule once --------------------------------------------------------------------

    @property
    def policy_on(self) -> bool:
        """The cost-aware policy decides depths: ``policy`` and no fixed ``k``, ``k_max`` or ``minacc``."""
        return self.policy and self.k is None and self.k_max is None and self.minacc is None

    @property
    def depth(self) -> int:
        """The corpus drafters' depth: 48 under the policy (it cuts each draft), else ``k`` (default 8)."""
        return MAX_DRAFT_DEPTH if self.policy_on else (self.k if self.k is not None else CORPUS_K_DEFAULT)

    @property
    def adaptive_max(self) -> int | None:
        """The adaptive depth cap in force (None under the policy or when ``k_max`` is unset)."""
        return None if self.policy_on else self.k_max  # checked to lie in 1..48 at construction

    @property
    def guard_minacc(self) -> float:
        """The fixed guard's threshold (a fraction): ``minacc``, default CORPUS_MINACC."""
        return self.minacc if self.minacc is not None else CORPUS_MINACC

    @property
    def max_depth(self) -> int:
        """The engine's cap on draft depth: POLICY_MAX_DEPTH (512) under the policy, which verifies past 48 tokens
        only where the measured cost curve and the learned acceptance say it pays; else the corpus depth, the
        adaptive cap or a GliDe draft's gamma, at most 48 (Colibri's cap)."""
        if self.policy_on:
            return POLICY_MAX_DEPTH
        gamma = self.glide.gamma if self.glide is not None else 0
        return min(MAX_DRAFT_DEPTH, max(self.depth, self.adaptive_max or 0, gamma))

    @property
    def budget(self) -> int:
        """Most draft nodes per verify forward: ``tree_budget``, else TREE_BUDGET for token trees (``tree`` or
        CaPE) and max(TREE_BUDGET, 48, :attr:`max_depth`) for a single chain (never cut: its depth alone limits it)."""
        if self.tree_budget is not None:
            return self.tree_budget
        trees = self.tree > 0 or (self.glide is not None and self.glide.cape)
        return TREE_BUDGET if trees else max(TREE_BUDGET, MAX_DRAFT_DEPTH, self.max_depth)

    @property
    def policy_nodes(self) -> int:
        """Most candidate nodes the policy weighs per step (and the size its cost table covers)."""
        return max(self.max_depth, self.budget)

    def with_(self, **changes) -> SpeculationConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    # ---- constructors ----------------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ=None, **overrides) -> SpeculationConfig:
        """A config from ``REDRAFT_*`` / ``COLI_*`` variables (:mod:`redraft.compose.env`), then ``overrides``
        (Python arguments beat the environment).

        Raises:
            redraft.compose.env.EnvError: a variable that is not what it must be.
        """
        e = read_draft_env(environ)
        base: dict[str, Any] = {"corpus": e.corpus, "k": e.k, "minacc": e.minacc}
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_args(cls, args, environ=None) -> SpeculationConfig:
        """A config from the parsed draft flags (``redraft.cli.common.add_draft_args``; flags a command does not
        declare keep their defaults): a flag beats ``REDRAFT_*``, which beats ``COLI_*``.

        ``--minacc`` is a percentage on the command line; the config holds a fraction.

        Raises:
            redraft.compose.env.EnvError: a variable that is not what it must be.
        """
        def get(name, default=None):
            return getattr(args, name, default)

        e = read_draft_env(environ)
        corpus = get("corpus")
        if isinstance(corpus, list):  # commands whose --corpus takes several files build their own corpus
            corpus = None
        elif corpus is None:
            corpus = env(ENV_CORPUS, environ)
        k = get("k") if get("k") is not None else e.k
        minacc = get("minacc") / 100.0 if get("minacc") is not None else e.minacc
        glide = None
        if get("draft") == "glide":
            glide = GlideSettings(path=get("draft_model"), cape=bool(get("cape", False)), cape_bins=get("cape_bins"),
                                  gamma=get("gamma") if get("gamma") is not None else GLIDE_GAMMA,
                                  draft_vocab=get("draft_vocab", 0) or 0)
        return cls(corpus=corpus, k=k, minacc=minacc, k_max=get("k_max"), policy=not get("no_policy", False),
                   ngram=not get("no_ngram", False), tree=get("tree", 0) or 0, tree_budget=get("tree_budget"),
                   exact=get("exact", True), generation_config=not get("no_generation_config", False),
                   force=bool(get("force", False)), glide=glide)
