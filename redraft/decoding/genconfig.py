"""The logits-shaping settings of a model's ``generation_config``, applied the way Hugging Face ``generate`` does.

``model.generate(do_sample=False)`` shapes every step's logits with processors built from the model's
``generation_config`` (``GenerationMixin._get_logits_processor`` in transformers 5.x): repetition penalty, no-repeat
n-grams, bad words, minimum lengths, forced BOS / EOS, suppressed tokens. :class:`LogitsShaping` holds those settings
and :meth:`LogitsShaping.processors` builds transformers' own processor classes from them, in the order
``_get_logits_processor`` appends them, so that redraft's output equals ``generate``'s for the same model.
``sampling.TokenChooser`` calls the list once per verify row with that row's own context (prompt + output so far + a
tree node's ancestors and itself), so drafting stays lossless.

Sampling settings in a ``generation_config`` (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ...) are *not*
applied: redraft decodes greedily unless the caller asks for sampling (``SamplingParams`` / ``--temperature``).
:func:`not_applied` lists them, and the settings redraft does not support, for the start-up line.

torch and transformers are imported inside :meth:`LogitsShaping.processors` only, so the CLI can import this module
while registering its flags.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass


class GenerationConfigError(ValueError):
    """A generation_config field holds a value transformers' processors cannot take; the message names it."""


@dataclass(frozen=True)
class LogitsShaping:
    """Logits-shaping settings (each off by default), in the order Hugging Face applies them.

    Attributes (meaning as in transformers' ``GenerationConfig``):
        sequence_bias: ``((token ids), bias)`` pairs: the bias is added to the last id's logit when the context ends
            with the other ids (``SequenceBiasLogitsProcessor``).
        repetition_penalty: CTRL penalty (Keskar et al. 2019) on every token of the context, > 0 (1.0 = off).
            Values beyond [PENALTY_MIN, PENALTY_MAX] act as those bounds (float32 logits stay finite in float64).
        no_repeat_ngram_size: n > 0 forbids any n-gram that already occurs in the context (0 = off).
        bad_words_ids: id sequences never to generate (``NoBadWordsLogitsProcessor``; a lone EOS is dropped).
        min_length: EOS is forbidden while prompt + output is shorter than this (needs an EOS id).
        min_new_tokens: EOS is forbidden before this many new tokens (needs an EOS id).
        forced_bos_token_id: the token chosen when the context holds a single token.
        forced_eos_token_id: EOS id(s) forced as the last token allowed by ``max_new_tokens``.
        exponential_decay_length_penalty: ``(start, factor)``: the EOS logit grows by ``factor ** (n - start)`` from
            ``start`` new tokens on (needs an EOS id).
        suppress_tokens: ids never generated.
        begin_suppress_tokens: ids not generated as the first new token.
    """

    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] = ()
    exponential_decay_length_penalty: tuple[int, float] | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, generation_config) -> LogitsShaping:
        """The settings of a transformers ``GenerationConfig`` (None -> all off). Unset (None) fields are off.

        Raises:
            GenerationConfigError: a field of the wrong type or range, named in the message.
        """
        if generation_config is None:
            return cls()
        raw = {f.name: getattr(generation_config, f.name, None) for f in dataclasses.fields(cls)}
        return cls(**{name: _convert(name, value) for name, value in raw.items() if value is not None})

    def overridden(self, **values) -> LogitsShaping:
        """These settings with ``values`` (a field name -> value; None = keep this one) replacing the file's."""
        given = {k: _convert(k, v) for k, v in values.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def applied(self) -> dict[str, object]:
        """The settings that are on, field name -> value, in application order."""
        off = LogitsShaping()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(off, f.name)}

    def processors(self, prompt_length: int, max_new_tokens: int | None, eos_token_ids: Iterable[int]):
        """transformers' processors for one generation, in ``GenerationMixin._get_logits_processor``'s order.

        Args:
            prompt_length: prompt tokens (``input_ids_seq_length`` in HF: min_new_tokens, begin_suppress_tokens and
                the length penalty count from there).
            max_new_tokens: the generation's token budget; the forced EOS goes at prompt_length + max_new_tokens - 1,
                HF's ``max_length - 1`` when ``generate(max_new_tokens=N)``. None: no forced EOS.
            eos_token_ids: the ids that end the generation (HF's ``_eos_token_tensor``); without any, the
                EOS-based processors are left out, as HF leaves them out.
        Returns:
            ``LogitsProcessorList``, empty when every setting is off. Called with input_ids LongTensor [R, L] (each
            row a full context of L tokens) and scores FloatTensor [R, V], it returns the shaped scores [R, V].
        """
        from transformers import (
            ExponentialDecayLengthPenalty,
            ForcedBOSTokenLogitsProcessor,
            ForcedEOSTokenLogitsProcessor,
            LogitsProcessorList,
            MinLengthLogitsProcessor,
            MinNewTokensLengthLogitsProcessor,
            NoBadWordsLogitsProcessor,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
            SequenceBiasLogitsProcessor,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
        )

        eos = sorted({int(e) for e in eos_token_ids}) or None
        out = LogitsProcessorList()
        if self.sequence_bias:
            out.append(SequenceBiasLogitsProcessor([[list(ids), bias] for ids, bias in self.sequence_bias]))
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(
                float(min(max(self.repetition_penalty, PENALTY_MIN), PENALTY_MAX))))
        if self.no_repeat_ngram_size > 0:
            out.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if self.bad_words_ids:
            out.append(NoBadWordsLogitsProcessor([list(w) for w in self.bad_words_ids], eos))
        if self.min_length > 0 and eos:
            out.append(MinLengthLogitsProcessor(self.min_length, eos))
        if self.min_new_tokens > 0 and eos:
            out.append(MinNewTokensLengthLogitsProcessor(prompt_length, self.min_new_tokens, eos))
        if self.forced_bos_token_id is not None:
            out.append(ForcedBOSTokenLogitsProcessor(self.forced_bos_token_id))
        if self.forced_eos_token_id and max_new_tokens is not None:
            out.append(ForcedEOSTokenLogitsProcessor(prompt_length + max_new_tokens, list(self.forced_eos_token_id)))
        if self.exponential_decay_length_penalty is not None and eos:
            out.append(ExponentialDecayLengthPenalty(self.exponential_decay_length_penalty, eos, prompt_length))
        if self.suppress_tokens:
            out.append(SuppressTokensLogitsProcessor(self.suppress_tokens))
        if self.begin_suppress_tokens:
            # HF: one later when a 1-token prompt is followed by a forced BOS
            begin = prompt_length + (prompt_length == 1 and self.forced_bos_token_id is not None)
            out.append(SuppressTokensAtBeginLogitsProcessor(self.begin_suppress_tokens, begin))
        return out


PENALTY_MIN, PENALTY_MAX = 1e-250, 1e250  # |float32 logit| < 3.4e38, so l / p and l * p stay below 1e289


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _token_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


def _ids(name: str, value) -> tuple[int, ...]:
    """A tuple of token ids from one id or a list of them; raises GenerationConfigError naming the field."""
    items = [value] if _token_id(value) else value
    if not isinstance(items, (list, tuple)) or not items or not all(_token_id(t) for t in items):
        raise GenerationConfigError(f"generation_config.{name} must be a token id or a non-empty list of token ids, "
                                    f"got {value!r}")
    return tuple(int(t) for t in items)


def _convert(name: str, value):
    """A generation_config value as the LogitsShaping field ``name`` holds it; raises GenerationConfigError."""
    def bad(expected: str):
        return GenerationConfigError(f"generation_config.{name} must be {expected}, got {value!r}")

    if name == "repetition_penalty":
        if not _number(value) or not (math.isfinite(value) and value > 0):
            raise bad("a finite number > 0 (1.0 = off)")
        return float(value)
    if name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad("an integer >= 0 (0 = off)")
        return value
    if name == "forced_bos_token_id":
        if not _token_id(value):
            raise bad("a token id")
        return int(value)
    if name in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        return _ids(name, value)
    if name == "bad_words_ids":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(w, (list, tuple)) for w in value):
            raise bad("a non-empty list of lists of token ids")
        return tuple(_ids(name, w) for w in value)
    if name == "sequence_bias":
        pairs = list(value.items()) if isinstance(value, dict) else value
        if not isinstance(pairs, (list, tuple)) or not pairs or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], (list, tuple)) and _number(p[1])
                for p in pairs):
            raise bad("a non-empty list of [token ids, bias] pairs")
        return tuple((_ids(name, ids), float(b)) for ids, b in pairs)
    if name == "exponential_decay_length_penalty":
        try:
            start, factor = value
        except (TypeError, ValueError):
            raise bad("a (start, factor) pair") from None
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or not _number(factor):
            raise bad("a (start, factor) pair: an integer >= 0 and a number")
        return int(start), float(factor)
    raise KeyError(name)


# generation_config fields redraft reads but does not apply, with the value that means "off" (None is always off)
SAMPLING_FIELDS = {"do_sample": (False,), "temperature": (1.0,), "top_k": (0, 50), "top_p": (1.0,),
                   "min_p": (0.0,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
                   "top_h": ()}
UNSUPPORTED_FIELDS = {"num_beams": (1,), "num_beam_groups": (1,), "diversity_penalty": (0.0,),
                      "penalty_alpha": (), "length_penalty": (1.0,), "guidance_scale": (1.0,), "dola_layers": (),
                      "encoder_repetition_penalty": (1.0,), "encoder_no_repeat_ngram_size": (0,),
                      "watermarking_config": (), "renormalize_logits": (False,), "remove_invalid_values": (False,)}


def not_applied(generation_config) -> tuple[dict[str, object], dict[str, object]]:
    """The generation_config's sampling settings (greedy unless asked) and unsupported settings that are set.

    Returns:
        (sampling, unsupported): field name -> value, each only for values other than None and "off".
    """
    def set_fields(fields: dict) -> dict:
        out = {}
        for name, off in fields.items():
            v = getattr(generation_config, name, None) if generation_config is not None else None
            if v is not None and v not in off:
                out[name] = v
        return out

    return set_fields(SAMPLING_FIELDS), set_fields(UNSUPPORTED_FIELDS)


def describe(generation_config, source: str, replaced: dict[str, str], hint: str | None = None) -> str | None:
    """The start-up line saying what a generation_config changes, or None when it sets nothing redraft reads.

    ``redraft: generation_config: repetition_penalty=1.3, no_repeat_ngram_size=3 (from SOURCE; HINT); replaced by
    flags: ...; not applied: do_sample=True, temperature=0.6 (greedy unless --temperature > 0); not supported: ...``

    Args:
        source: where the settings came from (the file path).
        replaced: field name -> the flag that replaces the file's value (only fields the file sets are named).
        hint: e.g. how to ignore the file; None = no hint.
    Raises:
        GenerationConfigError: a value the processors cannot take.
    """
    settings = LogitsShaping.of(generation_config).applied()
    sampling, unsupported = not_applied(generation_config)
    if not (settings or sampling or unsupported):
        return None
    applied = {k: v for k, v in settings.items() if k not in replaced}
    line = (f"redraft: generation_config: {format_settings(applied) or 'no logits setting applied'} "
            f"(from {source}{'; ' + hint if hint else ''})")
    overridden = [f"{name} ({flag})" for name, flag in replaced.items() if name in settings]
    if overridden:
        line += "; replaced by flags: " + ", ".join(overridden)
    if sampling:
        line += f"; not applied: {format_settings(sampling)} (greedy unless --temperature > 0)"
    if unsupported:
        line += f"; not supported: {format_settings(unsupported)}"
    return line


def format_settings(settings: dict[str, object]) -> str:
    """``name=value, ...`` with tuples written as lists (as in generation_config.json)."""
    def show(v):
        if isinstance(v, tuple):
            return "[" + ", ".join(show(x) for x in v) + "]"
        return f"{v:g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k}={show(v)}" for k, v in settings.items())
