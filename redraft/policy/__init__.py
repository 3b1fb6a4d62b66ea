"""Cost-aware speculation policy: how deep (and, for trees, how wide) to draft each step.

The rule
    A verify forward with n draft tokens costs c(n) plain 1-token steps, c(0) = 1, measured where redraft runs
    (:class:`~redraft.pricing.curve.CostCurve`, owned with every other price by :mod:`redraft.pricing`: measured
    by :mod:`redraft.pricing.measure` and cached by :mod:`redraft.pricing.cache` per model, dtype, device, thread count and machine). Each candidate node i
    gets q(i) = P(accepted | parent accepted) from what was learned online about its source at its depth
    (:mod:`~redraft.policy.acceptance`: decayed Beta counts, so the estimate follows the last few forwards)
    blended with what the source knows about this draft (:mod:`~redraft.policy.priors`: corpus continuation counts,
    match length). P(i) = product of q along the path is the chance the node is
    accepted, and a kept subtree K yields E(K) = 1 + sum_{i in K} P(i) tokens. The policy keeps the K that
    maximises

        E(K) / c(|K|)        (expected tokens per plain step of verify time)

    and keeps nothing unless that beats a plain step's 1 / c(0) = 1. For a chain, K is the first d tokens: the
    draft depth. That rate is one forward's; a chain likely right well past d (a replay) would then be verified in
    forwards of d ending in a short one, so a chain gets a wider first forward (up to all of it) when that plan's
    expected tokens per unit of verify time beat the chunked plan's, each later chunk counted with the chance of
    reaching it
    (:meth:`~redraft.policy.speculation.SpeculationPolicy.plan`). Below level 1, what was learned about a source
    scales its priors at the levels under it (a short n-gram match's rule-of-succession prior, 0.8-0.97 per deep
    level, is followed only while outcomes agree with it). A flat curve (a GPU, where a wider verify is almost free) drafts to the cap whenever acceptance is
    above zero; a steep one drafts only as deep as acceptance pays for. No machine-specific constant is involved:
    the only machine inputs are the measured curve and, for one sequence's own loop (``learn_prices``, the
    composition point's default), that loop's step times, which correct the curve to what a draft costs there
    (:mod:`redraft.pricing.loop`: its planning, its verify and the step after it). A source whose drafts are dropped is re-tried with a short probe
    (1..4 tokens, the length the curve makes cheapest, never extended) once the probe's cost should nothing be
    accepted, spread over the idle steps, is under ``probe_overhead`` (3%) of a plain step, so a useless source
    costs at most that; a probe that pays is followed by another at once and the estimates decay with every
    outcome, so a source that turned useful drafts again a probe interval later (tests/policy/test_policy.py and
    tests/decoding/test_engine_policy.py bound both on synthetic curves). The engine learns per source and power-of-two
    match length (:func:`~redraft.policy.candidates.policy_key`). Asking a drafter costs time too: one whose
    proposals keep being dropped is asked only so often that its asking costs at most 1% of a step
    (:mod:`~redraft.policy.asking`).

What it replaces
    Colibri's acceptance guard (COLI_CORPUS_MINACC: pause a source for 256 tokens when acceptance over its last
    24 draft tokens falls under 50%) and the fixed depth K. The guard becomes a consequence of the rule: a source
    drafts exactly when its expected gain exceeds the cost of the wider verify, at the depth where that gain per
    unit cost peaks. SuffixDecoding (Oliaro et al., arXiv 2411.04975) scores a corpus draft by the product of its
    continuation frequencies and bounds its depth by a multiple of the match length; here the frequencies are the
    per-node priors, and the depth bound comes out of the cost curve instead (an optional
    :func:`~redraft.policy.priors.depth_limit` reproduces SuffixDecoding's cap).

How the engine calls it (one SpeculationPolicy per Engine; it keeps learning across generations), per verify
forward, in :meth:`redraft.decoding.engine.Engine.generate`:

1. each drafter's proposal (a :class:`~redraft.tree.TokenTree`) goes into an :class:`~redraft.policy.candidates.Candidates`,
   which keeps per node its policy key (source and match length, :func:`~redraft.policy.candidates.policy_key`) and its
   prior (:func:`~redraft.policy.candidates.proposal_priors`: corpus continuation counts, match length);
2. :func:`~redraft.policy.candidates.cut` asks :meth:`SpeculationPolicy.plan` which nodes to verify (within the step's
   token and depth limits) and returns them as the verify tree; in priority mode the sources are tried in order and
   the first proposal the policy keeps any of is verified;
3. after the verify forward :func:`~redraft.policy.candidates.observe_outcomes` feeds :meth:`SpeculationPolicy.observe`
   what each source proposed and got accepted, counting only what the output reached.

The policy is built with a curve: ``SpeculationPolicy(curve, max_nodes=...)``; the default one for a model on this
machine is :func:`redraft.compose.build_policy` (the cached curve, measured first if missing: ~45 s on
the 2-core development CPU with one thread, 13 sizes up to 512 draft tokens x 5 repeats).

A one-source chain (an n-gram or corpus draft) is estimated only down to the depth where the chance of reaching a
node falls to the least price per node of going deeper (:func:`~redraft.pricing.draft.chain_floor`): no cut past
it pays, so on a steep curve a chance draft of 48 tokens is judged on its first few nodes, and on its first node
alone when that one cannot pay and no probe is due (the plans are the same as with every node estimated:
tests/policy/test_chain_floor.py).

Limits: the curve is measured with chain forwards; a token tree's 4D mask can cost a little more (``redraft bench
cost --tree-mask``). A plan over a 48-node chain takes ~0.1 ms in Python, against ~65 ms for a verify forward here.

Modules (numpy only, no target model; the curve and every price on it are :mod:`redraft.pricing`'s): acceptance (online per-source
estimates), priors (source self-knowledge), select (the subtree choice), speculation (SpeculationPolicy: all of it
per step, with probes), apply (the engine's side: a step's candidate tree with per-source priors and keys, the cut,
the outcomes fed back). The policy is built by the composition point, :func:`redraft.compose.build_engine` (from a
:class:`~redraft.compose.SpeculationConfig` with the policy on, the default; ``redraft.compose.build_policy(model)``
for one alone); every front end (``run``, ``demo``, ``bench run``'s ``policy`` method, ``serve``) builds through it.
"""

from redraft.policy.acceptance import AcceptanceTracker
from redraft.policy.priors import count_priors, depth_limit, source_priors, succession_priors
from redraft.policy.select import Selection, select_nodes, source_outcomes, subtree_parents
from redraft.policy.speculation import SpeculationPolicy

__all__ = ["AcceptanceTracker", "Selection", "SpeculationPolicy", "count_priors",
           "depth_limit", "select_nodes", "source_outcomes", "source_priors", "subtree_parents", "succession_priors"]
