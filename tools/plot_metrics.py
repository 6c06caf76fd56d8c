#!/usr/bin/env python3
"""Plot training metrics from one or several `pretrain_gpt.py --metrics-file` JSONL runs:
loss (and validation loss), learning rate, gradient norm, tokens/s, MFU and memory, one
subplot per metric, the runs side by side in each. One PNG.

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --labels zero3 zero++ \\
        --smooth 0.9 --log-x --output metrics.png

--smooth W is TensorBoard's exponential moving average (0: raw; 0.9: heavy) of the noisy
metrics (loss, grad norm, tokens/s, MFU); the raw series is then drawn faint behind the
smoothed one. --x iteration | consumed_samples | tokens (tokens: consumed samples times the
sequence length, which each record gives as tokens_per_sec x step_time / global_batch_size).
MFU is drawn in percent. Validation points are marked (o) on the validation-loss line, and
every resume point by a dotted vertical line in each subplot: a record that says it was the
first after a --load (resumed_from), or an iteration that does not follow the one before it
(runs appended to one file). Needs matplotlib (`pip install -e .[plot]`).

A mixture-of-experts run's records (training/loop.py writes them, model/moe_mlp.moe_step computes them) add
subplots by default, each where some file has it: the load-balancing loss and the router z-loss (without their
coefficients, averaged over the MoE layers; smoothed with the noisy ones), the fewest and most tokens an expert
of each MoE layer received in the step (`expert_load`: one color per layer, most solid, fewest dashed; with several
runs one color per run), the worst layer's busiest expert over an even share (`moe/expert_load_max_over_mean`,
1 is perfect balance) and the routes the capacity dropped (`moe/dropped_fraction`, in percent).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from megatron_zpp.plotting import PlotError, load_jsonl, render

# (record key in the metrics file, subplot title); logging_utils.MetricsSink writes the records
METRICS = {
    "loss": "loss",
    "lr": "learning rate",
    "grad_norm": "grad norm",
    "tokens_per_sec": "tokens/s",
    "mfu": "MFU (%)",
    "memory_gib": "memory (GiB)",
}
# a mixture of experts' (model/moe_mlp.moe_step); drawn by default where a file has them. expert_load: the
# records' moe/expert_load_max/layer{i} and moe/expert_load_min/layer{i}, two lines per MoE layer
MOE_METRICS = {
    "load_balancing_loss": "load-balancing loss",
    "z_loss": "router z-loss",
    "expert_load": "tokens per expert (most -, fewest --)",
    "moe/expert_load_max_over_mean": "expert load max/mean (worst layer)",
    "moe/dropped_fraction": "dropped routes (%)",
}
TITLES = {**METRICS, **MOE_METRICS}
NOISY = ("loss", "grad_norm", "tokens_per_sec", "mfu", "load_balancing_loss", "z_loss")  # --smooth applies to these
X_KEYS = ("iteration", "consumed_samples", "tokens")
SCALE = {"mfu": 100.0, "moe/dropped_fraction": 100.0}  # drawn in percent; the file holds the fraction
LAYER_LOAD = re.compile(r"moe/expert_load_(max|min)/layer(\d+)$")


def default_label(path: str) -> str:
    """The file's stem, or its folder's name for the usual runs/NAME/metrics.jsonl."""
    stem = os.path.splitext(os.path.basename(path))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent if stem == "metrics" and parent else stem


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: s_t = w s_{t-1} + (1 - w) x_t, debiased so the start is not pulled to 0."""
    out, acc = [], 0.0
    for t, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**t))
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def x_of(row: dict, x_key: str, default: int):
    """The record's x: its `x_key`, or for "tokens" consumed samples times the sequence length
    (tokens_per_sec x step_time / global_batch_size); `default` (its position) when absent."""
    if x_key != "tokens":
        return row.get(x_key, default)
    parts = [row.get(k) for k in ("consumed_samples", "tokens_per_sec", "step_time", "global_batch_size")]
    if not all(_number(v) for v in parts) or not parts[3]:
        raise PlotError(
            f"--x tokens: record {default} has no consumed_samples, tokens_per_sec, step_time and "
            "global_batch_size to count its tokens"
        )
    samples, rate, seconds, batch = parts
    return samples * round(rate * seconds / batch)


def series(rows: list[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have a finite number for `key`, y scaled by SCALE (MFU: percent)."""
    xs, ys = [], []
    for i, row in enumerate(rows, 1):
        v = row.get(key)
        if _number(v):
            xs.append(x_of(row, x_key, i))
            ys.append(float(v) * SCALE.get(key, 1.0))
    return xs, ys


def resume_points(rows: list[dict], x_key: str) -> list:
    """x of each record where a run resumed: it names its checkpoint (resumed_from, written by the
    first step after a --load), or its iteration does not follow the previous record's."""
    out, previous = [], None
    for i, row in enumerate(rows, 1):
        it = row.get("iteration")
        back = _number(it) and previous is not None and it <= previous
        if row.get("resumed_from") or back:
            out.append(x_of(row, x_key, i))
        previous = it if _number(it) else previous
    return out


def moe_layers(records: list[dict]) -> list[int]:
    """The MoE layers whose expert loads the records hold (moe/expert_load_max/layer{i}), in order."""
    found = {int(m.group(2)) for r in records for k in r if (m := LAYER_LOAD.match(k))}
    return sorted(found)


def default_metrics(runs) -> list[str]:
    """METRICS, then each of MOE_METRICS that some run's records hold."""
    keys = {k for _, records in runs for r in records for k in r}
    if any(moe_layers(records) for _, records in runs):
        keys.add("expert_load")
    return [*METRICS, *(k for k in MOE_METRICS if k in keys)]


def plot_metrics(runs, metrics=None, smooth: float = 0.0, log_x: bool = False, x_key: str = "iteration"):
    """The Figure: one subplot per metric (default: default_metrics(runs)), one line per run. `runs`:
    [(label, records)]. A smoothed line has gid "smoothed", its raw series gid "raw" (faint); unsmoothed lines
    gid "raw"; expert_load's lines gid "layer{i}:max" / "layer{i}:min"."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    metrics = default_metrics(runs) if metrics is None else list(metrics)
    cols = min(3, len(metrics))
    rows_n = math.ceil(len(metrics) / cols)
    fig = Figure(figsize=(5 * cols, 3.6 * rows_n), layout="constrained")
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, key in enumerate(metrics):
        ax = fig.add_subplot(rows_n, cols, i + 1)
        ax.set_title(TITLES.get(key, key))
        ax.set_xlabel(x_key.replace("_", " "))
        drawn = False
        for j, (label, records) in enumerate(runs):
            color = colors[j % len(colors)]
            if key == "expert_load":
                drawn |= _draw_loads(ax, records, x_key, label, colors if len(runs) == 1 else [color])
                continue
            drawn |= _draw(ax, records, key, x_key, label, color, smooth if key in NOISY else 0.0)
            if key == "loss":
                drawn |= _draw(ax, records, "val_loss", x_key, f"{label} (val)", color, 0.0, style="--o")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
            continue
        for j, (label, records) in enumerate(runs):
            for k, x in enumerate(resume_points(records, x_key)):
                name = f"{label} resumed" if k == 0 else "_nolegend_"
                ax.axvline(x, color=colors[j % len(colors)], linestyle=":", linewidth=1, gid="resume", label=name)
        if log_x:
            ax.set_xscale("log")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
        if len(runs) > 1 or key in ("loss", "expert_load"):
            ax.legend(fontsize="small", ncol=2 if key == "expert_load" else 1)
    return fig


def _draw_loads(ax, records, x_key, label, colors) -> bool:
    """Each MoE layer's most (solid) and fewest (dashed) tokens per expert; a color per layer (one run) or the
    run's color (several runs: the legend names the run once)."""
    layers = moe_layers(records)
    for n, i in enumerate(layers):
        color = colors[n % len(colors)]
        for bound, style in (("max", "-"), ("min", "--")):
            xs, ys = series(records, f"moe/expert_load_{bound}/layer{i}", x_key)
            name = f"layer {i}" if len(colors) > 1 else (label if n == 0 else "_nolegend_")
            ax.plot(xs, ys, style, color=color, gid=f"layer{i}:{bound}", label=name if bound == "max" else "_nolegend_")
    return bool(layers)


def _draw(ax, records, key, x_key, label, color, smooth, style="-") -> bool:
    xs, ys = series(records, key, x_key)
    if not ys:
        return False
    marker = dict(markersize=4) if "o" in style else {}
    if smooth > 0:
        ax.plot(xs, ys, style, color=color, alpha=0.25, linewidth=0.8, gid="raw", label="_nolegend_")
        ax.plot(xs, ema(ys, smooth), style, color=color, label=label, gid="smoothed")
    else:
        ax.plot(xs, ys, style, color=color, label=label, gid="raw", **marker)
    return True


def parse_cli(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics_files", nargs="+", metavar="METRICS_FILE", help="JSONL written by --metrics-file")
    p.add_argument("--labels", nargs="+", help="one label per file (default: the run's folder or file name)")
    p.add_argument("--output", "-o", default="metrics.png", help="the PNG to write (default metrics.png)")
    p.add_argument(
        "--metrics",
        nargs="+",
        help=f"subplots, of {', '.join(TITLES)} (default: {', '.join(METRICS)}, then the MoE ones the files hold)",
    )
    p.add_argument("--smooth", type=float, default=0.0, help="exponential moving average weight in [0, 1)")
    p.add_argument("--log-x", action="store_true", help="logarithmic x axis")
    p.add_argument("--x", dest="x_key", default="iteration", choices=X_KEYS, help="x axis (default iteration)")
    return p.parse_args(argv)


def figure_of(a: argparse.Namespace):
    if a.labels and len(a.labels) != len(a.metrics_files):
        raise PlotError(f"--labels: {len(a.labels)} labels for {len(a.metrics_files)} files")
    if not 0 <= a.smooth < 1:
        raise PlotError(f"--smooth {a.smooth}: use a weight in [0, 1), e.g. 0.9")
    unknown = [m for m in a.metrics or [] if m not in TITLES]
    if unknown:
        raise PlotError(f"--metrics {' '.join(unknown)}: use some of {', '.join(TITLES)}")
    labels = a.labels or [default_label(p) for p in a.metrics_files]
    runs = [(label, load_jsonl(path)) for label, path in zip(labels, a.metrics_files)]
    return plot_metrics(runs, a.metrics, a.smooth, a.log_x, a.x_key)


def main(argv=None) -> int:
    a = parse_cli(argv)
    return render(lambda: figure_of(a), a.output)


if __name__ == "__main__":
    sys.exit(main())
