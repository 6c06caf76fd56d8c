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
import sys

# the figure lives in the package: the sweeps of examples/reproduce/ draw it too
from megatron_zpp.plotting import X_KEYS, Y_KEYS, PlotError, check_rows, load_jsonl, plot_scaling, render


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
