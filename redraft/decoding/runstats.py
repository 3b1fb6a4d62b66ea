"""Run statistics: one summary of one or more generations, and the end-of-run report lines.

:class:`RunSummary` is the one place tokens/forward, acceptance per draft source, tokens/s and forward counts are
computed; ``redraft run``, the demo, the oracle, the benchmark harness and ``redraft glide eval`` all read their
figures from it. The report lines keep Colibri's formats, so scripts that parse one parse the other.

A summary adds anything shaped like :class:`redraft.decoding.engine.GenerationResult` (see :class:`Generation`); this module
does not import the engine, so the CLI can load it without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

COUNTS = ("proposed", "accepted", "steps", "paused")


class Generation(Protocol):
    """What a summary reads from one generation (``GenerationResult``, or a benchmark's ``RunRecord``).

    ``forwards`` is None where a runtime does not count them; ``sources`` maps a draft source's name to its counts
    (``proposed``, ``accepted``, ``steps``, ``paused``; attributes or dict keys, missing ones count 0).
    """

    output_ids: Sequence[int]
    forwards: int | None
    seconds: float
    sources: Mapping[str, Any]


@dataclass
class SourceStats:
    """One draft source's counts, over one generation (the engine's) or summed over several (:class:`RunSummary`).

    Attributes:
        proposed: draft tokens (tree nodes) this source put in verify forwards, except nodes deeper than what a
            cut-short forward emitted (EOS, stop string, token limit, exact mode's near-tie): the output never
            reached them, so they were not judged.
        accepted: its draft tokens that were emitted (accepted <= emitted tokens, per forward and in total).
        steps: forwards in which it proposed at least one counted token.
        paused: times its acceptance guard paused it.
    """

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    paused: int = 0

    @property
    def acceptance(self) -> float:
        """accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self, digits: int | None = None) -> dict[str, int | float | None]:
        """The one serialised form (JSON results, the server's statistics field): the counts plus ``acceptance``,
        None when nothing was proposed; rounded to ``digits`` decimals when given. :meth:`add` reads it back."""
        acc = round(self.acceptance, digits) if digits is not None else self.acceptance
        return {**{key: getattr(self, key) for key in COUNTS}, "acceptance": acc if self.proposed else None}

    def add(self, counts) -> None:
        """Add another source's counts: a SourceStats, anything with those attributes, or a mapping (its
        :meth:`to_dict`); missing counts add 0."""
        for key in COUNTS:
            v = counts.get(key, 0) if isinstance(counts, Mapping) else getattr(counts, key, 0)
            setattr(self, key, getattr(self, key) + int(v or 0))


@dataclass
class RunSummary:
    """Totals over generations: ``runs``, emitted ``tokens``, target ``forwards`` (prefill included; None once a
    run did not count them), wall-clock ``seconds`` and per-source :class:`SourceStats`."""

    runs: int = 0
    tokens: int = 0
    forwards: int | None = 0
    seconds: float = 0.0
    sources: dict[str, SourceStats] = field(default_factory=dict)

    @classmethod
    def of(cls, results: Iterable[Generation]) -> RunSummary:
        """The summary of ``results`` (GenerationResults or anything shaped like :class:`Generation`)."""
        summary = cls()
        for r in results:
            summary.add(r)
        return summary

    def add(self, result: Generation) -> RunSummary:
        """Add one generation; returns self."""
        return self.add_counts(len(result.output_ids), result.forwards, result.seconds, result.sources)

    def add_counts(self, tokens: int, forwards: int | None, seconds: float,
                   sources: Mapping[str, Any] | None = None) -> RunSummary:
        """Add one generation given by its figures (e.g. a row of a benchmark's JSON); returns self."""
        self.runs += 1
        self.tokens += int(tokens)
        self.forwards = None if forwards is None or self.forwards is None else self.forwards + int(forwards)
        self.seconds += float(seconds)
        for name, counts in (sources or {}).items():
            self.sources.setdefault(name, SourceStats()).add(counts)
        return self

    @property
    def tokens_per_forward(self) -> float | None:
        """Emitted tokens per target forward (mean accepted length + 1); 0.0 with no forward, None if uncounted."""
        if self.forwards is None:
            return None
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens per wall-clock second (0.0 for no time)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def proposed(self) -> int:
        """Draft tokens proposed by every source."""
        return sum(s.proposed for s in self.sources.values())

    @property
    def accepted(self) -> int:
        """Draft tokens accepted, every source."""
        return sum(s.accepted for s in self.sources.values())

    @property
    def acceptance(self) -> float:
        """accepted / proposed draft tokens over every source (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def source(self, name: str) -> SourceStats:
        """The totals of one source (zeros when it never ran)."""
        return self.sources.get(name, SourceStats())


def _summary(run: Generation | RunSummary) -> RunSummary:
    return run if isinstance(run, RunSummary) else RunSummary.of([run])


# ---- report lines: each takes a GenerationResult or a RunSummary ---------------------------------------------------

def speculation_line(run: Generation | RunSummary) -> str:
    """``speculation: X.XX tokens/forward (F forwards per T tokens)``."""
    s = _summary(run)
    return f"speculation: {s.tokens_per_forward:.2f} tokens/forward ({s.forwards} forwards per {s.tokens} tokens)"


def corpus_line(run: Generation | RunSummary, frozen_ids: int) -> str | None:
    """``corpus drafts: NN% acceptance (a/b proposed from N frozen ids)``, or None when the corpus proposed nothing."""
    st = _summary(run).source("corpus")
    if st.proposed == 0:
        return None
    return (f"corpus drafts: {100 * st.acceptance:.0f}% acceptance "
            f"({st.accepted}/{st.proposed} proposed from {frozen_ids} frozen ids)")


def source_lines(run: Generation | RunSummary, skip: tuple[str, ...] = ("corpus",)) -> list[str]:
    """One ``NAME drafts: NN% acceptance (a/b proposed in S steps[, paused N times by its guard])`` line per other
    source that proposed."""
    return [f"{name} drafts: {100 * st.acceptance:.0f}% acceptance ({st.accepted}/{st.proposed} proposed in "
            f"{st.steps} step{'s' if st.steps != 1 else ''}{_paused(st.paused)})" for name, st in _summary(run).sources.items()
            if name not in skip and st.proposed]


def _paused(n: int) -> str:
    return "" if not n else f", paused {n} time{'s' if n > 1 else ''} by its acceptance guard"


def speed_line(run: Generation | RunSummary) -> str:
    """``speed: X.X tokens/s (T tokens in S.SS s)``."""
    s = _summary(run)
    return f"speed: {s.tokens_per_second:.1f} tokens/s ({s.tokens} tokens in {s.seconds:.2f} s)"


def token_lines(res) -> list[str]:
    """The ``--tokens`` lines of one GenerationResult, which ``redraft freeze --from-log`` reads back."""
    p, o = res.prompt_ids, res.output_ids
    return [f"[PROMPT_TOKENS] {len(p)}: {' '.join(map(str, p))}",
            f"[TOKENS] {len(o)} generated: {' '.join(map(str, o))}"]


def run_report(res, *, frozen_ids: int | None = None, tokens: bool = False) -> list[str]:
    """The end-of-run report of ``redraft run``: speculation, corpus (when a corpus of ``frozen_ids`` ids was open and
    proposed), other sources, speed, and with ``tokens`` the id lines."""
    s = RunSummary.of([res])
    lines = [speculation_line(s)]
    c = corpus_line(s, frozen_ids) if frozen_ids is not None else None
    if c:
        lines.append(c)
    lines += source_lines(s)
    lines.append(speed_line(s))
    if tokens:
        lines += token_lines(res)
    return lines
