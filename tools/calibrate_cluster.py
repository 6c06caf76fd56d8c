"""Calibrate the simulator's `emulated` preset on this machine's emulated cluster
(bench/cluster.py: two network namespaces joined by a tc-shaped veth; root needed).

    python tools/calibrate_cluster.py [--rate 1gbit] [--ranks 4] [--out bench/results/emulated_cluster.json]

Measures, with 4 gloo ranks (2 per namespace) running at once as in training:

* the p2p alpha and bandwidth inside a namespace (loopback) and across the veth shaped at
  --rate (the inter-node bandwidth is stored as a fraction of the shaped rate, so the
  simulator can take any other rate: --link-gbps, bench/simulator_validation.py);
* the model FLOP/s per rank of forward + backward of two small GPTs (all ranks computing at
  once, so the shared cores are counted), fitted as seconds = FLOPs / rate + layers x overhead;
* the int8 quantize + dequantize throughput (ops/quantize.py).

Only one emulated-cluster bench may run at a time (a lock): this tool waits for it (up to
--wait-minutes). Without root or iproute2 it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from cluster import ADDRS, VETHS, Cluster, _kill, parse_rate, take_lock  # noqa: E402

from megatron_zpp.simulator.hardware import EMULATED_JSON  # noqa: E402

PER_NODE = 2
CALIBRATION_MODELS = [  # tiny GPTs like the validation's (bench/simulator_validation.py)
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 2",
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --vocab-size 512 --micro-batch-size 2",
]


def wait_for_cluster(minutes: float) -> Cluster:
    """The emulated cluster, once the lock is ours (another bench may hold it: retry)."""
    deadline = time.time() + minutes * 60
    while True:
        try:
            fd = take_lock()
            break
        except SystemExit as e:
            if time.time() > deadline:
                raise
            if not getattr(wait_for_cluster, "told", False):
                print(f"[calibrate] {e}; waiting for it", file=sys.stderr, flush=True)
                wait_for_cluster.told = True
            time.sleep(1)
    cluster = Cluster(True, fd)
    if not cluster.netns:
        raise SystemExit(f"error: no emulated cluster here ({cluster.reason}); calibration needs it")
    return cluster


def launch(cluster: Cluster, argv: list[str], world: int, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run `argv` (python script + args) on `world` ranks, PER_NODE per namespace, one
    torchrun per namespace; (worst exit code, both nodes' output)."""
    launch.port += 1
    nodes = world // PER_NODE
    procs, logs = [], []
    for node in range(nodes):
        log = tempfile.TemporaryFile(mode="w+")
        node_env = {
            **os.environ,
            **(env or {}),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT,
            "GLOO_SOCKET_IFNAME": VETHS[node],
            "PYTHONWARNINGS": "ignore",
        }
        cmd = cluster.prefix(node) + [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *f"--nnodes {nodes} --nproc-per-node {PER_NODE} --node-rank {node} --master-addr {ADDRS[0]}".split(),
            "--master-port",
            str(launch.port),
            *argv,
        ]
        p = subprocess.Popen(cmd, env=node_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        cluster.children.append(p)
        procs.append(p)
        logs.append(log)
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    codes = []
    for p in procs:
        if p.poll() is None:
            _kill(p)
        codes.append(p.returncode if p.returncode is not None else 124)
        cluster.children.remove(p)
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    return max(codes), text


launch.port = 29750


def fit_compute(rows: list[dict]) -> tuple[float, float]:
    """(FLOP/s per rank, seconds per layer and micro-batch) from seconds = flops/rate + layers*c."""
    (f1, l1, t1), (f2, l2, t2) = [(r["flops"], r["layers"], r["seconds"]) for r in rows[:2]]
    det = f1 * l2 - f2 * l1
    inv_rate, per_layer = (t1 * l2 - t2 * l1) / det, (f1 * t2 - f2 * t1) / det
    if inv_rate <= 0 or per_layer < 0:  # noisy: no overhead term, the mean rate
        return (f1 + f2) / (t1 + t2), 0.0
    return 1 / inv_rate, per_layer


def calibrate(cluster: Cluster, rate: str, world: int) -> dict:
    cluster.shape(parse_rate(rate))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        probe = [os.path.join(ROOT, "tools", "_cluster_probe.py"), out, json.dumps(CALIBRATION_MODELS)]
        code, text = launch(cluster, probe, world, timeout=900)
        if code or not os.path.exists(out):
            raise SystemExit(f"error: the probe failed (exit {code}):\n{text[-3000:]}")
        with open(out) as fh:
            m = json.load(fh)
    shaped = parse_rate(rate) / 8
    rate_flops, per_layer = fit_compute(m["compute"])
    eff = min(m["inter_node"]["bandwidth"] / shaped, 1.0)
    return {
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
        "optimizer_s_per_param": max(r["optimizer_s_per_param"] for r in m["compute"]),
        "sub_node_tiers": [],
        "device": "cpu",
        "fixed_step_s": 0.0,
        "per_layer_s": per_layer,
        "notes": f"tools/calibrate_cluster.py at {rate}, {world} gloo ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}",
        "measured": {**m, "calibration_rate": rate, "inter_node_efficiency": eff},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="veth rate while measuring (e.g. 1gbit, 200mbit)")
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks, 2 per namespace")
    ap.add_argument("--out", default=os.path.normpath(EMULATED_JSON))
    ap.add_argument("--wait-minutes", type=float, default=30.0, help="how long to wait for another bench's lock")
    a = ap.parse_args(argv)
    cluster = wait_for_cluster(a.wait_minutes)
    try:
        preset = calibrate(cluster, a.rate, a.ranks)
    finally:
        cluster.cleanup()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(preset, fh, indent=1)
    links, eff = preset["links"], preset["measured"]["inter_node_efficiency"]
    intra, inter = links["intra_node"], links["inter_node"]
    print(
        f"wrote {a.out}: {preset['sustained_tflops'] * 1e3:.2f} GFLOP/s per rank "
        f"(+{preset['per_layer_s'] * 1e3:.2f} ms per layer), intra {intra['bandwidth'] / 1e6:.0f} MB/s "
        f"alpha {intra['alpha'] * 1e6:.0f} us, inter {inter['bandwidth'] / 1e6:.1f} MB/s ({eff:.2f} of {a.rate}) "
        f"alpha {inter['alpha'] * 1e6:.0f} us, quantizer {preset['quant_elems_per_s'] / 1e6:.0f} M elements/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
