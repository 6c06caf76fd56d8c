"""Weak scaling at this machine's scale: the same per-rank work (micro-batch 1, global batch =
ranks) on 1, 2 and 4 ranks of the emulated cluster (1 rank; 2 nodes x 1; 2 nodes x 2) with
ZeRO-3 and ZeRO++, as real pretrain_gpt.py runs; efficiency(N) = tokens/s(N) / (N x tokens/s
of one rank). The Frontier follow-up reports 0.94 to 384 GCDs for a 20B GPT (arXiv
2501.04266, abstract); ZeCO near-linear scaling 8 -> 256 GPUs.

The 2 shared cores cap this: N ranks share them, so the raw efficiency at 4 ranks is at most
0.5 whatever the communication. The script therefore also runs, next to each N, N independent
single-rank trainings at once (no communication, the same CPU sharing) and reports efficiency
net of the CPU sharing: tokens/s(N) / their summed tokens/s. The copies are gated: each waits,
after its warmup and an untimed block, at a file gate that the driver opens once all N wait
there, so their --baseline-steps timed steps (median) run together and not beside another
copy's start-up. Each copy gets the threads a training rank of that N gets (pretrain_gpt.py
gives a rank cores / ranks per node: 1 thread at 4 ranks = 2 nodes x 2), but no more than
cores / N: at 2 ranks = 2 nodes x 1 the training ranks get 2 threads each, and 2 copies at 2
threads, computing without the ranks' pauses for communication, spin against each other
(measured 21x slower per step than one copy alone), so there the copies run at 1 thread each:
the baseline is what the cores do with N ranks' work and no communication. The raw reference
is one rank alone at one thread.

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
    p.add_argument("--baseline-steps", type=int, default=10, help="timed steps of the single-rank runs (default 10)")
    _sweep.add_common_args(p, f"{EXPERIMENT}.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_cli(argv)
    sweep = _sweep.Sweep(a)
    rows, shared = [], {}
    try:
        one = _sweep.Job(EXPERIMENT, "1 rank", ["--zero-stage", "0"], 1, 1, [a.rate], a.seq_length)
        alone_flags = _sweep.model_flags(a, a.seq_length, 1, 1)
        cores = os.cpu_count() or 1
        rows = [dict(sweep.run_concurrent(one, alone_flags, 1, cores, a.baseline_steps), system="1 rank")]
        for n in [n for n in a.ranks if n > 1]:  # each N's baseline beside its runs: a drift of load hits both
            per_node = max(1, n // 2)
            # the training ranks' threads (LOCAL_WORLD_SIZE = ranks per node), but at most cores / N each: N
            # copies computing without pause at more threads spin against each other (see the docs)
            local_world = max(per_node, min(n, cores))
            shared[n] = sweep.run_concurrent(one, alone_flags, n, local_world, a.baseline_steps)
            shared[n].update(ranks=n, system=f"{n} independent single-rank runs")
            jobs = []
            for name in a.systems:
                job = _sweep.Job(EXPERIMENT, name, system_flags(name, per_node).split(), n, per_node, [a.rate],
                                 a.seq_length)  # fmt: skip
                jobs.append((job, _sweep.model_flags(a, a.seq_length, 1, n)))
            rows += sweep.run_jobs(jobs)
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
        print(
            f"{s['system']} at {s['threads']} thread(s) each: {s['tokens_per_s']:.0f} tokens/s together "
            f"({s['step_time_s']:.3f} s/step each)"
        )
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
