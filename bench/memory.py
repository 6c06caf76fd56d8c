"""The memory estimator (megatron_zpp/planning/memory.py) against measured peaks, per layout and recompute mode.

Each run trains 2 steps under LiveBytes (live tensor storage bytes, entered before the model is
built, so parameters, optimizer states and every buffer count); the measured peak is that of the
second step, per rank. The estimate is megatron_zpp.planning.memory.estimate_rank for the same rank's
pipeline stage and CP slice. Printed per layout: the rank with the largest measured peak, its
estimate and the ratio, and the worst ratio over all ranks.

    .venv/bin/python bench/memory.py [--quick] [--only LAYOUT ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.planning import live_bytes, memory
from megatron_zpp.training.step import train_step
from megatron_zpp.validation import validate

SEQ, HIDDEN, MBS = 128, 64, 4
BASE = (
    f"--mock-data --hidden-size {HIDDEN} --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    f"--seq-length {SEQ} --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
    "--position-embedding-type rope --disable-bias-linear "
    "--ffn-hidden-size 192 "  # the README figures' model (the SwiGLU width rounded up, as it was)
    f"--vocab-size 512 --make-vocab-size-divisible-by 32 --gla-chunk-size 32 --micro-batch-size {MBS} "
    "--train-iters 2 --lr 1e-3 --seed 3 --log-interval 100"
).split()
KINDS = {
    "softmax": ["--attention-type", "softmax"],
    "gla": ["--attention-type", "gla"],
    "hybrid": ["--attention-type", "gla", "--softmax-attention-every", "2", "--gla-gate-low-rank", "8"],
}
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full_uniform": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2".split(),
    "full_block": "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split(),
}
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {  # name: (world size, layers, micro-batches per rank, flags): tests/test_parity.py's names
    "single": (1, 4, 1, []),
    "dp2": (2, 4, 2, []),
    "tp2": (2, 4, 1, TP2),
    "tp2_sp": (2, 4, 1, TP2 + ["--sequence-parallel"]),
    "pp2": (2, 4, 2, ["--pipeline-model-parallel-size", "2"]),
    "pp4_interleaved": (
        4,
        8,
        4,
        ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    "cp2": (2, 4, 1, ["--context-parallel-size", "2"]),
    "zero1": (2, 4, 1, ["--zero-stage", "1"]),
    "zero2": (2, 4, 1, ["--zero-stage", "2"]),
    "zero3": (2, 4, 1, ["--zero-stage", "3"]),
    "zero3_hpz": (2, 4, 1, ["--zero-stage", "3", "--zero-hpz-partition-size", "2"]),
    "single_bf16": (1, 4, 1, ["--bf16"]),
}


def argv_for(layout: str, kind: str, mode: str, mbs: int = MBS) -> tuple[list[str], int]:
    world, layers, micro, flags = LAYOUTS[layout]
    model_parallel = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        model_parallel *= int(flags[flags.index(flag) + 1]) if flag in flags else 1
    gbs = micro * mbs * (world // model_parallel)
    argv = BASE + KINDS[kind] + RECOMPUTE[mode] + flags
    return argv + ["--num-layers", str(layers), "--global-batch-size", str(gbs), "--micro-batch-size", str(mbs)], world


def measure(argv: list[str], world_size: int) -> dict:
    """Peak live bytes of the second training step on this rank, and the estimate for it."""
    cfg = validate(parse_args(argv), world_size)
    with live_bytes.LiveBytes() as live:
        run = training.setup(cfg)
        train_step(run)
        run.state.iteration = 1
        live.reset_peak()
        train_step(run)
    g = run.groups
    return {"measured": live.peak, "stage": g.pp_rank, "cp": g.cp_rank}


def estimated(argv: list[str], world_size: int, stage: int, cp_rank: int) -> int:
    cfg = validate(parse_args(argv), world_size)
    return memory.estimate_rank(cfg, stage, cp_rank=cp_rank, backend="gloo").peak  # measured on gloo


def _worker(rank, world_size, argvs):
    torch.manual_seed(0)
    return [measure(argv, world_size) for argv in argvs]


def run_layout(layout: str, cases: list[tuple[str, str]]) -> list[list[dict]]:
    """Per case, every rank's result (one spawn per layout)."""
    from megatron_zpp.testing.dist import run_distributed

    argvs = [argv_for(layout, kind, mode)[0] for kind, mode in cases]
    world = LAYOUTS[layout][0]
    if world == 1:
        per_rank = [_worker(0, 1, argvs)]
    else:
        per_rank = run_distributed(_worker, world, argvs, timeout=1800)
    return [[r[i] for r in per_rank] for i in range(len(cases))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--kinds", nargs="*", default=["hybrid"])
    ap.add_argument("--modes", nargs="*", default=list(RECOMPUTE))
    ap.add_argument("--save", help="append the measurements here (JSON lines)")
    ap.add_argument("--load", nargs="*", help="print the table from saved measurements (no training)")
    args = ap.parse_args(argv)
    layouts = args.only or list(LAYOUTS)
    print(f"GPT h={HIDDEN}, seq {SEQ}, micro-batch {MBS}, vocab 512, heads 4 (kv 2), fp32 unless named; peak of step 2")
    print(
        f"{'layout':<16} {'model':<8} {'recompute':<13} {'rank':>4} {'stage':>5} {'estimated MiB':>14} "
        f"{'measured MiB':>13} {'ratio':>6} {'worst':>6}"
    )
    worst = 0.0
    if args.load:
        saved = [json.loads(line) for path in args.load for line in open(path)]
        todo = [(row["layout"], [((row["kind"], row["mode"]), row["ranks"])]) for row in saved]
    else:
        todo = [(layout, None) for layout in layouts]
    for layout, done in todo:
        cases = [(k, m) for k in args.kinds for m in args.modes]
        t0 = time.time()
        if done is None:
            results = run_layout(layout, cases)
            if args.save:
                with open(args.save, "a") as f:
                    for (kind, mode), ranks in zip(cases, results):
                        f.write(json.dumps({"layout": layout, "kind": kind, "mode": mode, "ranks": ranks}) + "\n")
            done = list(zip(cases, results))
        for (kind, mode), ranks in done:
            argv, world = argv_for(layout, kind, mode)
            for r in ranks:
                r["estimate"] = estimated(argv, world, r["stage"], r["cp"])
            top = max(range(len(ranks)), key=lambda r: ranks[r]["measured"])
            r = ranks[top]
            top = r.get("rank", top)  # a saved run may keep only its largest rank
            ratios = [x["estimate"] / x["measured"] for x in ranks]
            off = max(ratios, key=lambda q: abs(q - 1))
            worst = max(worst, abs(off - 1))
            print(
                f"{layout:<16} {kind:<8} {mode:<13} {top:>4} {r['stage']:>5} {r['estimate'] / 2**20:>14.2f} "
                f"{r['measured'] / 2**20:>13.2f} {r['estimate'] / r['measured']:>6.3f} {off:>6.3f}",
                flush=True,
            )
        print(f"  ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"largest deviation: {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
