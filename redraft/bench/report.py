"""Benchmark summaries, the Markdown report and the PNG plots (matplotlib, Agg backend).

Every summary figure is computed from the raw per-question runs stored next to it in the JSON, so anyone can
recompute it: speedup = median over questions of a method's tok/s divided by the median of plain greedy's tok/s
over the same questions in the same run.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path

from redraft.decoding.runstats import RunSummary
from redraft.io.atomic import atomic_path

BASELINE = "plain"


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _totals(rows) -> RunSummary:
    run = RunSummary()
    for r in rows:
        run.add_counts(r["tokens"], r["forwards"], r["seconds"], r.get("sources"))
    return run


def summarize(runs: list[dict], methods: Sequence[str], exact_expected: dict[str, bool] | None = None,
              baseline: str = BASELINE) -> dict:
    """Per-method figures for one workload from its runs (one dict per question x method).

    Keys per method: questions, tokens, seconds, tok_s_median, tok_s_aggregate, speedup (ratio of medians),
    speedup_paired (median of per-question ratios), speedup_aggregate (ratio of total tokens / total seconds),
    forwards, tokens_per_forward, proposed, accepted, acceptance, sources {name: {proposed, accepted,
    acceptance}}, rss_peak_mb, identical (count), mismatches (question ids), all_identical, exact_expected;
    with the replay ceiling timed (:mod:`redraft.bench.ceiling`): of_ceiling_median and of_ceiling_min over the
    questions (ceiling seconds / generation seconds: 1.0 = as fast as one forward over prompt + answer); over
    rounds also of_ceiling_fastest_median and _min (the fastest ceiling over the fastest round's seconds).
    """
    exact_expected = exact_expected or {}
    by: dict[str, list[dict]] = {m: [r for r in runs if r["method"] == m] for m in methods}
    base = {r["question_id"]: r for r in by.get(baseline, [])}
    base_med = _median([r["tok_s"] for r in base.values()])
    base_agg = _totals(base.values()).tokens_per_second
    out: dict[str, dict] = {}
    for m, rs in by.items():
        if not rs:
            continue
        run = _totals(rs)
        tok, sec, fwd = run.tokens, run.seconds, run.forwards
        med = _median([r["tok_s"] for r in rs])
        agg = run.tokens_per_second
        ratios = [r["tok_s"] / base[r["question_id"]]["tok_s"] for r in rs
                  if r["question_id"] in base and base[r["question_id"]]["tok_s"] > 0]
        sources = {s: st.to_dict() for s, st in run.sources.items()}
        prop, acc = run.proposed, run.accepted
        mism = [r["question_id"] for r in rs if not r["identical"]]
        ceil = [r["of_ceiling"] for r in rs if r.get("of_ceiling") is not None]
        fastest = [r["of_ceiling_fastest"] for r in rs if r.get("of_ceiling_fastest") is not None]
        out[m] = {
            "questions": len(rs), "tokens": tok, "seconds": sec,
            "tok_s_median": med, "tok_s_aggregate": agg,
            "speedup": med / base_med if base_med else None,
            "speedup_paired": _median(ratios) if ratios else None,
            "speedup_aggregate": agg / base_agg if base_agg else None,
            "forwards": fwd, "tokens_per_forward": run.tokens_per_forward if fwd else None,
            "proposed": prop, "accepted": acc, "acceptance": run.acceptance if prop else None,
            "sources": sources,
            "rss_peak_mb": max((r["rss_peak_mb"] for r in rs if r.get("rss_peak_mb") is not None), default=None),
            "identical": len(rs) - len(mism), "mismatches": mism, "all_identical": not mism,
            "exact_expected": exact_expected.get(m, True),
            "of_ceiling_median": _median(ceil) if ceil else None, "of_ceiling_min": min(ceil) if ceil else None,
            "of_ceiling_fastest_median": _median(fastest) if fastest else None,
            "of_ceiling_fastest_min": min(fastest) if fastest else None,
        }
    return out


def differing(results: dict) -> list[dict]:
    """Every (workload, method) whose outputs differ from plain greedy: [{workload, method, mismatches, expected}]."""
    out = []
    for w, wr in results["workloads"].items():
        for m, s in wr["summary"].items():
            if not s["all_identical"]:
                out.append({"workload": w, "method": m, "mismatches": s["mismatches"],
                            "expected": not s["exact_expected"]})
    return out


# ---- Markdown -----------------------------------------------------------------------------------------------------
def _f(x, fmt: str, none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def same_cell(s: dict) -> str:
    n = s["questions"]
    if s["all_identical"]:
        return f"yes ({n}/{n})"
    tag = "differs, expected" if not s["exact_expected"] else "**DIFFERS**"
    return f"{tag} ({s['identical']}/{n})"


def markdown(results: dict) -> str:
    """The results page: settings, a speedup matrix and one table per workload."""
    cfg = results["config"]
    methods = list(results["methods"])
    wls = list(results["workloads"])
    lines = ["# redraft bench results", "",
             f"- command: `{results['command']}`",
             f"- model: {results['model'].get('name')} ({results['model'].get('dtype', '?')}), "
             f"ngen {cfg['ngen']}, K {cfg['k']}, tree {cfg['tree_branches']} branches / budget {cfg['tree_budget']}",
             f"- machine: {results['machine'].get('summary', '')}",
             f"- corpus: {results['corpus']['spans']} frozen answers ({results['corpus']['ids']} ids), "
             f"questions {', '.join(map(str, results['corpus']['question_ids']))}",
             "- methods run interleaved per question (rotated start), speedup = median tok/s / median plain "
             "tok/s over the same questions in this run", ""]
    if cfg.get("rounds", 1) > 1:
        changed = "; ".join(f"{d['workload']} / `{d['method']}`: questions {', '.join(map(str, d['questions']))}"
                            for d in results.get("rounds_differing", [])) or "none"
        lines[-1:-1] = [f"- {cfg['rounds']} rounds: a question's seconds are the median over rounds (each round's in "
                        f"`round_seconds`), its ceiling the fastest; forwards or outputs changed between rounds: "
                        f"{changed}"]
    for m, c in results.get("cost_curves", {}).items():
        lines.append(f"- `{m}` decided with the cost curve c(n) (verify time of n draft tokens / a plain step): "
                     + ", ".join(f"c({n}) {v:.2f}" for n, v in zip(c["sizes"], c["costs"], strict=True)))
    if results.get("cost_curves"):
        lines.append("")
    if results.get("skipped_methods"):
        for m, why in results["skipped_methods"].items():
            lines.append(f"- skipped `{m}`: {why}")
        lines.append("")
    flags = differing(results)
    if flags:
        lines.append("**Outputs that differ from plain greedy:**")
        for f in flags:
            why = " (expected: different runtime arithmetic)" if f["expected"] else ""
            lines.append(f"- {f['workload']} / `{f['method']}`: questions {', '.join(map(str, f['mismatches']))}"
                         f"{why}")
        lines.append("")
    lines += ["## Speedup over plain greedy", "",
              "| method | " + " | ".join(wls) + " |", "| --- |" + " ---: |" * len(wls)]
    for m in methods:
        cells = []
        for w in wls:
            s = results["workloads"][w]["summary"].get(m)
            if s is None:
                cells.append("–")
                continue
            mark = "" if s["all_identical"] else (" ≠" if not s["exact_expected"] else " **≠**")
            cells.append(f"{_f(s['speedup'], '.2f')}x{mark}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for w in wls:
        wr = results["workloads"][w]
        lines += [f"## {w}: {wr['description']}", "",
                  f"{len(wr['questions'])} questions: "
                  + ", ".join(f"{q['question_id']} ({q['category']}, {q['prompt_tokens']} prompt ids)"
                              for q in wr["questions"]), "",
                  "| method | tok/s (median) | speedup | paired | tokens/forward | forwards | acceptance by source "
                  "| peak RSS MB | same as greedy | of ceiling (median / min) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
        for m, s in wr["summary"].items():
            acc = ", ".join(f"{src} {_pct(d['acceptance'])} ({d['accepted']}/{d['proposed']})"
                            for src, d in s["sources"].items()) or "–"
            lines.append(f"| {m} | {s['tok_s_median']:.1f} | {_f(s['speedup'], '.2f')}x | "
                         f"{_f(s['speedup_paired'], '.2f')}x | {_f(s['tokens_per_forward'], '.2f')} | "
                         f"{_f(s['forwards'], 'd')} | {acc} | {_f(s['rss_peak_mb'], '.0f')} | {same_cell(s)} | "
                         f"{ceiling_cell(s)} |")
        lines.append("")
    if any(s.get("of_ceiling_median") is not None for wr in results["workloads"].values()
           for s in wr["summary"].values()):
        lines += ["of ceiling: the time of one forward over prompt + plain greedy's answer (the prefill-bound limit "
                  "of any lossless replay, timed right after each question's methods) over the method's generation "
                  "time; 1.00 = at the ceiling. Over several rounds the ceiling is the fastest round's and the "
                  "generation time the median's; in brackets both the fastest round's.", ""]
    return "\n".join(lines)


def ceiling_cell(s: dict) -> str:
    """'0.91 / 0.85' (median / worst question's share of the replay ceiling), over rounds with the fastest rounds'
    figures in brackets ('0.84 / 0.74 (0.97 / 0.83)'), or '–' when not timed."""
    if s.get("of_ceiling_median") is None:
        return "–"
    cell = f"{s['of_ceiling_median']:.2f} / {s['of_ceiling_min']:.2f}"
    if s.get("of_ceiling_fastest_median") is not None:
        cell += f" ({s['of_ceiling_fastest_median']:.2f} / {s['of_ceiling_fastest_min']:.2f})"
    return cell


def text_table(results: dict) -> str:
    """A compact plain-text summary for the terminal."""
    lines = []
    for w, wr in results["workloads"].items():
        rounds = results["config"].get("rounds", 1)
        lines.append(f"{w} ({len(wr['questions'])} questions, ngen {results['config']['ngen']}"
                     + (f", each question's median of {rounds} rounds)" if rounds > 1 else ")"))
        head = (f"  {'method':<14} {'tok/s':>7} {'speedup':>8} {'tok/fwd':>8} {'fwd':>6} {'accept':>7} "
                f"{'of ceiling':>12}  same")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for m, s in wr["summary"].items():
            acc = "" if s["acceptance"] is None else f"{100 * s['acceptance']:.0f}%"
            lines.append(f"  {m:<14} {s['tok_s_median']:>7.1f} {_f(s['speedup'], '.2f'):>7}x "
                         f"{_f(s['tokens_per_forward'], '.2f'):>8} {_f(s['forwards'], 'd'):>6} {acc:>7} "
                         f"{ceiling_cell(s):>12}  {same_cell(s).replace('**', '')}")
        lines.append("")
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, legend_from=None) -> None:
    """Fit ``fig`` inside its canvas and write it to ``path`` (atomically), then close it.

    The figure is laid out by matplotlib's constrained layout (created with ``layout="constrained"``), which keeps
    every title, label and legend inside the figure; a title too wide for its place is wrapped
    (:func:`_wrap_titles`). The legend of ``legend_from`` (an axes), if any, goes below the panels, centred,
    where it covers no data and constrained layout makes room for it.
    """
    if legend_from is not None:
        handles, labels = legend_from.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 4), fontsize=7,
                       frameon=False)
    _wrap_titles(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def _wrap_titles(fig, margin: float = 3.0) -> None:
    """Wrap panel titles (at spaces, textwrap) until each lies inside the figure, ``margin`` pixels from its edges,
    clear of its neighbour's (the panels are one row, left to right). Measured on the laid-out figure: a title is
    centred on its panel, which constrained layout places, and a title wider than its room gets ~15% narrower per
    round."""
    titles = [ax.title for ax in fig.axes if ax.get_title()]
    lines = [t.get_text().split("\n") for t in titles]  # the lines as written: each is wrapped on its own
    for _ in range(12):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in titles]
        crowded = set()
        for i, b in enumerate(boxes):
            if b.x0 < fig.bbox.x0 + margin or b.x1 > fig.bbox.x1 - margin:
                crowded.add(i)
            if i + 1 < len(boxes) and b.x1 > boxes[i + 1].x0 - margin:
                crowded |= {i, i + 1}
        if not crowded:
            return
        for i in crowded:
            chars = max(8, int(0.85 * max(len(line) for line in titles[i].get_text().split("\n"))))
            titles[i].set_text("\n".join(textwrap.fill(line, chars, break_on_hyphens=False) for line in lines[i]))


def plot_speedup(results: dict, path: Path) -> None:
    """Grouped bars: speedup over plain greedy per workload (groups) and method (bars); hatched = output differs."""
    plt = _plt()
    wls = list(results["workloads"])
    methods = [m for m in results["methods"] if m != BASELINE]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(wls) + 2), 3.4), dpi=80, layout="constrained")
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10")
    for j, m in enumerate(methods):
        xs, ys, hatch = [], [], []
        for i, w in enumerate(wls):
            s = results["workloads"][w]["summary"].get(m)
            if s and s["speedup"] is not None:
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(s["speedup"])
                hatch.append(not s["all_identical"])
        bars = ax.bar(xs, ys, width, label=m, color=cmap(j % 10))
        for b, h in zip(bars, hatch, strict=True):
            if h:
                b.set_hatch("//")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(wls)), [textwrap.fill(w, 18) for w in wls])
    ax.set_ylabel("speedup over plain greedy")
    ax.set_title(f"{results['model'].get('name')}\nratio of median tok/s (hatched: output differs)", fontsize=9)
    _save(plt, fig, path, legend_from=ax)


def _drafting(runs: list[dict], m: str) -> bool:
    """True for a method with draft sources (plain greedy and the peers have none)."""
    return m != BASELINE and any(r.get("sources") for r in runs if r["method"] == m)


def _deepest(results: dict) -> int:
    """The deepest draft any method verified (at least the fixed methods' K): the depth axis of the plots."""
    depths = [d for w in results["workloads"].values() for r in w["runs"]
              for d in (r.get("draft_depth_per_forward") or ())]
    return max([int(results["config"]["k"]), *depths])


def plot_tokens_per_forward(results: dict, path: Path) -> None:
    """Per workload: share of decode forwards emitting t tokens (accepted + 1), one step line per drafting method."""
    plt = _plt()
    wls = list(results["workloads"])
    top = _deepest(results) + 1
    fig, axes = plt.subplots(1, len(wls), figsize=(3.0 * len(wls) + 0.5, 2.8), dpi=80, squeeze=False,
                             layout="constrained")
    for ax, w in zip(axes[0], wls, strict=True):
        runs = results["workloads"][w]["runs"]
        for m in results["methods"]:
            if not _drafting(runs, m):
                continue
            acc = [a for r in runs if r["method"] == m and r.get("accepted_per_forward") for a in
                   r["accepted_per_forward"][1:]]  # [0] is the prefill forward
            if not acc:
                continue
            counts = [0] * (top + 1)
            for a in acc:
                counts[min(a + 1, top)] += 1
            ax.plot(range(1, top + 1), [c / len(acc) for c in counts[1:]], drawstyle="steps-mid", label=m)
        ax.set_ylim(0, 1)
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("tokens per forward")
    axes[0][0].set_ylabel("share of forwards")
    _save(plt, fig, path, legend_from=axes[0][-1])


def acceptance_by_position(accepted_per_forward: Sequence[Sequence[int]], depth: int,
                           draft_depths: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Acceptance at draft position d = 1..depth.

    With the per-forward draft depths: accepted >= d among forwards whose draft reached position d (the
    probability that the d-th drafted token is accepted, given it was drafted). Without them: the share of all
    decode forwards (prefill excluded, drafted or not) that accepted at least d draft tokens.
    """
    if draft_depths is not None:
        pairs = [(a, dd) for apf, dds in zip(accepted_per_forward, draft_depths, strict=True)
                 for a, dd in zip(apf, dds, strict=True)]
        out = []
        for d in range(1, depth + 1):
            n = sum(dd >= d for _, dd in pairs)
            out.append(sum(a >= d for a, dd in pairs if dd >= d) / n if n else float("nan"))
        return out
    acc = [a for apf in accepted_per_forward for a in apf[1:]]
    if not acc:
        return [0.0] * depth
    return [sum(a >= d for a in acc) / len(acc) for d in range(1, depth + 1)]


def plot_acceptance_by_position(results: dict, path: Path) -> None:
    """Per workload: acceptance of the d-th drafted token, d = 1..K, per drafting method (see
    :func:`acceptance_by_position`)."""
    plt = _plt()
    wls = list(results["workloads"])
    depth = max(_deepest(results), 1)
    conditional = True
    fig, axes = plt.subplots(1, len(wls), figsize=(3.0 * len(wls) + 0.5, 2.8), dpi=80, squeeze=False,
                             layout="constrained")
    for ax, w in zip(axes[0], wls, strict=True):
        runs = results["workloads"][w]["runs"]
        for m in results["methods"]:
            rs = [r for r in runs if r["method"] == m and r.get("accepted_per_forward")]
            if not rs or not _drafting(runs, m):
                continue
            apf = [r["accepted_per_forward"] for r in rs]
            dds = [r.get("draft_depth_per_forward") for r in rs]
            if any(d is None for d in dds):
                dds, conditional = None, False
            ax.plot(range(1, depth + 1), acceptance_by_position(apf, depth, dds), marker=".", ms=3, label=m)
        ax.set_ylim(0, 1.02)
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("draft position d")
    axes[0][0].set_ylabel("P(d-th draft token accepted)" if conditional else "forwards accepting ≥ d")
    _save(plt, fig, path, legend_from=axes[0][-1])


def plot_cost(cost: dict, path: Path) -> None:
    """The verify cost curve c(S) = time(S) / time(1)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80, layout="constrained")
    top = 2.0
    for name, curve in cost["curves"].items():
        ax.plot(curve["s"], curve["c"], marker=".", ms=3, label=name)
        top = max(top, max(curve["c"]) * 1.15)
    ax.plot([1, cost["max_s"]], [1, cost["max_s"]], color="0.7", lw=0.8, ls=":", label="c(S) = S")
    ax.set_ylim(0, top)
    ax.set_xlabel("tokens in the forward (S)")
    ax.set_ylabel("c(S) = time(S) / time(1)")
    ax.set_title(f"{cost['model']}\nafter a {cost['prefix']}-token prefix, t(1) = "
                 f"{1000 * cost['t1_s']:.1f} ms", fontsize=9)
    _save(plt, fig, path, legend_from=ax)


def plot_policy(results: dict, method: str, path: Path) -> None:
    """The cost-aware policy's inputs and choices: the cost curve it measured (left) and the draft depth it
    verified at each forward of every question (one dot per forward, 0 = a plain step), against the output position
    (right, one panel per workload, one colour per question)."""
    plt = _plt()
    wls = list(results["workloads"])
    curve = results["cost_curves"][method]
    fig, axes = plt.subplots(1, len(wls) + 1, figsize=(3.0 * (len(wls) + 1) + 0.5, 2.8), dpi=80, squeeze=False,
                             layout="constrained")
    ax = axes[0][0]
    ax.plot(curve["sizes"], curve["costs"], marker="o", ms=3)
    ax.set_xlabel("draft tokens n")
    ax.set_ylabel("c(n), plain steps")
    ax.set_ylim(0, max(curve["costs"]) * 1.15)
    ax.set_title("cost curve (measured)", fontsize=9)
    for ax, w in zip(axes[0][1:], wls, strict=True):
        for r in results["workloads"][w]["runs"]:
            if r["method"] != method or not r.get("draft_depth_per_forward"):
                continue
            pos = [0]
            for a in r["accepted_per_forward"][:-1]:
                pos.append(pos[-1] + a + 1)
            ax.plot(pos, r["draft_depth_per_forward"], marker=".", ms=4, lw=0.4, alpha=0.7,
                    label=f"q{r['question_id']}")
        ax.set_ylim(-1, _deepest(results) + 2)
        ax.set_title(f"{w}: depth chosen", fontsize=9)
        ax.set_xlabel("output position (tokens)")
    axes[0][1].set_ylabel("draft depth verified")
    _save(plt, fig, path)


def write_plots(results: dict, out: Path) -> list[Path]:
    """speedup.png, tokens_per_forward.png, acceptance_by_position.png under ``out``, and policy_<method>.png for
    each method driven by the cost-aware policy."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "speedup.png", out / "tokens_per_forward.png", out / "acceptance_by_position.png"]
    plot_speedup(results, paths[0])
    plot_tokens_per_forward(results, paths[1])
    plot_acceptance_by_position(results, paths[2])
    for method in results.get("cost_curves", {}):
        paths.append(out / f"policy_{method}.png")
        plot_policy(results, method, paths[-1])
    return paths
