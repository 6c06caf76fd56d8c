"""Held-out validation of the step-time simulator on the emulated cluster: real training
runs of pretrain_gpt.py (4 gloo ranks, 2 per namespace, --ranks-per-node 2, the veth shaped)
beside the simulator's prediction from the `emulated` preset (tools/calibrate_cluster.py),
with the error. None of these runs is used by the calibration.

    python bench/simulator_validation.py            # 13 runs x 3 rounds, ~10 min on 2 idle cores
    python bench/simulator_validation.py --quick    # 2 runs, 1 round (smoke test)
    python bench/simulator_validation.py --calibrate  # calibrate first (~5 min), under the same cluster lock

Runs: ZeRO-3 and ZeRO++ (qwZ + hpZ + qgZ) on two model sizes at 1 Gbit/s and 200 Mbit/s; qwZ,
hpZ and qgZ alone; CP All-Scan vs all-gather (GLA layers, CP over all 4 ranks). The measured
step time is the median step (--metrics-file, the first step dropped) over --rounds launches of
each run, the runs interleaved and their order reversed every other round: the statistic of the
calibration (megatron_zpp.testing.calibration.measure_runs, whose docstring says why). Target: within 15%.
Takes the emulated cluster's lock (waits for another bench up to --wait-minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.planning.simulator import preset, simulate
from megatron_zpp.planning.simulator.hardware import EMULATED_JSON
from megatron_zpp.testing.calibration import calibrate, measure_runs, wait_for_cluster
from megatron_zpp.testing.cluster import parse_rate
from megatron_zpp.validation import validate

WORLD = 4
SIZES = {
    "S": "--num-layers 2 --hidden-size 64 --num-attention-heads 4",
    "M": "--num-layers 4 --hidden-size 128 --num-attention-heads 4",
}
COMMON = (
    "--mock-data --seq-length 128 --vocab-size 512 --make-vocab-size-divisible-by 128 --micro-batch-size 2 "
    "--global-batch-size 8 --ranks-per-node 2 --lr 1e-3 --log-interval 1 --peak-tflops 1 "
    "--zero-quantization-block-size 256 --zero-gradient-quantization-block-size 256"
)
LAYOUTS = {
    "zero3": "--zero-stage 3",
    "zero++": "--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients",
    "qwZ": "--zero-stage 3 --zero-quantized-weights",
    "hpZ": "--zero-stage 3 --zero-hpz-partition-size 2",
    "qgZ": "--zero-stage 3 --zero-quantized-gradients",
    "cp all-scan": "--context-parallel-size 4 --cp-algo all-scan --attention-type gla --softmax-attention-every 0 "
    "--gla-chunk-size 16",
    "cp all-gather": "--context-parallel-size 4 --cp-algo all-gather --attention-type gla --softmax-attention-every 0 "
    "--gla-chunk-size 16",
}
FULL = (
    [(lay, size, rate) for lay in ("zero3", "zero++") for size in ("S", "M") for rate in ("1gbit", "200mbit")]
    + [(lay, "M", "200mbit") for lay in ("qwZ", "hpZ", "qgZ")]
    + [(lay, "M", "1gbit") for lay in ("cp all-scan", "cp all-gather")]
)
QUICK = [("zero3", "S", "1gbit"), ("zero++", "S", "200mbit")]


def flags(layout: str, size: str, iters: int) -> list[str]:
    return f"{COMMON} {SIZES[size]} {LAYOUTS[layout]} --train-iters {iters}".split()


def predict(layout: str, size: str, rate: str, cluster_json: str | None) -> float:
    emulated = preset("emulated", cluster_json)
    eff = emulated.measured.get("inter_node_efficiency", 1.0)
    cl = emulated.with_inter_node(parse_rate(rate) / 1e9 * eff)
    return simulate(validate(parse_args(flags(layout, size, 1)), WORLD), cl).step_time_s


def compare(runs: list[tuple[str, str, str]], step: dict[str, float], cluster_json: str | None) -> list[dict]:
    """Each run's measured step time (`step`, by "layout size rate") beside the simulator's, printed as it goes."""
    rows = []
    for layout, size, rate in runs:
        measured = step[f"{layout} {size} {rate}"]
        predicted = predict(layout, size, rate, cluster_json)
        err = predicted / measured - 1
        rows.append(
            {
                "layout": layout,
                "size": size,
                "rate": rate,
                "measured_s": measured,
                "predicted_s": predicted,
                "error": err,
            }
        )
        print(
            f"{layout:<14} {size} {rate:>8}  measured {measured * 1e3:8.1f} ms  predicted {predicted * 1e3:8.1f} ms"
            f"  error {100 * err:+6.1f}%",
            flush=True,
        )
    return rows


def print_summary(rows: list[dict], seconds: float, load: list[float]) -> None:
    inside = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(
        f"\n{inside} of {len(rows)} runs within 15%; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{seconds:.0f} s, load average {load[0]:.1f} -> {load[1]:.1f}"
    )
    print("| layout | model | link | measured ms | predicted ms | error |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['size']} | {r['rate']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} "
            f"| {100 * r['error']:+.1f}% |"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 runs: a smoke test")
    ap.add_argument("--iters", type=int, default=12, help="training steps per launch (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=None, help="launches of each run (default 3; --quick: 1)")
    ap.add_argument("--cluster-json", default=None, help="the emulated preset (default: the checked-in one)")
    ap.add_argument("--wait-minutes", type=float, default=30.0)
    ap.add_argument("--json-out", default=None, help="also write the rows as JSONL (plots)")
    ap.add_argument(
        "--calibrate", action="store_true", help="first run tools/calibrate_cluster.py's measurements (same lock)"
    )
    a = ap.parse_args(argv)
    runs = QUICK if a.quick else FULL
    cluster = wait_for_cluster(a.wait_minutes)
    rows, start = [], time.time()
    load = [os.getloadavg()[0]]
    try:
        if a.calibrate:
            out = a.cluster_json or os.path.normpath(EMULATED_JSON)
            calibrated = calibrate(cluster, "1gbit", WORLD)  # before opening: a failure keeps the old preset
            with open(out, "w") as fh:
                json.dump(calibrated, fh, indent=1)
            print(f"calibrated: {out}", flush=True)
        specs = {f"{lay} {size} {rate}": (flags(lay, size, a.iters), rate) for lay, size, rate in runs}
        rounds = a.rounds or (1 if a.quick else 3)
        step = measure_runs(cluster, specs, WORLD, rounds, log=lambda m: print(f"  {m}", flush=True))
        rows = compare(runs, step, a.cluster_json)
    finally:
        cluster.cleanup()
    load.append(os.getloadavg()[0])
    print_summary(rows, time.time() - start, load)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            for r in rows:
                fh.write(json.dumps({"experiment": "simulator_validation", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
