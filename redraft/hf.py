"""redraft inside transformers' own ``generate``: a ``custom_generate`` callable.

transformers 5.x ``model.generate(**inputs, custom_generate=fn, max_new_tokens=N)`` prepares the inputs, the
generation config (``max_length`` = prompt + N), the logits processors and the stopping criteria, then calls
``fn(model, input_ids, logits_processor=..., stopping_criteria=..., generation_config=..., **model_kwargs)`` instead of
its own decoding loop and returns what ``fn`` returns (transformers/generation/utils.py, ``GenerationMixin.generate``).
:func:`custom_generate` gives such a callable that decodes with redraft's engine (corpus and n-gram drafts, the
cost-aware policy, exact verification) and returns what ``generate(do_sample=False)`` returns: a LongTensor
[1, prompt + new tokens] of token ids, identical ids.

    from redraft.hf import custom_generate
    out = model.generate(**inputs, custom_generate=custom_generate(corpus="answers.corpus"), max_new_tokens=64)

Supported: one sequence (batch of 1, no padding), greedy decoding with the generation config's logits settings
(repetition penalty, no-repeat n-grams, minimum lengths, ...; :mod:`redraft.decoding.genconfig`), EOS, the caller's
``stopping_criteria`` (judged after every emitted token, as HF judges them after every step) and ``streamer``
(``put`` per emitted step, ``end`` at the end). Refused with a ValueError naming the setting: a batch > 1, padding,
``do_sample``, beams, several return sequences, ``return_dict_in_generate``, and the caller's own
``logits_processor`` (redraft's verifier cannot apply an arbitrary processor to its draft rows).

transformers does not hand a ``custom_generate`` callable the caller's ``streamer`` nor their raw
``stopping_criteria`` (it merges the latter with its max-length and EOS criteria); both are read from the calling
``generate`` frame.
"""

from __future__ import annotations

import sys
import weakref

from redraft.compose import SpeculationConfig, build_engine, build_policy


class _Stop(Exception):
    """A caller's stopping criterion fired: the output ends with the token just emitted."""


def _generate_frame_locals() -> dict:
    """The local variables of the ``GenerationMixin.generate`` call that invoked us ({} when called directly)."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        if f.f_code.co_name == "generate" and "custom_generate" in f.f_locals:
            return f.f_locals
        f = f.f_back
    return {}


class RedraftGenerate:
    """A ``custom_generate`` callable (see the module doc). Build it with :func:`custom_generate`.

    One policy per model it is used with (it keeps learning across calls); the corpus is opened once, on first use,
    against that model's vocabulary.
    """

    def __init__(self, corpus=None, config: SpeculationConfig | None = None) -> None:
        self.config = config or SpeculationConfig()
        self.corpus_spec = corpus if corpus is not None else self.config.corpus
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (corpus, policy)

    def _for(self, model):
        if model not in self._state:
            corpus = self.corpus_spec
            if corpus is not None and not hasattr(corpus, "propose"):
                from redraft.corpus import load_corpus

                corpus = load_corpus(str(corpus), vocab_size=model.config.vocab_size, force=self.config.force)
            policy = build_policy(model, max_nodes=self.config.policy_nodes) if self.config.policy_on else None
            self._state[model] = (corpus, policy)
        return self._state[model]

    def __call__(self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                 **model_kwargs):
        """Decode ``input_ids`` (LongTensor [1, prompt]) with ``model``; returns LongTensor [1, prompt + new].

        Raises:
            ValueError: a setting redraft cannot reproduce exactly (see the module doc), naming it.
        """
        import torch

        caller = _generate_frame_locals()
        gc = generation_config if generation_config is not None else model.generation_config
        self._check(input_ids, gc, caller, model_kwargs)
        prompt = [int(t) for t in input_ids[0].tolist()]
        max_length = gc.max_length if gc.max_length is not None else len(prompt) + 20
        max_new = max_length - len(prompt)
        if max_new <= 0:
            return input_ids
        eos = gc.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]
        streamer = caller.get("streamer")
        user_criteria = list(caller.get("stopping_criteria") or []) if caller else _own_criteria(stopping_criteria)

        corpus, policy = self._for(model)
        engine = build_engine(model, self.config, eos_token_ids=eos, corpus=corpus, policy=policy,
                              generation_config=gc)
        out: list[int] = []

        def on_tokens(new: list[int]) -> None:
            for i, t in enumerate(new):
                out.append(int(t))
                if user_criteria:
                    seq = torch.tensor([prompt + out], dtype=torch.long, device=input_ids.device)
                    if any(bool(c(seq, None).all()) for c in user_criteria):
                        if streamer is not None:
                            streamer.put(torch.tensor(new[:i + 1]))
                        raise _Stop
            if streamer is not None:
                streamer.put(torch.tensor(new))

        try:
            engine.generate(prompt, max_new, on_tokens)
        except _Stop:
            pass
        if streamer is not None:
            streamer.end()
        new = torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    @staticmethod
    def _check(input_ids, gc, caller: dict, model_kwargs: dict) -> None:
        where = "redraft custom_generate"
        for name, ok, expected in (("do_sample", not gc.do_sample, "False (greedy)"),
                                   ("num_beams", (gc.num_beams or 1) == 1, "1"),
                                   ("num_return_sequences", (gc.num_return_sequences or 1) == 1, "1"),
                                   ("return_dict_in_generate", not gc.return_dict_in_generate, "False")):
            if not ok:
                raise ValueError(f"{where}: {name}={getattr(gc, name)!r} is not supported (expected {expected}); "
                                 f"for sampling use redraft.Redraft(...).generate(sampling=...)")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"{where}: input_ids of shape {tuple(input_ids.shape)}: one sequence (batch of 1) is "
                             f"drafted at a time; call generate once per prompt")
        if input_ids.shape[1] == 0:
            raise ValueError(f"{where}: input_ids is empty (inputs_embeds are not supported): give token ids")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool((mask == 1).all()):
            raise ValueError(f"{where}: attention_mask has padding: give one unpadded prompt")
        if caller.get("logits_processor"):
            raise ValueError(f"{where}: logits_processor is not supported (redraft applies the generation config's "
                             f"logits settings itself); put them in the generation config or leave them out")


def _own_criteria(stopping_criteria) -> list:
    """Criteria of a prepared list that are not transformers' max-length / EOS ones (which redraft applies itself)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    return [c for c in (stopping_criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]


def custom_generate(corpus=None, config: SpeculationConfig | None = None, **config_kw) -> RedraftGenerate:
    """A callable for ``model.generate(..., custom_generate=...)`` that drafts from ``corpus`` (a file, a loaded
    :class:`redraft.corpus.Corpus`, or None for n-gram drafts only) with ``config`` (default: ``redraft run``'s
    speculation; ``config_kw`` are :class:`~redraft.compose.SpeculationConfig` fields). See the module doc.

    Raises:
        ValueError: both ``config`` and its fields given, or a bad field.
    """
    if config is not None and config_kw:
        raise ValueError(f"custom_generate: give either config= or its fields ({', '.join(config_kw)}), not both")
    return RedraftGenerate(corpus, config or SpeculationConfig(**config_kw))
