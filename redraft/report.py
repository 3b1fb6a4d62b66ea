"""End-of-run report lines (formats after Colibri's, so scripts that parse one parse the other)."""

from __future__ import annotations

from redraft.engine import GenerationResult


def speculation_line(res: GenerationResult) -> str:
    """``speculation: X.XX tokens/forward (F forwards per T tokens)``."""
    return f"speculation: {res.tokens_per_forward:.2f} tokens/forward ({res.forwards} forwards per {len(res.output_ids)} tokens)"


def corpus_line(res: GenerationResult, frozen_ids: int) -> str | None:
    """``corpus drafts: NN% acceptance (a/b proposed from N frozen ids)``, or None when the corpus proposed nothing."""
    st = res.sources.get("corpus")
    if st is None or st.proposed == 0:
        return None
    return (f"corpus drafts: {100 * st.acceptance:.0f}% acceptance "
            f"({st.accepted}/{st.proposed} proposed from {frozen_ids} frozen ids)")


def source_lines(res: GenerationResult, skip: tuple[str, ...] = ("corpus",)) -> list[str]:
    """One ``NAME drafts: NN% acceptance (a/b proposed in S steps[, paused N times by its guard])`` line per other
    source that proposed."""
    return [f"{name} drafts: {100 * st.acceptance:.0f}% acceptance ({st.accepted}/{st.proposed} proposed in "
            f"{st.steps} steps{_paused(st.paused)})" for name, st in res.sources.items()
            if name not in skip and st.proposed]


def _paused(n: int) -> str:
    return "" if not n else f", paused {n} time{'s' if n > 1 else ''} by its acceptance guard"


def speed_line(res: GenerationResult) -> str:
    """``speed: X.X tokens/s (T tokens in S.SS s)``."""
    return f"speed: {res.tokens_per_second:.1f} tokens/s ({len(res.output_ids)} tokens in {res.seconds:.2f} s)"


def token_lines(res: GenerationResult) -> list[str]:
    """The ``--tokens`` lines, which ``redraft freeze --from-log`` reads back."""
    p, o = res.prompt_ids, res.output_ids
    return [f"[PROMPT_TOKENS] {len(p)}: {' '.join(map(str, p))}",
            f"[TOKENS] {len(o)} generated: {' '.join(map(str, o))}"]
