#!/usr/bin/env python3
"""Print a --comm-report JSON as a table: bytes per rank per step by group role, phase,
op and link class, with totals per link class.

    python tools/comm_report.py runs/quickstart/comm.json
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="JSON written by pretrain_gpt.py --comm-report")
    args = parser.parse_args(argv)
    with open(args.report) as fh:
        rep = json.load(fh)
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
