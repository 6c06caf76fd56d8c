"""What the plotting tools (tools/plot_metrics.py, tools/plot_scaling.py) and the sweeps of
examples/reproduce/ share: reading a JSONL file of records, saving a figure (each problem reported
as one line), and the scaling figure (its rows and styles: tools/plot_scaling.py's docstring)."""

import json
import os
import sys


class PlotError(Exception):
    """A problem with the input, reported as one line."""


def load_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file; PlotError naming the file (and line) if it is missing or malformed."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise PlotError(f"{path}:{n}: a record must be a JSON object")
            rows.append(row)
    if not rows:
        raise PlotError(f"{path}: no records")
    return rows


def render(build, output: str) -> int:
    """Build the figure and save it to `output`; a PlotError or a missing matplotlib is one line, exit 2."""
    try:
        fig = build()
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e.name or e}: not installed; pip install -e .[plot]", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    print(f"wrote {output}")
    return 0


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
