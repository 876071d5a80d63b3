"""The plots of ``pkvrt report``, drawn with matplotlib from the same numbers as the tables they
sit beside in report.md (:mod:`report_data`), one panel per experiment (trace, B, G, L), so that
no series mixes batch sizes, group sizes, layer counts or baselines.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _panels(plt, n: int, *, ncols: int = 4, size: tuple[float, float] = (4.6, 3.4)):
    """A figure with ``n`` panels in rows of ``ncols`` (the unused cells removed), laid out by
    matplotlib's constrained layout; returns (figure, list of ``n`` axes)."""
    ncols = min(n, ncols)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    return fig, list(axes.flat[:n])


def _by_experiment(items: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.OrderedDict()
    for it in items:
        out.setdefault(it["experiment"], []).append(it)
    return out


def _bin_x(bin_: tuple[int, int]) -> float:
    """Where a power-of-two context bin sits on a log axis: its geometric middle."""
    return math.sqrt(bin_[0] * bin_[1])


def plot_ratio_vs_context(data: list[dict], path: Path) -> None:
    """The throughput-ratio-by-context table: one panel per experiment, one colour per engine
    (the legend names its baseline), CUDA-event ratio solid, wall ratio dashed."""
    plt = _pyplot()
    groups = _by_experiment(data)
    engines = list(dict.fromkeys(d["engine"] for d in data))
    color = {e: plt.get_cmap("tab10")(i % 10) for i, e in enumerate(engines)}
    fig, axes = _panels(plt, len(groups))
    for ax, (exp, rows) in zip(axes, groups.items()):
        for e in dict.fromkeys(d["engine"] for d in rows):
            pts = [d for d in rows if d["engine"] == e]
            x = [_bin_x(d["bin"]) for d in pts]
            ax.plot(x, [d["cuda_ratio"] for d in pts], marker="o", color=color[e],
                    label=f"{e} vs {pts[0]['baseline']}")
            ax.plot(x, [d["wall_ratio"] for d in pts], marker="x", ls="--", color=color[e])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(exp, fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("Decode-token throughput ratio vs the baseline by longest context, per experiment "
                 "(solid: CUDA events, dashed: wall; steps per point: the table)")
    fig.supxlabel("longest context in the step (tokens, power-of-two bins)")
    fig.supylabel("engine / baseline")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_route_map(cells: list[dict], path: Path) -> None:
    """The route-map table: one panel per experiment, the adaptive engine's route per (active
    rows, context bin) as a coloured square labelled by the wall ratio vs the named baseline."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    groups = _by_experiment(cells)
    routes = list(dict.fromkeys(c["route"] for c in cells))
    color = {r: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(routes)}
    fig, axes = _panels(plt, len(groups))
    for ax, (exp, cs) in zip(axes, groups.items()):
        x, y = [c["active"] for c in cs], [_bin_x(c["bin"]) for c in cs]
        ax.scatter(x, y, s=260, marker="s", color=[color[c["route"]] for c in cs])
        for c, xi, yi in zip(cs, x, y):
            ax.annotate(f"{c['wall_ratio']:.2f}", (xi, yi), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_xlim(0.3, max(x) + 0.7)
        ax.set_xticks(range(1, max(x) + 1))
        ax.set_yscale("log", base=2)
        ax.margins(y=0.15)
        ax.set_title(f"{exp}\nvs {cs[0]['baseline']}", fontsize=8)
    fig.legend(handles=[Line2D([], [], marker="s", ls="", color=color[r], label=r) for r in routes],
               loc="outside right upper", title="route", fontsize=8)
    fig.suptitle("Route of pkvrt-adaptive per (active rows, longest context), per experiment; "
                 "label: wall ratio vs the baseline")
    fig.supxlabel("active rows")
    fig.supylabel("longest context (tokens)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_ratios(pts: list[dict], engine: str, path: Path) -> None:
    """Every measured engine-protocol step of ``engine`` (the steps the engine-protocol table
    counts), one panel per experiment: per-step CUDA ratio vs the named baseline against (active
    rows, total tokens); a step that loses shows red, on one colour scale for all panels."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    ratios = [p["ratio"] for p in pts]
    norm = TwoSlopeNorm(vmin=min(min(ratios), 0.9), vcenter=1.0, vmax=max(max(ratios), 1.1))
    groups = _by_experiment(pts)
    fig, axes = _panels(plt, len(groups))
    rng = np.random.default_rng(0)   # spread the integer row counts a little so points show
    for ax, (exp, ps) in zip(axes, groups.items()):
        sc = ax.scatter([p["active"] + rng.uniform(-0.25, 0.25) for p in ps],
                        [p["tokens"] for p in ps], c=[p["ratio"] for p in ps], cmap="RdYlGn",
                        norm=norm, s=14)
        ax.set_xticks(range(1, max(p["active"] for p in ps) + 1))
        ax.set_yscale("log", base=2)
        ax.set_title(f"{exp} vs {ps[0]['baseline']} ({len(ps)} steps)", fontsize=8)
    fig.colorbar(sc, ax=axes, label="per-step CUDA ratio vs the baseline (>1: faster)")
    fig.suptitle(f"{engine}: engine protocol, every measured step, per experiment")
    fig.supxlabel("active rows in the step")
    fig.supylabel("total tokens in the step (KV read per layer)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
