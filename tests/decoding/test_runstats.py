"""redraft.decoding.runstats: one summary over several generations, and the report lines built from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from redraft.decoding.engine import GenerationResult, SourceStats
from redraft.decoding.runstats import RunSummary, corpus_line, run_report, source_lines, speculation_line, speed_line


def gen(tokens: int, forwards: int, seconds: float, **sources) -> GenerationResult:
    return GenerationResult(prompt_ids=[1, 2], output_ids=list(range(tokens)), forwards=forwards, seconds=seconds,
                            sources={k: SourceStats(*v) for k, v in sources.items()})


def test_totals_over_several_generations():
    a = gen(10, 4, 0.5, corpus=(8, 6, 1, 0), ngram=(4, 1, 2, 1))
    b = gen(6, 6, 1.5, ngram=(2, 0, 1, 0))
    s = RunSummary.of([a, b])
    assert (s.runs, s.tokens, s.forwards, s.seconds) == (2, 16, 10, 2.0)
    assert s.tokens_per_forward == pytest.approx(1.6) and s.tokens_per_second == pytest.approx(8.0)
    assert (s.proposed, s.accepted) == (14, 7) and s.acceptance == pytest.approx(0.5)
    assert (s.source("ngram").proposed, s.source("ngram").accepted, s.source("ngram").steps,
            s.source("ngram").paused) == (6, 1, 3, 1)
    assert s.source("glide").proposed == 0 and s.source("glide").acceptance == 0.0


def test_runtime_without_forward_counts_and_dict_sources():
    rec = SimpleNamespace(output_ids=[1, 2, 3], forwards=None, seconds=1.0, sources={})
    s = RunSummary.of([gen(4, 2, 1.0), rec])
    assert s.forwards is None and s.tokens_per_forward is None and s.tokens == 7
    s = RunSummary().add_counts(5, 5, 0.0, {"corpus": {"proposed": 3, "accepted": 2}})
    assert s.source("corpus").acceptance == pytest.approx(2 / 3) and s.tokens_per_second == 0.0


def test_lines_read_the_same_figures_from_a_result_or_a_summary():
    a = gen(10, 4, 0.5, corpus=(8, 6, 1, 0), ngram=(4, 1, 2, 3))
    assert speculation_line(a) == "speculation: 2.50 tokens/forward (4 forwards per 10 tokens)"
    assert corpus_line(a, 100) == "corpus drafts: 75% acceptance (6/8 proposed from 100 frozen ids)"
    assert source_lines(a) == ["ngram drafts: 25% acceptance (1/4 proposed in 2 steps, paused 3 times by its "
                               "acceptance guard)"]
    assert speed_line(a) == "speed: 20.0 tokens/s (10 tokens in 0.50 s)"
    s = RunSummary.of([a, a])
    assert speculation_line(s) == "speculation: 2.50 tokens/forward (8 forwards per 20 tokens)"
    assert corpus_line(gen(3, 3, 1.0), 100) is None


def test_run_report_order_and_token_lines():
    a = gen(3, 2, 1.0, corpus=(2, 2, 1, 0))
    lines = run_report(a, frozen_ids=9, tokens=True)
    assert [line.split(":")[0] for line in lines] == ["speculation", "corpus drafts", "speed", "[PROMPT_TOKENS] 2",
                                                      "[TOKENS] 3 generated"]
    assert run_report(a) == [speculation_line(a), speed_line(a)]  # no corpus open: no corpus line


def test_source_stats_serialise_once_and_read_back():
    """SourceStats.to_dict is the one serialised form (bench results, the server's statistics); add() reads it."""
    from redraft.decoding.runstats import SourceStats

    st = SourceStats(proposed=7, accepted=3, steps=2, paused=1)
    d = st.to_dict(digits=2)
    assert d == {"proposed": 7, "accepted": 3, "steps": 2, "paused": 1, "acceptance": 0.43}
    back = SourceStats()
    back.add(d)
    assert back == st
    assert SourceStats().to_dict()["acceptance"] is None  # nothing proposed: no rate, not 0%
