#!/usr/bin/env python3
"""Plot scaling results: throughput against ranks, link rate or sequence length, from the
JSONL rows of the sweeps (examples/reproduce/*.py, source "measured"), of the simulator
(tools/simulate_scaling.py, "simulated") and the papers' points ("paper"), overlaid.
One subplot per experiment; one PNG.

    python tools/plot_scaling.py examples/reproduce/results/zeropp_bandwidth.jsonl --y tokens_per_s -o z.png

A row: {experiment, system, ranks, link_gbps, seq_length, step_time_s, tokens_per_s,
tflops_per_gpu, source}; null values are skipped. The x axis defaults, per experiment, to
the one of ranks / link_gbps / seq_length that takes the most values; the others, where they
vary, split the series (their values go into the label and pick the marker). Line styles by
source: measured solid, simulated dashed, paper as stars without a line; one colour per system.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_metrics import PlotError, load_jsonl, render  # noqa: E402

X_KEYS = ("ranks", "link_gbps", "seq_length")
Y_KEYS = {
    "tokens_per_s": "tokens/s",
    "tflops_per_gpu": "TFLOP/s per rank",
    "step_time_s": "step time (s)",
    "efficiency": "weak-scaling efficiency",
}
X_LABELS = {"ranks": "ranks", "link_gbps": "cross-node link (Gbit/s)", "seq_length": "sequence length"}
SOURCES = ("measured", "simulated", "paper")
MARKERS = ("o", "^", "s", "D", "v", "P")
STYLE = {
    "measured": {"linestyle": "-", "marker": "o"},
    "simulated": {"linestyle": "--", "marker": "s", "markerfacecolor": "none"},
    "paper": {"linestyle": "none", "marker": "*", "markersize": 11},
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_rows(rows: list[dict], where: str) -> None:
    for n, row in enumerate(rows, 1):
        missing = [k for k in ("experiment", "system", "source") if k not in row]
        if missing:
            raise PlotError(f"{where}: row {n} lacks {', '.join(missing)}")
        if row["source"] not in SOURCES:
            raise PlotError(f"{where}: row {n}: source {row['source']!r} is not one of {', '.join(SOURCES)}")


def pick_x(rows: list[dict]) -> str:
    """The one of X_KEYS taking the most distinct values (the first on a tie)."""
    counts = {k: len({r.get(k) for r in rows if _number(r.get(k))}) for k in X_KEYS}
    return max(X_KEYS, key=lambda k: counts[k])


def series_of(rows: list[dict], x: str, y: str) -> dict[tuple, list[tuple[float, float]]]:
    """{(system, source, ((key, value), ...)): sorted (x, y) points}; the varying non-x keys split the series."""
    split = [k for k in X_KEYS if k != x and len({r.get(k) for r in rows if _number(r.get(k))}) > 1]
    out: dict[tuple, list] = {}
    for r in rows:
        if _number(r.get(x)) and _number(r.get(y)):
            key = (r["system"], r["source"], tuple((k, r.get(k)) for k in split))
            out.setdefault(key, []).append((float(r[x]), float(r[y])))
    return {k: sorted(v) for k, v in out.items()}


def label_of(key: tuple) -> str:
    system, source, dims = key
    extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in dims if v is not None)
    return f"{system}{extra} ({source})"


def plot_scaling(rows, x=None, y="tokens_per_s", log_x: bool | None = None, title: str = ""):
    """The Figure: one subplot per experiment (order of first appearance). Each series is one
    Line2D with gid "<source>:<system>" and label_of() as its label. x: a key of X_KEYS, or
    {experiment: key}, None (or missing): pick_x per experiment; y: a row key, or {experiment: key};
    log_x None: logarithmic for link rates and ranks."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    experiments = list(dict.fromkeys(r["experiment"] for r in rows))
    if not experiments:
        raise PlotError("no rows to plot")
    fig = Figure(figsize=(6.5 * len(experiments), 4.5), layout="constrained")
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for i, exp in enumerate(experiments):
        ax = fig.add_subplot(1, len(experiments), i + 1)
        mine = [r for r in rows if r["experiment"] == exp]
        xk = (x.get(exp) if isinstance(x, dict) else x) or pick_x(mine)
        yk = y.get(exp, "tokens_per_s") if isinstance(y, dict) else y
        groups = series_of(mine, xk, yk)
        dims = list(dict.fromkeys(k[2] for k in groups))  # a marker per value of the splitting keys
        for key, pts in groups.items():
            system, source, split = key
            style = {"color": colors[systems.index(system) % len(colors)], **STYLE[source]}
            if source != "paper" and len(dims) > 1:
                style["marker"] = MARKERS[dims.index(split) % len(MARKERS)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label_of(key), gid=f"{source}:{system}", **style)
        if not groups:
            ax.text(0.5, 0.5, f"no {yk}", ha="center", va="center", transform=ax.transAxes)
        if log_x if log_x is not None else xk in ("link_gbps", "ranks"):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel(X_LABELS[xk])
        ax.set_ylabel(Y_KEYS.get(yk, yk))
        ax.set_title(exp)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def parse_cli(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="JSONL", help="sweep, simulator or paper rows (concatenated)")
    p.add_argument("--x", choices=X_KEYS, help="x axis (default: per experiment, the key that varies most)")
    p.add_argument("--y", default="tokens_per_s", help=f"y axis: {', '.join(Y_KEYS)} (default tokens_per_s)")
    p.add_argument("--experiment", nargs="+", help="only these experiments")
    p.add_argument("--log-x", action="store_true", default=None, help="logarithmic x axis (default: rates, ranks)")
    p.add_argument("--linear-x", dest="log_x", action="store_false", help="linear x axis")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--output", "-o", default="scaling.png", help="the PNG to write (default scaling.png)")
    return p.parse_args(argv)


def figure_of(a: argparse.Namespace):
    rows = []
    for path in a.files:
        mine = load_jsonl(path)
        check_rows(mine, path)
        rows += mine
    if a.experiment:
        rows = [r for r in rows if r["experiment"] in a.experiment]
        if not rows:
            raise PlotError(f"--experiment {' '.join(a.experiment)}: no such rows in {', '.join(a.files)}")
    return plot_scaling(rows, a.x, a.y, a.log_x, a.title)


def main(argv=None) -> int:
    a = parse_cli(argv)
    return render(lambda: figure_of(a), a.output)


if __name__ == "__main__":
    sys.exit(main())
