"""ZeCO's context parallelism at this machine's scale: a GLA GPT trained with --context-parallel-size P
and --cp-algo all-scan (ZeCO's All-Scan), all-gather (LASP-2) or ring (LASP-1), over P and the
sequence length, on the emulated cluster (P/2 ranks per node, so the state crosses the shaped link),
as real pretrain_gpt.py runs. Reproduces the shape of ZeCO's comparison (arXiv 2507.01004: All-Scan
3.9x faster than all-gather at 256 GPUs; end-to-end 60% faster than the best prior SP at 256 GPUs
with 8M tokens): tokens/s per algorithm, the ledger's CP bytes per rank (All-Scan one state each way
whatever P, all-gather P-1) and all-gather / All-Scan step time.

    sudo .venv/bin/python examples/reproduce/cp_scan.py                       (~8 min here)
    sudo .venv/bin/python examples/reproduce/cp_scan.py --ps 2 4 --seq-lengths 1024 2048 4096 8192

Writes examples/reproduce/results/cp_scan.jsonl and .png.
"""

from __future__ import annotations

import argparse
import sys

from megatron_zpp.testing import reproduce

EXPERIMENT = "cp_scan"
ALGOS = {"All-Scan": "all-scan", "all-gather": "all-gather", "ring": "ring"}
PAPER_SPEEDUP = 3.9  # ZeCO: All-Scan vs all-gather communication at 256 GPUs


def parse_cli(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ps", nargs="+", type=int, default=[2, 4], help="context-parallel sizes (2 or 4; default 2 4)")
    p.add_argument("--seq-lengths", nargs="+", type=int, default=[1024, 4096], help="whole-sequence lengths")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS), metavar="ALGO")
    p.add_argument("--rate", default="1gbit", help="cross-node rate (default 1gbit)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-attention-heads", type=int, default=2, help="GLA heads (state per head: d x d, fp32)")
    p.add_argument("--vocab-size", type=int, default=512)
    reproduce.add_common_args(p, f"{EXPERIMENT}.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_cli(argv)
    with reproduce.Sweep(a) as sweep:  # the cluster (and its lock) for the launches
        jobs = []
        for P in a.ps:
            for seq in a.seq_lengths:
                flags = reproduce.model_flags(a, seq, micro_batch=1, dp=1)
                flags += f"--attention-type gla --gla-chunk-size 64 --context-parallel-size {P}".split()
                for name in a.algos:
                    job = reproduce.Job(EXPERIMENT, name, ["--cp-algo", ALGOS[name]], P, P // 2, [a.rate], seq)
                    jobs.append((job, flags))
        rows = sweep.run_jobs(jobs)
    t = {(r["system"], r["ranks"], r["seq_length"]): r for r in rows if r["step_time_s"]}
    print(f"\n{'P':>3} {'seq':>6} " + "".join(f"{n:>12}" for n in a.algos) + "   all-gather/All-Scan  CP MB/rank")
    for P in a.ps:
        for seq in a.seq_lengths:
            cells = "".join(f"{t[(n, P, seq)]['step_time_s']:>11.3f}s" if (n, P, seq) in t else f"{'failed':>12}"
                            for n in a.algos)  # fmt: skip
            scan, gather = t.get(("All-Scan", P, seq)), t.get(("all-gather", P, seq))
            ratio = f"{gather['step_time_s'] / scan['step_time_s']:>10.2f}x" if scan and gather else f"{'':>11}"
            mb = " / ".join(f"{t[(n, P, seq)]['cp_mb_per_rank']:.2f}" for n in a.algos if (n, P, seq) in t)
            print(f"{P:>3} {seq:>6} {cells}   {ratio}          {mb}")
    print(f"(ZeCO paper: All-Scan {PAPER_SPEEDUP}x faster than all-gather in communication at 256 GPUs)")
    reproduce.save_plot(rows, reproduce.png_of(a.out), x="seq_length", y="tokens_per_s", log_x=True,
                     title=f"GLA context parallelism at {a.rate}: All-Scan, all-gather, ring; {a.dtype}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
