"""The Python API: load (or take) a Hugging Face causal LM, give it a corpus, generate.

    from redraft import Redraft
    rd = Redraft.from_pretrained("path/to/model", corpus="answers.corpus")
    out = rd.generate("What is speculative decoding?")   # out.ids, out.text, out.stats

Every generation goes through the composition point (:func:`redraft.compose.build_engine`) with the same
:class:`~redraft.compose.SpeculationConfig` defaults as ``redraft run``: the cost-aware policy, corpus drafts first,
n-gram drafts from the live context, exact mode. Output ids equal plain greedy decoding's (or plain seeded sampling's)
whatever is drafted. One policy per :class:`Redraft`: it keeps learning across calls, as a long-running process does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redraft.compose import SpeculationConfig, build_engine, build_policy
from redraft.defaults import PREFIX_CACHE_TOKENS, PREFIX_DISK_BYTES


@dataclass
class Generation:
    """One answer.

    Attributes:
        prompt: the prompt as given (text, chat messages or token ids).
        prompt_ids: its token ids (chat template applied when the tokenizer has one, unless ``chat=False``).
        ids: generated token ids (an EOS that ended the answer is included, as in HF ``generate``).
        text: the generated text (special tokens skipped).
        stats: ``tokens``, ``forwards`` (target forwards, prefill included), ``tokens_per_forward``, ``proposed`` /
            ``accepted`` draft tokens, ``acceptance`` (accepted / proposed, 0 when nothing was proposed),
            ``seconds`` (wall clock), ``stop_reason`` ("eos", "length", "context" or "stop"), ``sources``
            ({source: {"proposed", "accepted"}}), ``prefix_hit_tokens`` (prompt tokens started from cached KV
            entries, with ``prefix_dir``) and ``prefix_disk_tokens`` (those read from disk).
        result: the engine's :class:`~redraft.decoding.engine.GenerationResult` (per-forward detail).
    """

    prompt: Any
    prompt_ids: list[int]
    ids: list[int]
    text: str
    stats: dict = field(default_factory=dict)
    result: Any = None


def stats_of(res) -> dict:
    """The :attr:`Generation.stats` of a :class:`~redraft.decoding.engine.GenerationResult`."""
    proposed = sum(s.proposed for s in res.sources.values())
    accepted = sum(s.accepted for s in res.sources.values())
    return {"tokens": len(res.output_ids), "forwards": res.forwards, "tokens_per_forward": res.tokens_per_forward,
            "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else 0.0,
            "seconds": res.seconds, "stop_reason": res.stop_reason,
            "sources": {name: {"proposed": s.proposed, "accepted": s.accepted} for name, s in res.sources.items()},
            "prefix_hit_tokens": res.prefix_hit_tokens, "prefix_disk_tokens": res.prefix_disk_tokens}


class Redraft:
    """A target model with its speculation: corpus and n-gram drafts, the cost-aware policy, exact verification.

    Args:
        model: a transformers causal LM (already loaded, eval mode).
        tokenizer: its tokenizer.
        corpus: a corpus file (text or binary, e.g. written by ``redraft freeze``), a loaded
            :class:`redraft.corpus.Corpus`, or None (n-gram drafts only, unless ``config`` says otherwise).
        config: a :class:`~redraft.compose.SpeculationConfig` (default: ``redraft run``'s defaults);
            ``config_kw`` are its fields for a config built here (``k=8`` for a fixed depth, ``ngram=False``, ...).
        learn: with a corpus file, :meth:`generate` adds each new answer (prompt + answer) to the corpus, in memory
            at once and on disk atomically (its own format, text or binary), so later prompts and later runs replay
            it; a missing file is then created.
        prefix_dir: a corpus directory (as ``redraft serve --corpus-dir``; created if missing) whose prefix KV
            entries start each prompt from the longest prefix an earlier call, process or server on it computed,
            and where this object's entries of at least 128 tokens are written (the default tenant's; up to 4 GiB,
            least recently used removed first). None: no prefix reuse.
    Raises:
        FileNotFoundError: a corpus file that does not exist (without ``learn``).
        redraft.corpus.CorpusError: a malformed corpus, ids outside the model's vocabulary, or (binary) another
            tokenizer's fingerprint unless ``config.force``; a ``prefix_dir`` that cannot be used or was made for
            another tokenizer.
        ValueError: a bad config field (the message names it).
    """

    def __init__(self, model, tokenizer, *, corpus=None, config: SpeculationConfig | None = None,
                 learn: bool = False, prefix_dir: str | os.PathLike | None = None, **config_kw) -> None:
        from redraft.io.loading import LoadedModel

        if config is not None and config_kw:
            raise ValueError(f"Redraft: give either config= or its fields ({', '.join(config_kw)}), not both")
        self.config = config or SpeculationConfig(**config_kw)
        self.loaded = LoadedModel(model, tokenizer, str(getattr(model, "name_or_path", "model")),
                                  Path(str(getattr(model, "name_or_path", "."))))
        self.learn = learn
        self.corpus_path: str | None = None
        self.corpus = self._open(corpus if corpus is not None else self.config.corpus)
        self.policy = (build_policy(model, max_nodes=self.config.policy_nodes) if self.config.policy_on else None)
        self.prefix_cache = self._prefixes(prefix_dir) if prefix_dir is not None else None

    def _prefixes(self, directory):
        from redraft.corpus import tokenizer_fingerprint
        from redraft.corpus.directory import check_meta
        from redraft.server.prefix_cache import open_prefix_cache

        check_meta(directory, self.loaded.vocab_size, tokenizer_fingerprint(self.loaded.tokenizer))
        return open_prefix_cache(self.loaded.model, PREFIX_CACHE_TOKENS, directory, disk_bytes=PREFIX_DISK_BYTES,
                                 background=False)

    @classmethod
    def from_pretrained(cls, model_or_path=None, tokenizer=None, *, corpus=None,
                        config: SpeculationConfig | None = None, dtype: str = "float32", learn: bool = False,
                        prefix_dir: str | os.PathLike | None = None, **config_kw) -> Redraft:
        """A :class:`Redraft` from a model directory or ``.gguf`` file (None = the bundled SmolLM2-135M-Instruct,
        :func:`redraft.io.loading.load_model`), or from an already loaded transformers model and its tokenizer.

        Raises:
            redraft.io.loading.ModelLoadError: the model cannot be loaded.
            ValueError: a loaded model without its tokenizer.
        """
        if model_or_path is None or isinstance(model_or_path, (str, os.PathLike)):
            from redraft.io.loading import load_model

            loaded = load_model(model_or_path, dtype=dtype, quiet=True)
            model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        else:
            model = model_or_path
            if tokenizer is None:
                raise ValueError("Redraft.from_pretrained: a loaded model needs its tokenizer (tokenizer=...)")
        return cls(model, tokenizer, corpus=corpus, config=config, learn=learn, prefix_dir=prefix_dir, **config_kw)

    def _open(self, corpus):
        from redraft.corpus import Corpus, load_corpus, tokenizer_fingerprint

        if corpus is None or isinstance(corpus, Corpus):
            return corpus
        path = os.fspath(corpus)
        self.corpus_path = path
        fingerprint = tokenizer_fingerprint(self.loaded.tokenizer)
        if not os.path.exists(path):
            if not self.learn:
                raise FileNotFoundError(f"corpus {path}: no such file")
            return Corpus.from_spans([], vocab_size=self.loaded.vocab_size, fingerprint=fingerprint)
        return load_corpus(path, vocab_size=self.loaded.vocab_size, fingerprint=fingerprint,
                           force=self.config.force)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def model(self):
        return self.loaded.model

    def engine(self):
        """A fresh :class:`~redraft.decoding.engine.Engine` on this model, corpus and (shared) policy."""
        return build_engine(self.loaded.model, self.config, eos_token_ids=sorted(self.loaded.eos_token_ids),
                            corpus=self.corpus, policy=self.policy)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: text or chat messages (the chat template when the tokenizer has one, unless
        ``chat=False``), or token ids as they are."""
        from redraft.io.prompts import encode_prompt

        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        return encode_prompt(self.loaded.tokenizer, prompt, chat=chat)

    def generate(self, prompt, max_new_tokens: int = 128, *, chat: bool | None = None, sampling=None,
                 stop: list[str] | None = None, on_tokens=None):
        """Answer one prompt (a :class:`Generation`) or a list of prompts (a list of them, in order).

        Args:
            prompt: text, chat messages (a list of ``{"role", "content"}`` dicts), token ids, or a list of texts.
            max_new_tokens: exact cap on generated tokens.
            chat: force the chat template on/off (None: on when the tokenizer has one).
            sampling: a :class:`redraft.decoding.sampling.SamplingParams` (default greedy).
            stop: stop strings; the text ends before the first one.
            on_tokens: called with each step's newly emitted ids (streaming: the first token is then awaited, so
                the prompt's forward carries only a likely-right draft).
        Raises:
            ValueError: an empty prompt, one that fills the model's context, or max_new_tokens < 1.
        """
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.generate(p, max_new_tokens, chat=chat, sampling=sampling, stop=stop, on_tokens=on_tokens)
                    for p in prompt]
        from redraft.decoding.stopping import StopStrings

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: expected an integer >= 1")
        ids = self.encode(prompt, chat)
        if not ids:
            raise ValueError("prompt: encodes to no tokens")
        stops = StopStrings(self.loaded.tokenizer, stop or [])
        from redraft.server.prefix_cache import generate_cached
        from redraft.server.tenants import DEFAULT_TENANT

        res = generate_cached(self.engine(), self.prefix_cache, DEFAULT_TENANT, ids, max_new_tokens,
                              on_tokens=on_tokens, sampling=sampling, stop=stops if stops else None,
                              streaming=on_tokens is not None)
        text = (stops.text if res.stop_reason == "stop" else
                self.loaded.tokenizer.decode(res.output_ids, skip_special_tokens=True))
        if self.learn and self.corpus is not None and res.output_ids:
            self.add_answer(ids, res.output_ids)
        return Generation(prompt=prompt, prompt_ids=ids, ids=list(res.output_ids), text=text, stats=stats_of(res),
                          result=res)

    def add_answer(self, prompt_ids: list[int], output_ids: list[int]) -> bool:
        """:func:`add_answer` to this corpus (and its file). Returns whether it was added."""
        return add_answer(self.corpus, prompt_ids, output_ids, self.corpus_path)


def add_answer(corpus, prompt_ids: list[int], output_ids: list[int], path: str | None = None) -> bool:
    """Add prompt + answer to ``corpus`` (a :class:`redraft.corpus.Corpus`; drafters holding it see the span at
    once) unless it already holds prompt + answer (:meth:`~redraft.corpus.Corpus.holds`: a replay adds nothing); with ``path``, rewrite that file
    atomically in its format (a new file: text for ``.txt``, else binary). Returns whether it was added.

    Raises:
        redraft.corpus.CorpusError / OSError: the file could not be written (the old file is kept).
    """
    from redraft.corpus.format import sniff

    if not output_ids or corpus.holds(list(prompt_ids) + list(output_ids)):
        return False
    corpus.append(list(prompt_ids) + list(output_ids))
    if path is not None:
        fmt = sniff(path) if os.path.exists(path) else _format_for(path)
        corpus.save(path, fmt=fmt)
    return True


def _format_for(path: str) -> str:
    """A new corpus file's format from its name: text for ``.txt``, binary otherwise."""
    return "text" if path.endswith(".txt") else "binary"
