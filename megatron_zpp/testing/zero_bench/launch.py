"""bench/zero.py's launches: one system over every rate on the emulated cluster (one torchrun per
node, the rate gates opened after each reshape), its ranks' probe files read back, and the rounds
over all systems."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time

from megatron_zpp.testing.cluster import REPO_ROOT, Cluster, launched_nodes, parse_rate, start_nodes, stop_nodes
from megatron_zpp.testing.zero_bench.results import collect, combine
from megatron_zpp.testing.zero_bench.systems import NODES, SYSTEMS, last_error, launch_estimate_s, log, runner_command

PORTS = itertools.count(29600)


def rank_env(a, out_dir: str) -> dict:
    """The environment of every rank: one thread, the probe's folder, DeepSpeed on CPU."""
    return {
        **os.environ,
        **({"MALLOC_MMAP_THRESHOLD_": str(a.malloc_mmap_threshold)} if a.malloc_mmap_threshold else {}),
        "OMP_NUM_THREADS": "1",
        "ZPP_PROBE_DIR": out_dir,
        "PYTHONUNBUFFERED": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore::FutureWarning",
        **({"ZPP_GLOO_NATIVE_RS": "1"} if a.gloo_native_reduce_scatter else {}),
        # the ranks import the checkout the bench runs from, whichever one the venv has installed
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
    }


def launch(cluster: Cluster, name: str, a, dtype: str, out_dir: str, ds_reason: str | None, timeout: float) -> dict:
    """Run one system over every rate (one torchrun per node): its figures, or why it failed."""
    cmd, why_not = runner_command(name, a, dtype, out_dir, ds_reason)
    if why_not:
        return {"status": "not available" if SYSTEMS[name][1] == "ours" else "failed", "reason": why_not}
    os.makedirs(out_dir)
    cluster.shape(parse_rate(a.rates[0]))
    open(os.path.join(out_dir, "gate0.open"), "w").close()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    deadline = t_start + timeout
    nodes = range(launched_nodes(cluster, NODES))
    logs = [open(os.path.join(out_dir, f"node{n}.log"), "w") for n in nodes]
    port = next(PORTS)  # a fresh rendezvous port per launch: the last one may linger
    procs = start_nodes(cluster, cmd, rank_env(a, out_dir), logs, NODES, a.per_node, port, cwd=REPO_ROOT)
    timed_out = open_gates(cluster, procs, a.rates, out_dir, deadline, a.world)
    failed_at = None if timed_out else wait_ranks(procs, deadline)
    timed_out = timed_out or failed_at == "timeout"
    stop_nodes(cluster, procs)
    for f in logs:
        f.close()
    wall = time.perf_counter() - t_start
    if timed_out:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s (--run-timeout)", "wall_s": wall}
    text = "".join(open(os.path.join(out_dir, f"node{n}.log"), errors="replace").read() for n in nodes)
    ranks, codes = read_ranks(out_dir, a.world), [p.returncode for p in procs]
    if any(codes) or failed_at is not None or len(ranks) < a.world:
        return {"status": "failed", "reason": last_error(text, codes), "wall_s": wall, "exit_codes": codes}
    timed, iters = len(ranks[0]["step_times"]), a.warmup + a.steps * len(a.rates)
    if timed != iters:
        return {"status": "failed", "reason": f"the probe timed {timed} of {iters} steps", "wall_s": wall}
    loads = [load_start, os.getloadavg()[0]]
    return {"status": "ok", "wall_s": wall, "loadavg": loads, **collect(SYSTEMS[name][1], out_dir, ranks, a)}


def open_gates(cluster: Cluster, procs: list, rates: list[str], out_dir: str, deadline: float, world: int) -> bool:
    """Open the gate of rate k once all ranks wait at it (no traffic in flight), after
    reshaping the link; True if the launch timed out meanwhile."""
    for k in range(1, len(rates)):
        while all(p.poll() is None for p in procs):
            if all(os.path.exists(os.path.join(out_dir, f"gate{k}.rank{r}")) for r in range(world)):
                break
            if time.perf_counter() > deadline:
                return True
            time.sleep(0.05)
        else:
            return False  # a node ended early: wait_ranks reports it
        cluster.shape(parse_rate(rates[k]))
        open(os.path.join(out_dir, f"gate{k}.open"), "w").close()
    return False


def wait_ranks(procs: list, deadline: float) -> float | str | None:
    """Wait for both nodes: None if both ended, "timeout", or the time one failed (the other
    then has 15 s to report before it is stopped: it may hang in gloo)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if now > deadline:
            return "timeout"
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > 15:
            break
        time.sleep(0.1)
    return failed_at


def read_ranks(out_dir: str, world: int) -> dict:
    """{rank: what its probe wrote} for the ranks that wrote it."""
    ranks = {}
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    return ranks


def round_order(names: list[str], rep: int) -> list[str]:
    """Every other round runs the systems in reverse, so that a drift of the machine hits all alike."""
    return names if rep % 2 == 0 else names[::-1]


def summary(res: dict) -> str:
    if res["status"] != "ok":
        return f" ({res['reason']})"
    times = {r: statistics.median(v["step_times_s"]) for r, v in res["rates"].items() if v["step_times_s"]}
    return f" in {res['wall_s']:.0f} s: " + ", ".join(f"{r} {t:.2f} s/step" for r, t in times.items())


def run_all(cluster: Cluster, a, work: str, ds_reason: str | None, params: int, compute: dict) -> dict:
    """{dtype: {system: its rounds combined}}: per dtype, --repeats rounds over the systems."""
    runs = {d: {n: [] for n in a.names} for d in a.dtypes}
    for dtype in a.dtypes:
        for rep in range(a.repeats):
            for name in round_order(a.names, rep):
                label, kind, opts = SYSTEMS[name]
                if kind == "skip":
                    runs[dtype][name].append({"status": "not run", "reason": opts})
                    continue
                timeout = a.run_timeout or max(180.0, 3 * launch_estimate_s(name, dtype, a, params, compute))
                log(f"{dtype} round {rep + 1}/{a.repeats} {label}: {a.warmup} warmup + {len(a.rates)} x {a.steps}")
                out_dir = os.path.join(work, f"{dtype}-r{rep}", name)
                res = launch(cluster, name, a, dtype, out_dir, ds_reason, timeout)
                runs[dtype][name].append(res)
                log(f"{label}: {res['status']}{summary(res)}")
    return {d: {n: combine(rs, a.rates, a.per_node) for n, rs in by_name.items()} for d, by_name in runs.items()}
