"""The bench's plots fit their figures: every title and legend lies inside the figure, whatever the model's name,
the workloads' names or the number of methods (a long model name once ran the speedup plot's title past both
edges), and neighbouring panels' titles do not overlap."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from redraft.bench import report

MODEL = "SmolLM2-135M-Instruct.Q4_1 (default) quantized by a very long-named pipeline step"
WORKLOADS = ["replay of the frozen spec-bench questions", "novel questions never frozen into any corpus", "copy"]
METHODS = ["plain", "policy", "corpus K=8", "corpus K=32 tree", "n-gram only", "hf-pld", "hf-assisted"]


def run(method: str, qid: int) -> dict:
    drafting = method not in ("plain", "hf-pld", "hf-assisted")
    return {"method": method, "question_id": qid, "sources": {"corpus": {}} if drafting else {},
            "accepted_per_forward": [0, 3, 7, 1, 0, 8], "draft_depth_per_forward": [0, 8, 8, 2, 0, 8]}


def results() -> dict:
    summary = {m: {"speedup": 1.0 + i / 2, "all_identical": i % 3 != 0} for i, m in enumerate(METHODS)}
    return {"model": {"name": MODEL}, "methods": METHODS, "config": {"k": 8},
            "cost_curves": {"policy": {"sizes": [1, 2, 4, 8], "costs": [1.0, 1.2, 1.5, 1.8]}},
            "workloads": {w: {"summary": summary, "runs": [run(m, q) for m in METHODS for q in (1, 2)]}
                          for w in WORKLOADS}}


COST = {"model": MODEL, "prefix": 128, "t1_s": 0.031, "max_s": 8,
        "curves": {"chain": {"s": [1, 2, 4, 8], "c": [1.0, 1.2, 1.5, 1.8]},
                   "tree mask": {"s": [1, 2, 4, 8], "c": [1.0, 1.3, 1.6, 2.0]}}}

PLOTS = {
    "speedup": lambda path: report.plot_speedup(results(), path),
    "tokens_per_forward": lambda path: report.plot_tokens_per_forward(results(), path),
    "acceptance_by_position": lambda path: report.plot_acceptance_by_position(results(), path),
    "cost": lambda path: report.plot_cost(COST, path),
    "policy": lambda path: report.plot_policy(results(), "policy", path),
}


@pytest.mark.parametrize("name", list(PLOTS))
def test_titles_and_legends_lie_inside_the_figure(name, tmp_path, monkeypatch):
    saved: list[Figure] = []
    write = Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return write(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    PLOTS[name](tmp_path / f"{name}.png")
    (fig,) = saved
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    canvas = FigureCanvasAgg(fig)  # closed by the plot function: drawn again, laid out as when it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    titles = [ax.title for ax in fig.axes if ax.get_title()]
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    assert titles and (legends or name == "policy")
    for artist in [*titles, *legends]:
        e = artist.get_window_extent(renderer)
        what = artist.get_text() if hasattr(artist, "get_text") else "legend"
        assert box.x0 - 0.5 <= e.x0 and e.x1 <= box.x1 + 0.5, (what, e, box)
        assert box.y0 - 0.5 <= e.y0 and e.y1 <= box.y1 + 0.5, (what, e, box)
    spans = sorted((t.get_window_extent(renderer).x0, t.get_window_extent(renderer).x1) for t in titles)
    for (_, right), (left, _) in zip(spans, spans[1:], strict=False):
        assert right <= left, spans  # neighbouring titles do not overlap
    for ax in fig.axes:  # the legend covers no panel
        for legend in fig.legends:
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
