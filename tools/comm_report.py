#!/usr/bin/env python3
"""Print a --comm-report JSON as a table: bytes per rank per step by group role, phase,
op and link class, with totals per link class.

    python tools/comm_report.py runs/quickstart/comm.json
    python tools/comm_report.py runs/quickstart/comm.json --summary    (one screen: per parallelism axis)

--summary folds the rows into the axis that sends them (TP, CP, PP, EP, DP/ZeRO by the group's role;
the control plane: norms, loss reports, checks, checkpoint digests), intra- and inter-node, with each
axis's largest phases, and what crosses the node boundary.
"""

import argparse
import json
from collections import defaultdict


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


# the phases of the control plane (small all-reduces and checks), whatever group they run on
CONTROL_PHASES = ("grad_norm", "loss_report", "step_check", "checkpoint", "nonfinite", "param_norm")
AXES = (("tp", "TP"), ("cp", "CP"), ("pp", "PP"), ("embedding", "PP"), ("ep", "EP"), ("dp", "DP/ZeRO"))


def axis_of(row: dict) -> str:
    """The parallelism axis that sends a ledger row: by its group's role; control-plane phases apart."""
    if row["phase"].startswith(CONTROL_PHASES):
        return "control"
    return next((name for prefix, name in AXES if row["role"].startswith(prefix)), "control")


def summary(rep: dict) -> list[str]:
    """One screen: bytes per rank per step per axis and link class, each axis's largest phases, what crosses nodes."""
    by_axis: dict = defaultdict(lambda: defaultdict(float))
    phases: dict = defaultdict(list)
    for r in rep["records"]:
        axis, b = axis_of(r), r["bytes_per_rank_per_step"]
        by_axis[axis][r["link"]] += b
        phases[axis].append((b, f"{r['phase']} {r['op']} {human(b)}{' (x-node)' if r['link'] == 'inter_node' else ''}"))
    order = [a for a in ("TP", "CP", "PP", "EP", "DP/ZeRO", "control") if a in by_axis]
    out = [
        f"communication per rank per step: world {rep['world_size']}, {rep['steps']} steps "
        "(bytes a rank sends on a real fabric; full table: without --summary)",
        f"{'axis':9}{'intra-node':>12}{'inter-node':>12}   largest phases",
    ]
    for a in order:
        top = ", ".join(text for _, text in sorted(phases[a], reverse=True)[:2])
        out.append(f"{a:9}{human(by_axis[a]['intra_node']):>12}{human(by_axis[a]['inter_node']):>12}   {top}")
    intra, inter = (sum(v[k] for v in by_axis.values()) for k in ("intra_node", "inter_node"))
    out.append(f"{'total':9}{human(intra):>12}{human(inter):>12}")
    crossing = sorted((r["bytes_per_rank_per_step"], r["phase"]) for r in rep["records"] if r["link"] == "inter_node")
    shown = ", ".join(f"{ph} {human(b)}" for b, ph in reversed(crossing) if b >= 0.01 * inter) or "nothing"
    share = f"{100 * inter / (intra + inter):.0f}% of the bytes" if intra + inter else "no bytes"
    out.append(f"across nodes: {share}: {shown}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="JSON written by pretrain_gpt.py --comm-report")
    parser.add_argument("--summary", action="store_true", help="one screen: per parallelism axis and link class")
    args = parser.parse_args(argv)
    with open(args.report) as fh:
        rep = json.load(fh)
    if args.summary:
        print("\n".join(summary(rep)))
        return
    rows = sorted(rep["records"], key=lambda r: (r["link"], r["role"], r["phase"]))
    print(f"world size {rep['world_size']}, {rep['steps']} steps; {rep.get('byte_model', '')}")
    header = ("role", "phase", "op", "link", "bytes/rank/step", "gloo bytes/rank/step", "max rank")
    table = [header] + [
        (
            r["role"],
            r["phase"],
            r["op"],
            r["link"],
            human(r["bytes_per_rank_per_step"]),
            human(r["gloo_bytes_per_rank_per_step"]),
            human(r.get("max_rank_bytes_per_step", 0)),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if j < 4 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    per_link = defaultdict(float)
    for r in rows:
        per_link[r["link"]] += r["bytes_per_rank_per_step"]
    print("\ntotal per link class: " + ", ".join(f"{k} {human(v)}" for k, v in sorted(per_link.items())))


if __name__ == "__main__":
    main()
