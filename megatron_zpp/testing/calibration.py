"""The measurements and fits behind the simulator's `emulated` preset (tools/calibrate_cluster.py
writes it, bench/simulator_validation.py checks the simulator against more runs): launch a script
on the emulated cluster (megatron_zpp/testing/cluster.py), time pretrain_gpt.py runs interleaved
over rounds, and fit the preset's terms. See tools/calibrate_cluster.py for what is measured."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from megatron_zpp.testing.cluster import (
    PRETRAIN_GPT,
    REPO_ROOT,
    Cluster,
    launched_nodes,
    parse_rate,
    start_nodes,
    stop_nodes,
    wait_for_lock,
)

PER_NODE = 2
CALIBRATION_MODELS = [  # tiny GPTs, other sizes than the validation's (bench/simulator_validation.py)
    "--num-layers 2 --hidden-size 48 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 2",
    "--num-layers 6 --hidden-size 48 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 2",
    "--num-layers 3 --hidden-size 160 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 2",
]
# GLA vs softmax layers at the CP runs' local length (seq 128 over CP 4: 32 tokens, 2 chunks)
GLA_MODELS = [
    "--num-layers 2 --hidden-size 48 --num-attention-heads 4 --seq-length 32 --vocab-size 512 --micro-batch-size 2 "
    "--gla-chunk-size 16",
    "--num-layers 6 --hidden-size 48 --num-attention-heads 4 --seq-length 32 --vocab-size 512 --micro-batch-size 2 "
    "--gla-chunk-size 16",
    "--num-layers 3 --hidden-size 160 --num-attention-heads 4 --seq-length 32 --vocab-size 512 --micro-batch-size 2 "
    "--gla-chunk-size 16",
]
# Calibration-only training runs (pretrain_gpt.py), never the validation's sizes (S: 2 x 64, M: 4 x 128)
RUN_COMMON = (
    "--mock-data --seq-length 128 --vocab-size 512 --make-vocab-size-divisible-by 128 --micro-batch-size 2 "
    "--global-batch-size 8 --ranks-per-node 2 --lr 1e-3 --log-interval 1 --peak-tflops 1 "
    "--zero-quantization-block-size 256 --zero-gradient-quantization-block-size 256"
)
RUN_SIZES = {
    "C3": "--num-layers 3 --hidden-size 96 --num-attention-heads 4",
    "C6": "--num-layers 6 --hidden-size 48 --num-attention-heads 4",
}
RUN_LAYOUTS = {
    "zero3": "--zero-stage 3",
    "qwZ": "--zero-stage 3 --zero-quantized-weights",
    "qgZ": "--zero-stage 3 --zero-quantized-gradients",
    "cp all-scan": "--context-parallel-size 4 --cp-algo all-scan --attention-type gla --softmax-attention-every 0 "
    "--gla-chunk-size 16",
}


def wait_for_cluster(minutes: float) -> Cluster:
    """The emulated cluster, once the lock is ours (another bench may hold it: retry)."""
    cluster = Cluster(True, wait_for_lock(minutes * 60))
    if not cluster.netns:
        raise SystemExit(f"error: no emulated cluster here ({cluster.reason}); calibration needs it")
    return cluster


def launch(cluster: Cluster, argv: list[str], world: int, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run `argv` (python script + args) on `world` ranks, PER_NODE per namespace, one
    torchrun per namespace; (worst exit code, both nodes' output)."""
    launch.port += 1
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(launched_nodes(cluster, world // PER_NODE))]
    # PYTHONPATH: the ranks import this checkout's megatron_zpp, whichever one the venv has installed
    rank_env = {
        **os.environ,
        **(env or {}),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": REPO_ROOT,
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [sys.executable, *argv]
    procs = start_nodes(cluster, cmd, rank_env, logs, world // PER_NODE, PER_NODE, launch.port, cwd=REPO_ROOT)
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    running = [p.poll() is None for p in procs]
    stop_nodes(cluster, procs)
    codes = [124 if still else p.returncode for p, still in zip(procs, running)]
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    return max(codes), text


launch.port = 29750


def _nnls(A, y):
    """Least squares with every coefficient >= 0 (few unknowns: try each support, keep the best)."""
    import itertools

    import numpy as np

    A, y = np.asarray(A, float), np.asarray(y, float)
    best, best_x = float("inf"), np.zeros(A.shape[1])
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            x = np.zeros(A.shape[1])
            x[list(cols)] = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
            err = float(((A @ x - y) ** 2).sum())
            if (x >= 0).all() and err < best:
                best, best_x = err, x
    return best_x, best


def fit_compute(rows: list[dict]) -> tuple[float, float]:
    """(FLOP/s per rank, seconds per layer and micro-batch) from seconds = flops/rate + layers*c,
    least squares over the calibration models (2 and 6 layers, two widths), both terms >= 0."""
    x, _ = _nnls([[r["flops"], r["layers"]] for r in rows], [r["seconds"] for r in rows])
    if x[0] <= 0:
        return sum(r["flops"] for r in rows) / sum(r["seconds"] for r in rows), 0.0
    return 1 / x[0], float(x[1])


def fit_gla(rows: list[dict]) -> float:
    """Seconds per GLA layer over a softmax one: least squares through 0 of the difference over
    the layers, >= 0."""
    num = sum(r["layers"] * (r["gla_s"] - r["softmax_s"]) for r in rows)
    return max(num / sum(r["layers"] ** 2 for r in rows), 0.0)


def run_flags(common: str, size: str, layout: str, iters: int) -> list[str]:
    return f"{common} {size} {layout} --train-iters {iters}".split()


def measure_steps(cluster: Cluster, argv: list[str], rate: str, world: int) -> list[float]:
    """The step times of one launch of pretrain_gpt.py `argv` at `rate`, the first step dropped."""
    cluster.shape(parse_rate(rate))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        code, text = launch(cluster, [PRETRAIN_GPT, *argv, "--metrics-file", metrics], world, 600)
        if code or not os.path.exists(metrics):
            raise RuntimeError(f"{' '.join(argv)} at {rate}: exit {code}\n{text[-2000:]}")
        with open(metrics) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    return [r["step_time"] for r in rows if "step_time" in r][1:]


def measure_runs(cluster: Cluster, runs: dict, world: int, rounds: int = 3, log=None) -> dict[str, float]:
    """{name: step time} of `runs` ({name: (argv, rate)}): each launched `rounds` times, the order
    reversed every other round, and its figure the median of all its timed steps.

    Why so: 4 ranks and their gloo threads share 2 cores, and identical launches minutes apart
    differ by up to 25% (C6 ZeRO-3: medians 158-208 ms in 8 launches, fastest steps 121-191 ms,
    pinned to cores or not). The median over rounds interleaved with the other runs averages that
    drift over all of them alike; calibration and validation take the same statistic."""
    import statistics

    steps: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for k in range(rounds):
        for name in names if k % 2 == 0 else reversed(names):
            argv, rate = runs[name]
            steps[name] += measure_steps(cluster, argv, rate, world)
            if log:
                log(f"{name}: round {k + 1}/{rounds}, median so far {statistics.median(steps[name]) * 1e3:.1f} ms")
    return {name: statistics.median(s) for name, s in steps.items()}


def _sim(preset: dict, argv: list[str], rate: str, world: int, **terms) -> float:
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.planning.simulator import simulate
    from megatron_zpp.planning.simulator.hardware import Cluster as SimCluster
    from megatron_zpp.validation import validate

    cl = SimCluster.from_json({**preset, **terms})
    cl = cl.with_inter_node(parse_rate(rate) / 1e9 * preset["measured"]["inter_node_efficiency"])
    return simulate(validate(parse_args(argv), world), cl).step_time_s


def _solve(f, target: float, x0: float = 0.0, step: float = 1e-3) -> float:
    """x >= 0 with f(x) = target for a monotone, piecewise-linear f (the simulator in one term):
    a few Newton steps on finite differences (the overlap's min/max make f's slope change)."""
    x = x0
    for _ in range(4):
        fx = f(x)
        slope = (f(x + step) - fx) / step
        if slope <= 0:
            break
        x_new = max(x + (target - fx) / slope, 0.0)
        if abs(x_new - x) < 1e-7:
            return x_new
        x = x_new
    return x


FIT_RUNS = (  # (name, model size, layout, rate): calibration-only training runs
    ("zero3 C3 1gbit", "C3", "zero3", "1gbit"),
    ("zero3 C3 200mbit", "C3", "zero3", "200mbit"),
    ("zero3 C6 1gbit", "C6", "zero3", "1gbit"),
    ("qwZ C3 200mbit", "C3", "qwZ", "200mbit"),
    ("qgZ C3 200mbit", "C3", "qgZ", "200mbit"),
    ("cp all-scan C3 1gbit", "C3", "cp all-scan", "1gbit"),
)


def fit_runs(cluster: Cluster, preset: dict, world: int, iters: int = 12, rounds: int = 3) -> dict:
    """Measure FIT_RUNS on the cluster (measure_runs) and fit the terms no microbenchmark sees
    (fit_terms)."""
    runs = {
        name: (run_flags(RUN_COMMON, RUN_SIZES[size], RUN_LAYOUTS[layout], iters), rate)
        for name, size, layout, rate in FIT_RUNS
    }
    measured = measure_runs(cluster, runs, world, rounds, log=lambda m: print(f"[calibrate] {m}", flush=True))
    return fit_terms(preset, {k: (*runs[k], measured[k]) for k in runs}, world)


def fit_terms(preset: dict, runs: dict, world: int) -> dict:
    """The terms of the measured `runs` (name -> (argv, rate, seconds), FIT_RUNS' names),
    each term linear in the simulated step (its column: the simulator's step with the term
    set minus without):

    1. zero3 on C3 at 1 Gbit/s and 200 Mbit/s and on C6 at 1 Gbit/s: fixed_step_s, unit_step_s
       (C6 has more units) and 1 - overlap_efficiency (the 200 Mbit/s run has more stream time);
    2. qwZ and qgZ on C3 at 200 Mbit/s: the per-call cost of the int8 / int4 quantizer at block
       256 (the probe's per-call figure is the floor: the runs' calls also wait for the cores);
    3. CP All-Scan on C3 at 1 Gbit/s: scan_msg_s, the per-message cost of the state chain."""
    import numpy as np

    untouched = {"fixed_step_s": 0.0, "unit_step_s": 0.0, "overlap_efficiency": 1.0, "scan_msg_s": 0.0}
    probe = preset["measured"].get("quant", preset["quant"])  # the probe's per-call figures are the floor
    preset = {**preset, **untouched, "quant": {**probe}}
    q = preset["quant"]
    zero = [runs[k] for k in ("zero3 C3 1gbit", "zero3 C3 200mbit", "zero3 C6 1gbit")]
    base = [_sim(preset, a, r, world) for a, r, _ in zero]
    cols = [
        [1.0] * 3,
        [(_sim(preset, a, r, world, unit_step_s=1e-3) - b) / 1e-3 for (a, r, _), b in zip(zero, base)],
        [_sim(preset, a, r, world, overlap_efficiency=0.0) - b for (a, r, _), b in zip(zero, base)],
    ]
    A, y = np.array(cols).T, np.array([m - b for (_, _, m), b in zip(zero, base)])
    # all three >= 0 and 1 - overlap efficiency <= 1: the best over a grid of the overlap term
    fits = [(_nnls(A[:, :2], y - lost * A[:, 2]), lost) for lost in np.linspace(0.0, 1.0, 51)]
    ((fixed, unit), _), lost = min(fits, key=lambda f: f[0][1])
    terms = {"fixed_step_s": float(fixed), "unit_step_s": float(unit), "overlap_efficiency": float(1.0 - lost)}
    fitted = {**preset, **terms}
    for name, key in (("qwZ C3 200mbit", "8/256"), ("qgZ C3 200mbit", "4/256")):
        a, r, m = runs[name]
        per_elem, floor = q[key]

        def with_call(c, a=a, r=r, key=key, per_elem=per_elem):
            return _sim(fitted, a, r, world, quant={**q, key: [per_elem, c]})

        q[key] = [per_elem, _solve(with_call, m, floor) if with_call(floor) < m else floor]
    fitted["quant"] = q
    a, r, m = runs["cp all-scan C3 1gbit"]
    scan = _solve(lambda x: _sim(fitted, a, r, world, scan_msg_s=x), m)
    terms.update(quant=q, scan_msg_s=scan)
    terms["calibration_runs"] = {k: {"flags": " ".join(a), "rate": r, "measured_s": m} for k, (a, r, m) in runs.items()}
    return terms


def refit(path: str, world: int) -> dict:
    """The preset at `path` with its terms refitted from its own stored calibration runs (after a
    change to the simulator: no cluster needed, the measurements are those of the calibration)."""
    with open(path) as fh:
        preset = json.load(fh)
    stored = preset["measured"]["calibration_runs"]
    runs = {k: (v["flags"].split(), v["rate"], v["measured_s"]) for k, v in stored.items()}
    terms = fit_terms(preset, runs, world)
    terms.pop("calibration_runs")
    preset.update(terms)
    preset["notes"] += f"; terms refitted {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    return preset


def calibrate(cluster: Cluster, rate: str, world: int) -> dict:
    cluster.shape(parse_rate(rate))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        models = {"compute": CALIBRATION_MODELS, "gla": GLA_MODELS}
        probe = [os.path.join(os.path.dirname(__file__), "cluster_probe.py"), out, json.dumps(models)]
        code, text = launch(cluster, probe, world, timeout=900)
        if code or not os.path.exists(out):
            raise SystemExit(f"error: the probe failed (exit {code}):\n{text[-3000:]}")
        with open(out) as fh:
            m = json.load(fh)
    shaped = parse_rate(rate) / 8
    rate_flops, per_layer = fit_compute(m["compute"])
    eff = min(m["inter_node"]["bandwidth"] / shaped, 1.0)
    preset = {
        "name": "emulated",
        "ranks_per_node": PER_NODE,
        "sustained_tflops": rate_flops / 1e12,
        "links": {
            "intra_node": {
                "alpha": m["intra_node"]["alpha"],
                "bandwidth": m["intra_node"]["bandwidth"],
                "shared": "rank",
            },
            "inter_node": {"alpha": m["inter_node"]["alpha"], "bandwidth": eff * shaped, "shared": "node"},
        },
        "quant_elems_per_s": m["quant_elems_per_s"],
        "quant": m["quant"],
        "optimizer_s_per_param": max(r["optimizer_s_per_param"] for r in m["compute"]),
        "sub_node_tiers": [],
        "device": "cpu",
        "fixed_step_s": 0.0,
        "per_layer_s": per_layer,
        "gla_layer_s": fit_gla(m["gla"]),
        "notes": f"tools/calibrate_cluster.py at {rate}, {world} gloo ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}",
        "measured": {**m, "calibration_rate": rate, "inter_node_efficiency": eff},
    }
    runs = fit_runs(cluster, preset, world)
    preset["measured"]["calibration_runs"] = runs.pop("calibration_runs")
    preset.update(runs)
    return preset
