"""Building speculation: drafters, the cost-aware policy and the Engine, from a :class:`SpeculationConfig`.

This is the one place where redraft constructs an :class:`~redraft.decoding.engine.Engine`, a drafter
(:class:`~redraft.drafters.frozen_corpus.CorpusDrafter`, :class:`~redraft.drafters.ngram.NgramDrafter`,
:class:`~redraft.drafters.glide.GlideDrafter`) or a :class:`~redraft.policy.SpeculationPolicy`: every front end
(``redraft run``/``freeze``/``demo``/``oracle``, the bench methods, the server, GliDe evaluation, the vLLM proposer and
the Python API) builds through it, so a default changes in one place (tests/compose/test_composition.py checks this).

Torch is imported only by the functions that need it (the engine, a GliDe draft, measuring a cost curve):
:func:`build_drafters` stays numpy-only for the vLLM proposer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from redraft.compose.config import SpeculationConfig
from redraft.defaults import (
    CORPUS_K_DEFAULT,
    CORPUS_MINACC,
    CORPUS_WINDOW,
    GLIDE_GAMMA,
    GLIDE_MINACC,
    MAX_DRAFT_DEPTH,
    NGRAM_MINACC,
    NGRAM_PAUSE,
    POLICY_MAX_DEPTH,
    POLICY_NGRAM_MIN_N,
    POLICY_SUFFIX_MAX_N,
    SUFFIX_CONTEXT_N,
    SUFFIX_MAX_N,
    SUFFIX_MIN_N,
)
from redraft.drafters.base import AcceptanceGuard, Drafter
from redraft.drafters.frozen_corpus import CorpusDrafter
from redraft.drafters.grammar import GrammarDrafter
from redraft.drafters.ngram import NgramDrafter


def build_drafters(corpus=None, *, k: int = CORPUS_K_DEFAULT, minacc: float = CORPUS_MINACC, ngram: bool = True,
                   ngram_k: int | None = None, tree_branches: int = 0, k_max: int | None = None,
                   glide=None, corpus_name: str = "corpus", policy: bool = False,
                   context_n: int | None = SUFFIX_CONTEXT_N) -> list[Drafter]:
    """The default draft sources in priority order: frozen corpus first, then n-gram lookup over the live context.

    Args:
        corpus: a loaded :class:`redraft.corpus.Corpus` or None.
        k: corpus draft depth (clamped to 1..48).
        minacc: corpus acceptance guard threshold as a fraction (0.5 = 50%); the n-gram guard uses the lower of
            this and NGRAM_MINACC, pausing for NGRAM_PAUSE tokens.
        ngram: include the n-gram drafter.
        ngram_k: n-gram draft depth (default: same as k).
        tree_branches: > 0 makes the corpus propose its most frequent continuations as a token tree.
        k_max: adaptive corpus depth (see :class:`CorpusDrafter`); None = fixed depth k.
        glide: a GliDe drafter (:func:`glide_drafter`) or None; lowest priority, it fills the steps where the
            corpus and the n-gram source have nothing.
        corpus_name: the corpus source's name (its statistics key).
        context_n: past ``max_n`` matching ids, the corpus lookup extends the match back up to this many context ids
            and drafts from the occurrence whose preceding context matches longest; None = Colibri's 8-id rule.
        policy: drafters for an engine with a :class:`~redraft.policy.SpeculationPolicy`: the corpus and n-gram
            sources propose up to the depth cap (48) and never pause themselves; the policy chooses how much of
            each draft to verify and when a source drafts at all (``k``, ``minacc``, ``ngram_k`` and ``k_max`` are
            ignored: they are the fixed semantics). The corpus matches suffixes up to POLICY_SUFFIX_MAX_N tokens
            and the n-gram source from POLICY_NGRAM_MIN_N: their match lengths tell the policy what to trust. A
            corpus match past POLICY_SUFFIX_MAX_N ids or of the whole (shorter) live context (a replay) drafts up to
            POLICY_MAX_DEPTH (512) tokens.
    """
    corpus_max_n, ngram_min_n, deep = SUFFIX_MAX_N, SUFFIX_MIN_N, None
    if policy:
        deep = POLICY_MAX_DEPTH
        k, ngram_k, k_max, minacc = MAX_DRAFT_DEPTH, MAX_DRAFT_DEPTH, None, 0.0
        corpus_max_n, ngram_min_n = POLICY_SUFFIX_MAX_N, POLICY_NGRAM_MIN_N
    drafters: list = []
    if corpus is not None:
        # Colibri judges after 24 tokens = three K=8 drafts; deeper drafts get the same three drafts, or one early
        # miss in a 32-token draft would pause a replay for the rest of the answer
        window = max(CORPUS_WINDOW, 3 * max(k, k_max or k))
        drafters.append(CorpusDrafter(corpus, k=k, guard=AcceptanceGuard(minacc, window=window),
                                      tree_branches=tree_branches, k_max=k_max, max_n=corpus_max_n,
                                      name=corpus_name, context_n=context_n, deep=deep))
    if ngram:
        guard = AcceptanceGuard(min(minacc, NGRAM_MINACC), pause=NGRAM_PAUSE)
        drafters.append(NgramDrafter(k=ngram_k or min(max(k, 1), MAX_DRAFT_DEPTH), guard=guard, min_n=ngram_min_n))
    if glide is not None:
        drafters.append(glide)
    return drafters


def glide_drafter(path, model, *, gamma: int = GLIDE_GAMMA, cape=None, head_vocab: int | None = None,
                  target=None, minacc: float | None = None, name: str = "glide"):
    """A GliDe drafter (:class:`~redraft.drafters.glide.GlideDrafter`) from a checkpoint directory, for ``model``.

    Args:
        path: checkpoint directory (``redraft glide train --out``).
        model: the target, a transformers causal LM.
        cape: :class:`~redraft.drafters.cape.CapeBins`, True for the paper's bins, or None/False for chain drafts.
        head_vocab: N > 0 = reduced-vocabulary head of the N most frequent training tokens.
        target: an :class:`~redraft.runtimes.transformers.target.HFTarget`, or None: the engine binds its own before every
            generation.
        minacc: None = no guard; a fraction = pause while acceptance per draft level stays below it.
        name: the source's name; a checkpoint without cross-attention is reported as "vanilla draft".
    Raises:
        redraft.glide.checkpoint.CheckpointError / TargetMismatchError: see :func:`redraft.glide.checkpoint.load_draft`.
    """
    from redraft.drafters.cape import CapeBins
    from redraft.drafters.glide import GlideDrafter
    from redraft.glide.checkpoint import load_draft

    draft = load_draft(path, model, head_vocab=head_vocab)
    bins = CapeBins() if cape is True else (cape or None)
    if name == "glide" and not draft.cfg.cross_attention:
        name = "vanilla draft"  # a baseline checkpoint: say so in the run report
    guard = AcceptanceGuard(minacc) if minacc is not None else None
    return GlideDrafter(draft, target, gamma=gamma, cape=bins, guard=guard, name=name)


def glide_from_config(config: SpeculationConfig, model):
    """The GliDe drafter ``config.glide`` asks for (None without one), guarded at min(minacc, GLIDE_MINACC): a
    draft chain breaks even below the corpus's 50% acceptance, which would switch off a draft that still pays
    (Measurements: docs/measurements.md#redraft-compose-build).

    Raises:
        FileNotFoundError: no checkpoint path and no draft shipped with this install.
        redraft.glide.checkpoint.CheckpointError / TargetMismatchError: as :func:`glide_drafter`.
    """
    g = config.glide
    if g is None:
        return None
    from redraft.defaults import SHIPPED_GLIDE_DIR

    path = g.path or SHIPPED_GLIDE_DIR
    if not g.path and not (SHIPPED_GLIDE_DIR / "glide.json").is_file():
        raise FileNotFoundError("this install ships no GliDe draft: give a checkpoint directory")
    from redraft.drafters.cape import CapeBins

    bins = (g.cape_bins or CapeBins()) if g.cape else None
    return glide_drafter(path, model, gamma=g.gamma, cape=bins, head_vocab=g.draft_vocab or None,
                         minacc=min(config.guard_minacc, GLIDE_MINACC))


def drafters_for(config: SpeculationConfig, corpus=None, *, glide=None, corpus_name: str = "corpus",
                 ngram: bool | None = None) -> list[Drafter]:
    """The drafters ``config`` asks for, around an already opened ``corpus`` (or None) and GliDe drafter.

    Args:
        ngram: overrides ``config.ngram`` (a second corpus source beside the first has no n-gram source).
    """
    return build_drafters(corpus, k=config.depth, minacc=config.guard_minacc,
                          ngram=config.ngram if ngram is None else ngram, tree_branches=config.tree,
                          k_max=config.adaptive_max, glide=glide, corpus_name=corpus_name, policy=config.policy_on)


def grammar_drafters(config: SpeculationConfig, constraint) -> list[Drafter]:
    """The grammar drafter for a request whose output is constrained by ``constraint`` (a
    :class:`~redraft.grammar.Constraint`), or none (no constraint, or ``config.grammar`` off). It goes first:
    grammar > corpus > n-gram, as Colibri orders its draft sources."""
    return [GrammarDrafter(constraint)] if constraint is not None and config.grammar else []


def build_policy(model=None, *, max_nodes: int = MAX_DRAFT_DEPTH, curve=None, **kw):
    """A :class:`~redraft.policy.SpeculationPolicy` with ``curve`` (a :class:`~redraft.pricing.CostCurve`), or
    ``model``'s cost curve from the cache, measured first if missing (a few seconds on a CPU, once per model,
    dtype, thread count and machine). ``kw`` go to SpeculationPolicy; its ``learn_prices`` is on unless given
    (the curve's draft part rescaled by the engine loop's own step times, :mod:`redraft.pricing.loop`).

    Raises:
        ValueError: neither ``model`` nor ``curve`` given.
    """
    from redraft.policy.speculation import SpeculationPolicy

    if curve is None:
        if model is None:
            raise ValueError("build_policy: give the target model (its cost curve is measured) or a cost curve")
        from redraft.pricing.cache import cached_cost_curve
        from redraft.runtimes.transformers.target import as_target

        curve = cached_cost_curve(as_target(model))
    kw.setdefault("learn_prices", True)
    return SpeculationPolicy(curve, max_nodes=max_nodes, **kw)


def build_load_policy(pricing, tracker):
    """A :class:`~redraft.policy.load.LoadAwarePolicy` for one request of a batched runtime (the vLLM proposer):
    ``pricing`` (a :class:`~redraft.pricing.load.LoadPricing`: the step's cost at the batch's load) and ``tracker``
    (an :class:`~redraft.policy.AcceptanceTracker` shared by all requests). numpy only."""
    from redraft.policy.load import LoadAwarePolicy

    return LoadAwarePolicy(pricing, tracker=tracker)


@functools.lru_cache(maxsize=8)
def _load_pricing(curve, n_max: int):
    """The :class:`~redraft.pricing.load.LoadPricing` of a cost curve and node cap, built once (its tables take
    ~10 ms) and shared by every tenant's requests on that curve."""
    from redraft.pricing.load import LoadPricing

    return LoadPricing(curve, n_max)


def batched_policy(policy):
    """A :class:`~redraft.policy.load.LoadAwarePolicy` for one sequence decoding inside a
    :class:`~redraft.runtimes.transformers.batching.StepBatcher`: the engine prices each step's draft at the rows the step carries
    for other sequences (:meth:`LoadAwarePolicy.at_load`, the vLLM proposer's rule), so draft depth shrinks as the
    batch fills and grows back as it empties.

    Args:
        policy: the tenant's :class:`~redraft.policy.SpeculationPolicy`. The new policy shares its acceptance
            tracker (what one request learns, the tenant's next requests use; another tenant's policy is never
            touched), cost curve, node cap and probe settings; its load pricing tables are shared per curve and
            node cap.
    Returns:
        the request's LoadAwarePolicy (its own probe bookkeeping). numpy only.
    """
    from redraft.policy.load import LoadAwarePolicy

    return LoadAwarePolicy(_load_pricing(policy.curve, policy.max_nodes), tracker=policy.tracker,
                           probe_overhead=policy.probe_overhead, probe_max=policy.probe_max,
                           min_gain=policy.min_gain, prompt_chance=policy.prompt_chance)


def policy_for(model, *, max_nodes: int = MAX_DRAFT_DEPTH, **kw):
    """:func:`build_policy` for ``model`` (its cost curve cached)."""
    return build_policy(model, max_nodes=max_nodes, **kw)


def engine_with(model, drafters: Sequence[Drafter], config: SpeculationConfig, *, eos_token_ids: Sequence[int] = (),
                policy=None, generation_config=None):
    """An :class:`~redraft.decoding.engine.Engine` over ``drafters`` with ``config``'s verification settings
    (depth cap, tree merge and budget, exact mode, generation_config) and ``policy`` (a SpeculationPolicy or None).

    Args:
        model: a transformers causal LM or an :class:`~redraft.runtimes.transformers.target.HFTarget`.
        generation_config: a transformers ``GenerationConfig`` to shape logits with instead of the model's (None:
            ``config.generation_config`` says whether the model's applies).
    """
    from redraft.decoding.engine import Engine

    gc = config.generation_config if generation_config is None else generation_config
    return Engine(model, drafters, eos_token_ids=eos_token_ids, max_depth=config.max_depth, merge=config.tree > 0,
                  tree_budget=config.budget, exact=config.exact, generation_config=gc, policy=policy)


def build_engine(model, config: SpeculationConfig | None = None, *, eos_token_ids: Sequence[int] = (), corpus=None,
                 glide=None, policy=None, drafters: Sequence[Drafter] | None = None, generation_config=None):
    """The Engine ``config`` describes: drafters in priority order, chain or tree verification, the cost-aware
    policy when :attr:`SpeculationConfig.policy_on` and there is a draft source.

    Args:
        model: a transformers causal LM (or an HFTarget wrapping one).
        config: default ``SpeculationConfig()`` (policy on, n-gram drafts, exact mode).
        corpus: an opened :class:`redraft.corpus.Corpus` (``config.corpus`` is a path: the caller opens it, with
            its own bad-input handling) or None.
        glide: an already built GliDe drafter; None = the one ``config.glide`` asks for (if any).
        policy: a SpeculationPolicy to share (one that keeps learning across engines); None = a new one from the
            model's cached cost curve when the policy is on.
        drafters: the drafters to use instead of building them from ``config``.
        generation_config: a transformers ``GenerationConfig`` to use instead of the model's (see :func:`engine_with`).
    """
    config = config or SpeculationConfig()
    if glide is None and config.glide is not None:
        glide = glide_from_config(config, _hf_model(model))
    if drafters is None:
        drafters = drafters_for(config, corpus, glide=glide)
    if policy is None and config.policy_on and drafters:
        policy = build_policy(_hf_model(model), max_nodes=config.policy_nodes)
    if glide is not None and policy is not None and config.policy_on:
        # the draft model runs only where some depth pays for its verify cost and the draft's own time
        from redraft.policy.gate import PolicyGate

        drafters = [PolicyGate(d, policy) if d is glide else d for d in drafters]
    return engine_with(model, drafters, config, eos_token_ids=eos_token_ids,
                       policy=policy if config.policy_on else None, generation_config=generation_config)


def plain_engine(model, *, eos_token_ids: Sequence[int] = (), generation_config=True):
    """An Engine with no drafters: plain greedy (or sampled) decoding, one token per forward, the reference every
    drafted run is compared against."""
    from redraft.decoding.engine import Engine

    return Engine(model, [], eos_token_ids=eos_token_ids, generation_config=generation_config)


def _hf_model(model):
    """The transformers model under an HFTarget (the cost curve cache keys on it), or ``model`` itself."""
    from redraft.runtimes.transformers.target import HFTarget

    return model.model if isinstance(model, HFTarget) else model
