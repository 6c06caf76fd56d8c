"""ZeRO-3 and ZeRO++ on an emulated 2-node cluster: ours vs PyTorch FSDP2 vs DeepSpeed.

    sudo .venv/bin/python bench/zero.py                  (reference setting, < 15 min on 2 cores)
    sudo .venv/bin/python bench/zero.py --quick          (smoke test: tiny model, 1gbit only)
    .venv/bin/python bench/zero.py --rates 1gbit --systems ours-z3 fsdp2 ds-z3

The cluster: two network namespaces `zpp_n0`, `zpp_n1` joined by a veth pair (10.231.77.1/24
<-> 10.231.77.2/24), 2 ranks in each, launched by `ip netns exec zpp_nI torchrun --nnodes 2
--nproc-per-node 2 --node-rank I --master-addr 10.231.77.1`. GLOO_SOCKET_IFNAME is the
namespace's veth: two ranks of one node then talk through their own veth address, which the
kernel delivers over the namespace's loopback (unshaped, never on the veth: checked at start
by a socket transfer). The cross-node link is shaped on both veth ends with
`tc qdisc replace ... tbf rate R burst B latency 50ms`; "unshaped" removes the qdisc. The
namespaces are removed at the end whatever happens (finally, atexit, SIGTERM/SIGINT, and a
watchdog process for SIGKILL); stale ones from an earlier run are removed at start. Without
root, `ip` or `tc` the bench says so and runs all 4 ranks on loopback, unshaped.

One launch per system covers every rate: the ranks stop at a gate before the first step of
each rate (the probe of bench/zero_peers/common.py), the bench reshapes the link and opens
the gate (the wait is not timed). Only the first rate has warmup steps: the first step after
a gate measured no slower than the next ones.

Systems (same model, weights, token stream, global batch, AdamW, LR schedule, clipping):
  ours-z0 (plain DP), ours-z3, ours-qwz, ours-hpz, ours-qgz, ours-zpp (qwZ+hpZ+qgZ):
      pretrain_gpt.py through bench/zero_peers/ours.py (probe only); a configuration that
      pretrain_gpt.py refuses is listed as "not available: <its message>";
  fsdp2, fsdp2-hpz: torch fully_shard per block + root, reshard_after_forward True / 2;
  ds-z3: DeepSpeed 0.19.8 ZeRO-3 with its defaults, DS_ACCELERATOR=cpu, gloo, from
      .venv-bench-ds/ (created on first use; reuses .venv's CPU torch through a .pth file);
      its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keep a model
      this small gathered from forward to backward: no backward all-gather, 2M per step;
  ds-z3-regather, ds-hpz: ZeRO-3 that releases each layer after use (both settings 0), as in
      the paper (3M per step), without and with zero_hpz_partition_size 2 (hpZ needs the
      backward all-gather to act: ds-hpz-default, hpZ on the defaults, runs only if named);
  ds-qwz, ds-qgz: listed as not run (their kernels need CUDA).
The peers' model is bench/single_rank.py's PeerGPT (Llama-style like ours) loaded with our
initialized weights, so every system's first loss is the same number.

Figures per system and rate: step time (median of the timed steps, timed by the probe around
the whole optimizer step, which ends with the loss all-reduced; for ours the JSON also has
pretrain_gpt.py's own step_time from --metrics-file), cross-node MB per rank per step from our
ledger (--comm-report, link inter_node; the papers' model: a flat collective spanning nodes counts whole) and measured
on the wire (veth tx_bytes of both namespaces over the timed steps / 4 ranks; IP/TCP headers
included), and the peak RSS per rank over the timed steps (VmHWM reset after warmup; max over
ranks; includes ~300 MB of libraries; every rank runs with MALLOC_MMAP_THRESHOLD_=1 MiB, else
glibc's adaptive threshold keeps freed gather buffers resident and a sharded system's peak
RSS measured 300-370 MB above its live memory). Ratios: speedup = reference step time / this step
time (> 1: faster than the reference). 4 ranks share 2 CPU cores at 1 thread each
(OMP_NUM_THREADS=1): absolute times are this machine's; the ratios are the figure. The last
stdout line is one JSON object with everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.cluster import ADDRS, VETHS, Cluster, _kill, parse_rate, take_lock  # noqa: E402

PEERS = os.path.join(ROOT, "bench", "zero_peers")
DS_VENV = os.path.join(ROOT, ".venv-bench-ds")
DS_PY = os.path.join(DS_VENV, "bin", "python")
DS_VERSION = "0.19.8"

WORLD, PER_NODE = 4, 2

# DeepSpeed's defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keep a model
# of this size gathered from forward to backward: no backward all-gather (2M per step, not 3M),
# and hpZ has nothing to do. "regather" releases each layer after use, as ZeRO-3 in the paper.
REGATHER = json.dumps({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})

# name -> (label, kind, options)
SYSTEMS = {
    "ours-z0": ("ours ZeRO-0 (plain DP)", "ours", ["--zero-stage", "0"]),
    "ours-z3": ("ours ZeRO-3", "ours", ["--zero-stage", "3"]),
    "ours-qwz": ("ours ZeRO-3 + qwZ", "ours", ["--zero-stage", "3", "--zero-quantized-weights"]),
    "ours-hpz": ("ours ZeRO-3 + hpZ", "ours", ["--zero-stage", "3", "--zero-hpz-partition-size", "2"]),
    "ours-qgz": ("ours ZeRO-3 + qgZ", "ours", ["--zero-stage", "3", "--zero-quantized-gradients"]),
    "ours-zpp": (
        "ours ZeRO++ (qwZ+hpZ+qgZ)",
        "ours",
        ("--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients").split(),
    ),
    "fsdp2": ("FSDP2 fully_shard", "fsdp2", ["--reshard-after-forward", "true"]),
    "fsdp2-hpz": ("FSDP2 reshard_after_forward=2", "fsdp2", ["--reshard-after-forward", "2"]),
    "ds-z3": (f"DeepSpeed {DS_VERSION} ZeRO-3", "ds", ["--hpz", "1"]),
    "ds-z3-regather": (f"DeepSpeed {DS_VERSION} ZeRO-3 regather", "ds", ["--hpz", "1", "--zero-config", REGATHER]),
    "ds-hpz": (f"DeepSpeed {DS_VERSION} ZeRO-3+hpZ regather", "ds", ["--hpz", "2", "--zero-config", REGATHER]),
    "ds-hpz-default": (f"DeepSpeed {DS_VERSION} ZeRO-3 + hpZ", "ds", ["--hpz", "2"]),
    "ds-qwz": (f"DeepSpeed {DS_VERSION} ZeRO-3 + qwZ", "skip", "needs CUDA kernels (quantizer op): not run"),
    "ds-qgz": (f"DeepSpeed {DS_VERSION} ZeRO-3 + qgZ", "skip", "needs CUDA kernels (quantizer op): not run"),
}
DEFAULT_SYSTEMS = [n for n in SYSTEMS if n != "ds-hpz-default"]
REFERENCES = (("ours-z3", "ours Z3"), ("fsdp2", "FSDP2"), ("ds-z3", "DS Z3"))


def log(msg: str) -> None:
    print(f"[zero-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- DeepSpeed's venv


def ensure_ds_venv() -> str | None:
    """Create .venv-bench-ds with deepspeed==0.19.8 on our CPU torch; None if ready, else why not."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    check = [DS_PY, "-c", f"import deepspeed; assert deepspeed.__version__ == '{DS_VERSION}', deepspeed.__version__"]
    try:
        if not (os.path.exists(DS_PY) and subprocess.run(check, capture_output=True, env=env).returncode == 0):
            log(f"creating {DS_VENV} with deepspeed=={DS_VERSION} (once; reuses .venv's CPU torch)")
            subprocess.run([sys.executable, "-m", "venv", DS_VENV], check=True, capture_output=True)
            site = subprocess.run(
                [DS_PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            with open(os.path.join(site, "_zpp_main_venv.pth"), "w") as f:
                f.write(sysconfig.get_paths()["purelib"] + "\n")  # torch, numpy, pydantic of .venv
            for args in (["wheel"], ["--no-build-isolation", f"deepspeed=={DS_VERSION}"]):
                res = subprocess.run(
                    [DS_PY, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, env=env
                )
                if res.returncode:
                    return f"pip install {' '.join(args)} failed: {_last_error(res.stdout + res.stderr)}"
            res = subprocess.run(check, capture_output=True, text=True, env=env)
            if res.returncode:
                return f"import deepspeed failed: {_last_error(res.stderr)}"
        # build DeepSpeed's CPU shm comm op once here, not in 4 ranks at once during a run
        subprocess.run(
            [DS_PY, "-c", "import deepspeed.comm.torch as t; t.build_shm_op()"],
            capture_output=True,
            env=env,
            timeout=600,
        )
    except Exception as e:  # noqa: BLE001
        return f"setting up {DS_VENV} failed: {e}"
    return None


def _last_error(text: str, exit_codes: list | None = None) -> str:
    lines = [
        ln.strip()
        for ln in text.strip().splitlines()
        if ln.strip() and not re.match(r"^\[[WI]\d", ln.strip()) and "Warning" not in ln and "return func(" not in ln
    ]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:") :].strip()
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", ln) or "Error:" in ln:
            return ln[:300]
    killed = [-c for c in exit_codes or [] if c and c < 0]
    if killed:
        return f"killed by signal {killed[0]}" + (f" (last output: {lines[-1][:200]})" if lines else "")
    return lines[-1][:300] if lines else "no output"


# ---------------------------------------------------------------- one system, every rate


def model_args(a, iters: int) -> list[str]:
    return (
        f"--mock-data --fp32 --num-layers {a.num_layers} --hidden-size {a.hidden_size} "
        f"--num-attention-heads {a.num_attention_heads} --seq-length {a.seq_length} --vocab-size "
        f"{a.vocab_size} --micro-batch-size {a.micro_batch_size} --global-batch-size "
        f"{a.micro_batch_size * WORLD} --train-iters {iters} --seed {a.seed} --lr 3e-4 "
        f"--lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --ranks-per-node {PER_NODE}"
    ).split()


def ours_refusal(args: list[str]) -> str | None:
    """pretrain_gpt.py's own config check (no processes): its message if it refuses."""
    sys.path.insert(0, ROOT)
    try:
        from megatron_zpp.arguments import parse_args
        from megatron_zpp.config import ConfigError, validate
    except Exception as e:  # noqa: BLE001
        return f"cannot import megatron_zpp: {e}"
    try:
        validate(parse_args(args), WORLD)
    except ConfigError as e:
        return str(e).strip().replace("\n", "; ")
    except SystemExit:
        return "pretrain_gpt.py rejects these flags"
    return None


def launch(
    cluster: Cluster, name: str, kind: str, opts: list[str], a, rate_list: list[str], work: str, ds_reason: str | None
) -> dict:
    iters = a.warmup + a.steps * len(rate_list)
    margs = model_args(a, iters)
    out_dir = os.path.join(work, name)
    os.makedirs(out_dir)
    if kind == "ours":
        ours_args = (
            margs
            + opts
            + [
                "--metrics-file",
                os.path.join(out_dir, "metrics.jsonl"),
                "--comm-report",
                os.path.join(out_dir, "comm.json"),
                "--log-interval",
                "1",
                "--peak-tflops",
                "1",
            ]
        )  # skip the CPU peak measurement: MFU is not reported
        refused = ours_refusal(ours_args)
        if refused:
            return {"status": "not available", "reason": refused}
        py, script, script_args = sys.executable, os.path.join(PEERS, "ours.py"), ours_args
    elif kind == "fsdp2":
        py, script, script_args = sys.executable, os.path.join(PEERS, "fsdp2.py"), margs
    else:
        if ds_reason:
            return {"status": "failed", "reason": ds_reason}
        py, script, script_args = DS_PY, os.path.join(PEERS, "deepspeed_zero.py"), margs
    extra = opts if kind != "ours" else []
    cmd_tail = [script, "--warmup", str(a.warmup), "--gate-every", str(a.steps), *extra, "--", *script_args]

    port = 29600 + launch.count
    launch.count += 1
    env = {
        **os.environ,
        **({"MALLOC_MMAP_THRESHOLD_": str(a.malloc_mmap_threshold)} if a.malloc_mmap_threshold else {}),
        "OMP_NUM_THREADS": "1",
        "ZPP_PROBE_DIR": out_dir,
        "PYTHONUNBUFFERED": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }
    procs, logs = [], []
    cluster.shape(parse_rate(rate_list[0]))
    open(os.path.join(out_dir, "gate0.open"), "w").close()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    nodes = range(2) if cluster.netns else range(1)
    for node in nodes:
        if cluster.netns:
            run_cmd = [
                py,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(PER_NODE),
                "--node-rank",
                str(node),
                "--master-addr",
                ADDRS[0],
                "--master-port",
                str(port),
            ]
            node_env = {**env, "GLOO_SOCKET_IFNAME": VETHS[node], "ZPP_VETH": VETHS[node], "ZPP_NODE": str(node)}
        else:
            run_cmd = [
                py,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(WORLD),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ]
            node_env = env
        logf = open(os.path.join(out_dir, f"node{node}.log"), "w")
        logs.append(logf)
        p = subprocess.Popen(
            cluster.prefix(node) + run_cmd + cmd_tail,
            env=node_env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        procs.append(p)
        cluster.children.append(p)

    # open the gate of rate k once all ranks wait at it (no traffic in flight), after reshaping
    timed_out = False
    for k in range(1, len(rate_list)):
        while not timed_out and all(p.poll() is None for p in procs):
            if all(os.path.exists(os.path.join(out_dir, f"gate{k}.rank{r}")) for r in range(WORLD)):
                break
            timed_out = time.perf_counter() - t_start > a.run_timeout
            time.sleep(0.05)
        else:
            break
        cluster.shape(parse_rate(rate_list[k]))
        open(os.path.join(out_dir, f"gate{k}.open"), "w").close()
    failed_at = None  # one node failed: give the other a moment to report, then stop it (it may hang in gloo)
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if now - t_start > a.run_timeout:
            timed_out = True
            break
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > 15:
            break
        time.sleep(0.1)
    for p in procs:
        _kill(p)
        cluster.children.remove(p)
    for f in logs:
        f.close()
    wall = time.perf_counter() - t_start
    text = "".join(open(os.path.join(out_dir, f"node{n}.log"), errors="replace").read() for n in nodes)
    ranks = {}
    for r in range(WORLD):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    if timed_out:
        return {"status": "failed", "reason": f"timed out after {a.run_timeout:.0f} s (--run-timeout)", "wall_s": wall}
    if any(p.returncode for p in procs) or failed_at is not None or len(ranks) < WORLD:
        return {
            "status": "failed",
            "reason": _last_error(text, [p.returncode for p in procs]),
            "wall_s": wall,
            "exit_codes": [p.returncode for p in procs],
        }
    return {
        "status": "ok",
        "wall_s": wall,
        "loadavg": [load_start, os.getloadavg()[0]],
        **collect(kind, out_dir, ranks, rate_list, a),
    }


launch.count = 0


def collect(kind: str, out_dir: str, ranks: dict, rate_list: list[str], a) -> dict:
    metrics = []
    if kind == "ours":
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(ln) for ln in f if ln.strip()]
    ledger = None
    if kind == "ours" and os.path.exists(os.path.join(out_dir, "comm.json")):
        with open(os.path.join(out_dir, "comm.json")) as f:
            rep = json.load(f)
        ledger = {
            "inter_node": sum(r["bytes_per_rank_per_step"] for r in rep["records"] if r["link"] == "inter_node"),
            "intra_node": sum(r["bytes_per_rank_per_step"] for r in rep["records"] if r["link"] != "inter_node"),
            "gloo_inter_node": sum(
                r["gloo_bytes_per_rank_per_step"] for r in rep["records"] if r["link"] == "inter_node"
            ),
        }
    out = {"rates": {}, "ledger_bytes_per_rank_per_step": ledger, "losses": ranks[0]["losses"]}
    for k, rate in enumerate(rate_list):
        first, last = a.warmup + k * a.steps, a.warmup + (k + 1) * a.steps  # timed steps [first, last)
        times = ranks[0]["step_times"][first:last]  # the probe's, the same for every system
        # ours: pretrain_gpt's own step_time (--metrics-file) too; it includes the gate wait at a rate's first step
        own = [m["step_time"] for m in metrics if first + (k > 0) < m["iteration"] <= last]
        wire = 0.0
        have_wire = False
        for r in ranks.values():
            tb, te = r.get("tx_begin") or [], r.get("tx_end") or []
            if r.get("iface") and len(tb) >= last and len(te) >= last and tb[first] is not None:
                wire += te[last - 1] - tb[first]
                have_wire = True
        peaks = [
            r["peak_rss_by_rate"][k]
            for r in ranks.values()
            if r.get("peak_rss_by_rate") and len(r["peak_rss_by_rate"]) > k and r["peak_rss_by_rate"][k]
        ]
        out["rates"][rate] = {
            "step_s": statistics.median(times) if times else None,
            "step_times_s": times,
            "step_s_metrics_file": statistics.median(own) if own else None,
            "wire_bytes_per_rank_per_step": wire / (last - first) / WORLD if have_wire else None,
            "peak_rss_mb_max": max(peaks) / 2**20 if peaks else None,
            "peak_rss_mb_mean": sum(peaks) / len(peaks) / 2**20 if peaks else None,
            "loss_last": ranks[0]["losses"][last - 1] if len(ranks[0]["losses"]) >= last else None,
        }
    out["maxrss_lifetime_mb"] = max(r.get("maxrss_lifetime", 0) for r in ranks.values()) / 2**20
    return out


# ---------------------------------------------------------------- report


def fmt(v, spec: str, na: str = "n/a") -> str:
    return na if v is None else format(v, spec)


def print_tables(results: dict, rate_list: list[str], names: list[str], netns: bool) -> dict:
    ratios = {}
    for rate in rate_list:
        shaped = "unshaped" if parse_rate(rate) is None else f"tbf {rate} on the cross-node veth"
        if not netns:
            shaped = "NOT shaped: loopback, no namespaces"
        print(f"\n== {rate} ({shaped}) ==")
        head = (
            f"{'system':32} {'step s':>7} {'x-node MB/rank/step':>20} {'peak MB':>8} {'loss@end':>8} | speedup vs "
            + " ".join(f"{lab:>7}" for _, lab in REFERENCES)
        )
        print(head)
        print(f"{'':32} {'':>7} {'ledger':>9} {'wire':>10} {'per rank':>8} {'':>8} |")
        print("-" * len(head))
        ratios[rate] = {}
        for name in names:
            res = results[name]
            label = SYSTEMS[name][0]
            if res["status"] != "ok":
                print(f"{label:32} {res['status']}: {res['reason']}")
                continue
            r = res["rates"][rate]
            led = res.get("ledger_bytes_per_rank_per_step")
            row_ratios = {}
            cells = []
            for ref, _ in REFERENCES:
                rr = results.get(ref, {})
                t = rr.get("rates", {}).get(rate, {}).get("step_s") if rr.get("status") == "ok" else None
                row_ratios[ref] = t / r["step_s"] if t and r["step_s"] else None
                cells.append(fmt(row_ratios[ref], "7.2f"))
            ratios[rate][name] = row_ratios
            wire = r["wire_bytes_per_rank_per_step"]
            print(
                f"{label:32} {fmt(r['step_s'], '7.2f')} {fmt(led and led['inter_node'] / 1e6, '9.1f', '-'):>9} "
                f"{fmt(wire and wire / 1e6, '10.1f'):>10} {fmt(r['peak_rss_mb_max'], '8.0f')} "
                f"{fmt(r['loss_last'], '8.4f')} | " + " ".join(cells)
            )
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring for details.")
    ap.add_argument(
        "--rates",
        nargs="+",
        default=None,
        help="link rates, each 'unshaped' or like 1gbit / 200mbit (default: unshaped 1gbit 200mbit)",
    )
    ap.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS), help="default: all but ds-hpz-default")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 3 steps, 1gbit only (< 2 min)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per rate (default 3; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before the first rate (>= 1)")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--num-attention-heads", type=int, default=None)
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--run-timeout", type=float, default=None, help="seconds per system launch (default 600; quick 120)"
    )
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=2**20,
        help="MALLOC_MMAP_THRESHOLD_ of every rank, so that glibc returns freed buffers above it at once "
        "and peak RSS counts live memory (0: glibc's default, which keeps freed gather buffers)",
    )
    ap.add_argument("--no-netns", action="store_true", help="run on loopback without namespaces or shaping")
    ap.add_argument("--no-path-check", action="store_true", help="skip the socket check of the two paths")
    ap.add_argument("--work-dir", default=None, help="keep logs, metrics and probes here (default: a temp dir)")
    a = ap.parse_args()
    q = a.quick
    a.rates = a.rates or (["1gbit"] if q else ["unshaped", "1gbit", "200mbit"])
    a.steps = a.steps or (2 if q else 3)
    a.warmup = max(1, a.warmup)
    a.num_layers = a.num_layers or (2 if q else 8)
    a.hidden_size = a.hidden_size or (128 if q else 512)
    a.num_attention_heads = a.num_attention_heads or (4 if q else 8)
    a.seq_length = a.seq_length or (64 if q else 256)
    a.run_timeout = a.run_timeout or (120 if q else 600)
    names = a.systems or DEFAULT_SYSTEMS
    for r in a.rates:
        parse_rate(r)
    work = a.work_dir or tempfile.mkdtemp(prefix="zpp_zero_bench_")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    lock_fd = take_lock()

    ds_reason = None
    if any(SYSTEMS[n][1] == "ds" for n in names):
        ds_reason = ensure_ds_venv()
        if ds_reason:
            log(f"DeepSpeed unavailable: {ds_reason}")

    sys.path.insert(0, ROOT)
    from megatron_zpp.config import ModelConfig
    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.model import GPT, count_parameters

    mcfg = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        seq_length=a.seq_length,
        vocab_size=a.vocab_size,
    )
    params = count_parameters(GPT(mcfg, pad_vocab_size(a.vocab_size, mcfg.make_vocab_size_divisible_by, 1)))

    cluster = Cluster(not a.no_netns, lock_fd)
    results, paths = {}, {}
    try:
        if cluster.netns and not a.no_path_check:
            paths = cluster.check_paths(parse_rate(a.rates[0]) or 1e9)
            log(f"path check ({a.rates[0] if parse_rate(a.rates[0]) else '1gbit'} shaping): {paths}")
        for name in names:
            label, kind, opts = SYSTEMS[name]
            if kind == "skip":
                results[name] = {"status": "not run", "reason": opts}
                continue
            log(f"{label}: {a.warmup} warmup + {len(a.rates)} rate(s) x {a.steps} timed steps")
            results[name] = launch(cluster, name, kind, opts, a, a.rates, work, ds_reason)
            res = results[name]
            log(
                f"{label}: {res['status']}"
                + (
                    f" ({res['reason']})"
                    if res.get("reason")
                    else f" in {res['wall_s']:.0f} s: "
                    + ", ".join(f"{r} {fmt(v['step_s'], '.2f')} s/step" for r, v in res["rates"].items())
                )
            )
        qdisc = cluster.qdisc()
    finally:
        cluster.cleanup()

    if cluster.netns:
        print(
            f"\nZeRO on an emulated 2-node cluster: {WORLD} ranks = 2 network namespaces x {PER_NODE}, veth + tc "
            f"tbf between the nodes, loopback inside each"
        )
    else:
        print(
            f"\nZeRO on ONE loopback host ({cluster.reason}): {WORLD} ranks, nothing shaped; ours still lays "
            f"out {PER_NODE} ranks per node for its ledger"
        )
    print(
        f"model: Llama-style GPT {params / 1e6:.2f}M params (hidden {a.hidden_size}, {a.num_layers} layers, "
        f"{a.num_attention_heads} heads, seq {a.seq_length}, vocab {a.vocab_size}), fp32, micro-batch "
        f"{a.micro_batch_size} x {WORLD} ranks = global batch {a.micro_batch_size * WORLD}; same weights and tokens "
        f"for every system"
    )
    print(
        f"one launch per system: {a.warmup} warmup step(s), then {a.steps} timed steps (median) per rate; "
        f"4 ranks share {os.cpu_count()} CPU cores "
        f"at 1 thread each (OMP_NUM_THREADS=1): absolute times are this machine's, the ratios are the figure"
    )
    print(
        "x-node MB/rank/step: ledger = our comm ledger (a collective spanning nodes counts whole), wire = veth "
        "tx bytes of both nodes / 4 ranks (headers included); peak MB = max over ranks of the peak RSS in the "
        "timed steps; speedup = reference step time / this step time"
    )
    if paths:
        print(
            f"path check: cross-node {paths['cross_node']['mbit_per_s']:.0f} Mbit/s, intra-node "
            f"{paths['intra_node']['mbit_per_s']:.0f} Mbit/s with {paths['intra_node']['veth_tx_mb']:.2f} MB on "
            f"the veth (intra-node traffic stays off the shaped link)"
        )
    ratios = print_tables(results, a.rates, names, cluster.netns)
    if any(n.startswith("ds-") for n in names):
        print(
            "\nDeepSpeed ZeRO-3 uses its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9): "
            "a model this small stays gathered from forward to backward (no backward all-gather, more memory); "
            "'regather' sets both to 0, the paper's ZeRO-3 (3M per step), which hpZ needs to act"
        )
    noisy = [
        f"{SYSTEMS[n][0]} at {rate} ({min(v['step_times_s']):.2f}..{max(v['step_times_s']):.2f} s)"
        for n in names
        if results[n]["status"] == "ok"
        for rate, v in results[n]["rates"].items()
        if v["step_times_s"] and max(v["step_times_s"]) > 1.25 * min(v["step_times_s"])
    ]
    if noisy:
        print(
            f"\nWARNING: noisy timing (timed steps differ by > 25%; other processes share the {os.cpu_count()} "
            f"cores?): " + "; ".join(noisy)
        )
    print(f"\nlogs: {work}; elapsed {time.time() - t0:.0f} s; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(
        json.dumps(
            {
                "bench": "zero",
                "netns": cluster.netns,
                "no_netns_reason": cluster.reason or None,
                "qdisc_last": qdisc if cluster.netns else None,
                "path_check": paths,
                "rates": a.rates,
                "params": params,
                "config": {k: v for k, v in vars(a).items() if k != "systems"},
                "systems": {n: {"label": SYSTEMS[n][0], **results[n]} for n in names},
                "speedup": ratios,
                "noisy": noisy,
                "cpus": os.cpu_count(),
                "torch_threads_per_rank": 1,
                "elapsed_s": round(time.time() - t0, 1),
                "work_dir": work,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
