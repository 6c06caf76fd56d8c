"""Weak scaling at this machine's scale: the same per-rank work (micro-batch 1, global batch =
ranks) on 1, 2 and 4 ranks of the emulated cluster (1 rank; 2 nodes x 1; 2 nodes x 2) with
ZeRO-3 and ZeRO++, as real pretrain_gpt.py runs; efficiency(N) = tokens/s(N) / (N x tokens/s
of one rank). The Frontier follow-up reports 0.94 to 384 GCDs for a 20B GPT (arXiv
2501.04266, abstract); ZeCO near-linear scaling 8 -> 256 GPUs.

The 2 shared cores cap this: N ranks at one thread each get min(N, 2) cores, so the raw
efficiency at 4 ranks is at most 0.5 whatever the communication. The script therefore also
runs N independent single-rank trainings at once (no communication, the same CPU sharing) and
reports efficiency net of the CPU sharing: tokens/s(N) / their summed tokens/s. The reference
rank and the independent ones run at one thread each (one core per rank while N <= 2); the ranks
of a training run get pretrain_gpt.py's cores / ranks per node (so 2 threads each at 2 ranks =
2 nodes x 1, where they oversubscribe the 2 cores, and 1 each at 4 ranks).

    sudo .venv/bin/python examples/reproduce/weak_scaling.py                  (~7 min here)
    sudo .venv/bin/python examples/reproduce/weak_scaling.py --rate 250mbit --ranks 1 2 4 8

Writes examples/reproduce/results/weak_scaling.jsonl and .png.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sweep  # noqa: E402

EXPERIMENT = "weak_scaling"
NET = "weak scaling, net of CPU sharing"
PAPER = [("ZeRO++ 3-level (Frontier, 20B)", 384, 0.94)]  # (system, ranks, efficiency), arXiv 2501.04266


def system_flags(name: str, per_node: int) -> str:
    if name == "ZeRO-3":
        return "--zero-stage 3"
    hpz = f" --zero-hpz-partition-size {per_node}" if per_node > 1 else ""  # hpZ lives inside a node
    return f"--zero-stage 3 --zero-quantized-weights --zero-quantized-gradients{hpz}"


def parse_cli(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], help="ranks (1, or even up to 8; default 1 2 4)")
    p.add_argument("--systems", nargs="+", default=["ZeRO-3", "ZeRO++"], choices=["ZeRO-3", "ZeRO++"])
    p.add_argument("--rate", default="1gbit", help="cross-node rate (default 1gbit)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=256)
    _sweep.add_common_args(p, f"{EXPERIMENT}.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_cli(argv)
    sweep = _sweep.Sweep(a)
    rows, shared = [], {}
    try:
        one = _sweep.Job(EXPERIMENT, "1 rank", ["--zero-stage", "0"], 1, 1, [a.rate], a.seq_length)
        alone_flags = _sweep.model_flags(a, a.seq_length, 1, 1)
        jobs = []
        for n in [n for n in a.ranks if n > 1]:
            per_node = max(1, n // 2)
            for name in a.systems:
                job = _sweep.Job(EXPERIMENT, name, system_flags(name, per_node).split(), n, per_node, [a.rate],
                                 a.seq_length)  # fmt: skip
                jobs.append((job, _sweep.model_flags(a, a.seq_length, 1, n)))
        rows = [dict(sweep.run_concurrent(one, alone_flags, 1), system="1 rank")] + sweep.run_jobs(jobs)
        for n in [n for n in a.ranks if n > 1]:
            shared[n] = sweep.run_concurrent(one, alone_flags, n)
            shared[n].update(ranks=n, system=f"{n} independent single-rank runs")
    finally:
        sweep.close()
    base = rows[0]["tokens_per_s"]
    plot_rows = []
    print(f"\n{'system':<10}{'ranks':>6}{'tokens/s':>10}{'efficiency':>12}{'net of CPU sharing':>20}")
    for r in rows:
        if not (base and r["tokens_per_s"]):
            continue
        r["efficiency"] = r["tokens_per_s"] / (r["ranks"] * base)
        net = r["tokens_per_s"] / shared[r["ranks"]]["tokens_per_s"] if r["ranks"] in shared else 1.0
        r["efficiency_net_of_cpu_sharing"] = net
        print(f"{r['system']:<10}{r['ranks']:>6}{r['tokens_per_s']:>10.0f}{r['efficiency']:>12.2f}{net:>20.2f}")
        for system in a.systems if r["ranks"] == 1 else [r["system"]]:  # the 1-rank point starts both curves
            plot_rows.append({**r, "system": system})
            plot_rows.append({**r, "system": system, "experiment": NET, "efficiency": net})
    for s in shared.values():
        print(f"{s['system']}: {s['tokens_per_s']:.0f} tokens/s together ({s['step_time_s']:.3f} s/step each)")
    extra = [dict(s, experiment=f"{EXPERIMENT}_cpu_baseline") for s in shared.values()]
    paper = [{"experiment": e, "system": s, "ranks": n, "link_gbps": None, "seq_length": None, "step_time_s": None,
              "tokens_per_s": None, "tflops_per_gpu": None, "efficiency": eff, "source": "paper"}
             for s, n, eff in PAPER for e in (EXPERIMENT, NET)]  # fmt: skip
    _sweep.write_rows(a.out, [r for r in rows if "efficiency" in r] + extra + paper, append=False)
    _sweep.save_plot(plot_rows + paper, _sweep.png_of(a.out), x="ranks", y="efficiency",
                     title=f"weak scaling at {a.rate}, micro-batch 1 per rank, {a.dtype}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
