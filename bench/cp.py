"""Context parallelism for gated linear attention: ZeCO's All-Scan vs all-gather vs ring vs no communication.

    .venv/bin/python bench/cp.py --quick            (P = 2, 4 on loopback, few iterations, < 60 s)
    sudo .venv/bin/python bench/cp.py               (P = 2, 4, 8 on loopback and on the shaped link, < 10 min)
    .venv/bin/python bench/cp.py --no-netns --ps 2 4 8 --heads 8 --head-k 128 --head-v 256 --t-local 128

What is timed: the GLA operator alone (megatron_zpp.context_parallel.gla_context_parallel), forward +
backward with autograd (loss = o.sum()), on each rank's contiguous slice of the sequence: B = 1, H heads,
key/value head dims K, V, T_local tokens per rank (weak scaling as in the ZeCO paper: the sequence is
P * T_local), fp32, chunk size --chunk-size. A state is B*H*K*V*4 bytes (default 8*128*256*4 = 1 MiB).
Variants, every one on the same tensors:
  ideal        chunk_gla_local on the local slice from a zero state: no communication (the lower bound)
  all-scan     ZeCO All-Scan, blocks = 1 (one state per rank each way, a chain over the ranks)
  all-scan K   All-Scan pipelined over K blocks of the state (--blocks, default 4): ZeCO's algorithm
  all-gather   LASP-2: every rank all-gathers every state ((P-1) states per rank each way)
  ring         LASP-1: serial ring of whole states
One time sample = a barrier, then forward + backward on every rank; the sample is the slowest rank's
time; the figure is the median over --iters samples after --warmup (variants interleaved per iteration,
so a load change hits all alike). Overhead = time / ideal - 1. The ledger (megatron_zpp.comm.LEDGER)
gives the bytes each rank sends per forward + backward (ring model for the all-gather; busiest rank),
also in units of one state: All-Scan 1 + 1 whatever P, all-gather (P-1) + (P-1).

Settings: "loopback": tests/dist.py's run_distributed, all ranks on this host. "shaped": the emulated
2-node cluster of bench/cluster.py (shared with bench/zero.py: namespaces zpp_n0/zpp_n1, veth, tc tbf at --rate on both
veth ends), P/2 ranks per namespace, launched here with MASTER_ADDR = node 0's veth address and
GLOO_SOCKET_IFNAME = the namespace's veth; only the hop between rank P/2-1 and P/2 crosses the shaped
link (the all-gather ring crosses it twice). Needs root and iproute2, else it is skipped with the reason.
All P ranks run at 1 thread each on this machine's cores (2 here): at P = 8 four ranks time-share a core,
and the ideal suffers the same sharing, so absolute times are this machine's and the overhead % and the
ratios are the figures. Tables: one per setting (times, overheads, All-Scan speedups), then one laid out
like ZeCO's All-Scan vs all-gather table (rows P). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.cluster import ADDRS, VETHS, Cluster, parse_rate, take_lock  # noqa: E402
from tests.dist import run_distributed  # noqa: E402


def variants(blocks: int) -> list[tuple[str, str | None, int]]:
    """(name, algorithm or None for the ideal, blocks)."""
    return [
        ("ideal", None, 1),
        ("all-scan", "all-scan", 1),
        (f"all-scan K={blocks}", "all-scan", blocks),
        ("all-gather", "all-gather", 1),
        ("ring", "ring", 1),
    ]


# ---------------------------------------------------------------- one rank


def measure(rank: int, world: int, cfg: dict) -> dict:
    """Time every variant on this rank; return {"times": {name: [s]}, "ledger": {name: {fwd, bwd}}}."""
    from megatron_zpp import comm
    from megatron_zpp.context_parallel import gla_context_parallel
    from megatron_zpp.ops.gla import chunk_gla_local
    from megatron_zpp.topology import Topology, build_groups

    torch.set_num_threads(1)
    cp = build_groups(Topology(world, cp=world, ranks_per_node=cfg["per_node"]), rank).cp
    gen = torch.Generator().manual_seed(1234 + rank)
    B, T, H, K, V = 1, cfg["t_local"], cfg["heads"], cfg["head_k"], cfg["head_v"]
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / 16  # log decay <= 0
    leaves = [x.requires_grad_() for x in (q, k, v, g)]

    def step(algo, blocks):
        for x in leaves:
            x.grad = None
        if algo is None:
            o = chunk_gla_local(q, k, v, g, chunk_size=cfg["chunk"])[0]
        else:
            o = gla_context_parallel(q, k, v, g, cp, algo, blocks, chunk_size=cfg["chunk"])
        o.sum().backward()

    ledger = {}
    for name, algo, blocks in variants(cfg["blocks"]):  # one call each for the ledger (also a warmup)
        comm.LEDGER.reset()
        step(algo, blocks)
        rows = comm.LEDGER.local_rows()
        ledger[name] = {d: sum(r["bytes"] for r in rows if r["phase"].endswith("_" + d)) for d in ("fwd", "bwd")}
    times = {name: [] for name, _, _ in variants(cfg["blocks"])}
    for it in range(cfg["warmup"] + cfg["iters"]):
        for name, algo, blocks in variants(cfg["blocks"]):
            dist.barrier()
            t = time.perf_counter()
            step(algo, blocks)
            if it >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t)
    return {"times": times, "ledger": ledger}


def worker_main(out_path: str, cfg_json: str) -> None:
    """Entry point of a rank launched by `launch_shaped` (env:// rendezvous)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = measure(rank, world, json.loads(cfg_json))
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- launchers


def launch_shaped(cluster: Cluster, world: int, cfg: dict, work: str, timeout: float) -> list[dict]:
    """P/2 ranks in each namespace of the cluster; returns each rank's `measure` result."""
    out_dir = tempfile.mkdtemp(prefix=f"p{world}_", dir=work)
    env = {
        **os.environ,
        "MASTER_ADDR": ADDRS[0],
        "MASTER_PORT": str(29650 + world),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    procs = []
    for r in range(world):
        node = r // (world // 2)
        log = open(os.path.join(out_dir, f"rank{r}.log"), "w")
        p = subprocess.Popen(
            cluster.prefix(node)
            + [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                os.path.join(out_dir, f"rank{r}.json"),
                json.dumps(cfg),
            ],
            env={**env, "RANK": str(r), "GLOO_SOCKET_IFNAME": VETHS[node]},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        log.close()
        procs.append(p)
        cluster.children.append(p)  # cluster.cleanup() ends them whatever happens
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    failed = [r for r, p in enumerate(procs) if p.poll() != 0]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        cluster.children.remove(p)
    if failed:
        tail = open(os.path.join(out_dir, f"rank{failed[0]}.log"), errors="replace").read().strip()[-1500:]
        raise RuntimeError(f"shaped P={world}: rank {failed[0]} failed or timed out ({timeout:.0f} s):\n{tail}")
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]


# ---------------------------------------------------------------- report


def summarize(per_rank: list[dict], cfg: dict) -> dict:
    """Median over iterations of the slowest rank's time; overheads; All-Scan speedups; ledger."""
    state = cfg["heads"] * cfg["head_k"] * cfg["head_v"] * 4
    out = {}
    for name in per_rank[0]["times"]:
        samples = [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        led = {d: max(r["ledger"][name][d] for r in per_rank) for d in ("fwd", "bwd")}
        out[name] = {
            "ms": 1e3 * statistics.median(samples),
            "samples_ms": [round(1e3 * s, 2) for s in samples],
            "ledger_bytes_max_rank": led,
            "ledger_states_max_rank": {d: b / state for d, b in led.items()},
        }
    ideal = out["ideal"]["ms"]
    for v in out.values():
        v["overhead_pct"] = 100 * (v["ms"] / ideal - 1)
        v["comm_ms"] = v["ms"] - ideal
    scan = out[f"all-scan K={cfg['blocks']}"]["ms"]
    out["speedup"] = {
        "all-scan K=1 vs all-gather": out["all-gather"]["ms"] / out["all-scan"]["ms"],
        f"all-scan K={cfg['blocks']} vs all-gather": out["all-gather"]["ms"] / scan,
        "all-scan K=1 vs ring": out["ring"]["ms"] / out["all-scan"]["ms"],
        f"all-scan K={cfg['blocks']} vs ring": out["ring"]["ms"] / scan,
    }
    return out


def print_setting(title: str, res: dict, cfg: dict) -> None:
    kb = f"all-scan K={cfg['blocks']}"
    print(f"\n== {title}: forward+backward ms (median of the slowest rank), overhead vs ideal in % ==")
    head = (
        f"{'P':>2} {'ideal':>8} | {'all-scan':>16} | {kb:>16} | {'all-gather':>16} | {'ring':>16} | "
        f"{'speedup vs all-gather':>21} | {'speedup vs ring':>15}"
    )
    print(head)
    print(
        f"{'':>2} {'ms':>8} | {'ms (ovh %)':>16} | {'ms (ovh %)':>16} | {'ms (ovh %)':>16} | {'ms (ovh %)':>16} | "
        f"{'K=1':>10} {'K=' + str(cfg['blocks']):>10} | {'K=1':>7} {'K=' + str(cfg['blocks']):>7}"
    )
    print("-" * len(head))
    for P, r in res.items():
        cell = lambda n: f"{r[n]['ms']:8.1f} ({r[n]['overhead_pct']:+5.1f})"  # noqa: E731
        s = r["speedup"]
        print(
            f"{P:>2} {r['ideal']['ms']:8.1f} | {cell('all-scan'):>16} | {cell(kb):>16} | {cell('all-gather'):>16} | "
            f"{cell('ring'):>16} | {s['all-scan K=1 vs all-gather']:10.2f} {s[kb + ' vs all-gather']:10.2f} | "
            f"{s['all-scan K=1 vs ring']:7.2f} {s[kb + ' vs ring']:7.2f}"
        )


def zeco_table(results: dict, cfg: dict) -> dict:
    """Rows P; All-Scan (pipelined, K blocks) vs all-gather: layer time and communication time (over ideal)."""
    kb = f"all-scan K={cfg['blocks']}"
    print(f"\n== like ZeCO's table: All-Scan ({kb}) vs all-gather (LASP-2), GLA layer forward+backward ==")
    print("   time = layer ms; comm = layer ms - ideal ms (the communication and waiting the scan adds)")
    table = {}
    for setting, res in results.items():
        print(f"\n   {setting}")
        head = (
            f"   {'P':>2} {'all-gather ms':>13} {'All-Scan ms':>11} {'ratio':>6} | {'all-gather comm':>15} "
            f"{'All-Scan comm':>13} {'ratio':>6}"
        )
        print(head + "\n   " + "-" * (len(head) - 3))
        table[setting] = {}
        for P, r in res.items():
            ag, sc = r["all-gather"], r[kb]
            ratio_comm = ag["comm_ms"] / sc["comm_ms"] if sc["comm_ms"] > 0 and ag["comm_ms"] > 0 else None
            table[setting][P] = {
                "all_gather_ms": ag["ms"],
                "all_scan_ms": sc["ms"],
                "ratio": ag["ms"] / sc["ms"],
                "all_gather_comm_ms": ag["comm_ms"],
                "all_scan_comm_ms": sc["comm_ms"],
                "comm_ratio": ratio_comm,
            }
            rc = f"{ratio_comm:6.2f}" if ratio_comm is not None else f"{'n/a':>6}"
            print(
                f"   {P:>2} {ag['ms']:13.1f} {sc['ms']:11.1f} {ag['ms'] / sc['ms']:6.2f} | {ag['comm_ms']:15.1f} "
                f"{sc['comm_ms']:13.1f} {rc}"
            )
    return table


def print_ledger(res: dict, cfg: dict) -> None:
    state = cfg["heads"] * cfg["head_k"] * cfg["head_v"] * 4
    print(
        f"\n== ledger (comm.LEDGER): bytes the busiest rank sends per forward+backward, in states of "
        f"{state / 2**20:.2f} MiB, forward + backward =="
    )
    print(f"{'':16}" + "".join(f"{'P=' + str(P):>16}" for P in res))
    for name in next(iter(res.values())):
        if name in ("ideal", "speedup"):
            continue
        cells = [res[P][name]["ledger_states_max_rank"] for P in res]
        print(f"{name:16}" + "".join(f"{c['fwd']:7.2f} +{c['bwd']:6.2f}" for c in cells))
    print("   (all-gather forward also carries the P-1 gammas: (P-1) * (1 + 1/V) states)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring.")
    ap.add_argument("--quick", action="store_true", help="P = 2, 4 on loopback, few iterations (< 60 s)")
    ap.add_argument("--ps", type=int, nargs="+", default=None, help="CP sizes (even; default 2 4 8, quick 2 4)")
    ap.add_argument("--rate", default="1gbit", help="shaped link rate, e.g. 1gbit or 200mbit (default 1gbit)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: no namespaces, no shaping")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-k", type=int, default=128)
    ap.add_argument("--head-v", type=int, default=256)
    ap.add_argument("--t-local", type=int, default=128, help="tokens per rank (weak scaling)")
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4, help="All-Scan pipeline blocks of the second all-scan column")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 15, quick 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations after the ledger call")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "CFG"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(*a.worker)
        return 0
    ps = a.ps or ([2, 4] if a.quick else [2, 4, 8])
    if any(P < 2 or P % 2 for P in ps):
        raise SystemExit("error: --ps: each P must be even and >= 2 (P/2 ranks per emulated node)")
    bits = parse_rate(a.rate)
    cfg = {
        "heads": a.heads,
        "head_k": a.head_k,
        "head_v": a.head_v,
        "t_local": a.t_local,
        "chunk": a.chunk_size,
        "blocks": a.blocks,
        "iters": a.iters or (5 if a.quick else 15),
        "warmup": a.warmup,
    }
    t0, load0 = time.time(), os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="zpp_cp_bench_")
    results, skipped, lock_fd = {"loopback": {}}, None, None
    if a.quick or a.no_netns:
        skipped = "--quick" if a.quick else "--no-netns"
    else:  # bench/cluster.py's lock: one emulated cluster (and one bench on the cores) at a time
        try:
            lock_fd = take_lock()
        except SystemExit as e:
            skipped = str(e)
    for P in ps:
        print(f"[cp-bench] loopback P={P}", file=sys.stderr, flush=True)
        results["loopback"][P] = summarize(run_distributed(measure, P, {**cfg, "per_node": P}, timeout=a.timeout), cfg)
    if lock_fd is not None:
        cluster = Cluster(True, lock_fd)
        try:
            if not cluster.netns:
                skipped = cluster.reason
            else:
                cluster.shape(bits)
                key = f"shaped {a.rate}"
                results[key] = {}
                qdisc = cluster.qdisc()
                try:
                    for P in ps:
                        print(f"[cp-bench] {key} P={P}", file=sys.stderr, flush=True)
                        results[key][P] = summarize(
                            launch_shaped(cluster, P, {**cfg, "per_node": P // 2}, work, a.timeout), cfg
                        )
                except RuntimeError as e:  # report the loopback figures anyway
                    print(f"[cp-bench] {e}", file=sys.stderr, flush=True)
                    skipped = f"failed: {str(e).splitlines()[0]}"
                    results.pop(key)
        finally:
            cluster.cleanup()

    state = cfg["heads"] * cfg["head_k"] * cfg["head_v"] * 4
    print(
        f"\nGLA context parallelism: B=1, H={a.heads}, K={a.head_k}, V={a.head_v}, T_local={a.t_local} tokens per "
        f"rank (sequence = P * {a.t_local}), chunk {a.chunk_size}, fp32, forward+backward (loss = o.sum()); "
        f"state = {state / 2**20:.2f} MiB"
    )
    print(
        f"median of {cfg['iters']} samples after {1 + cfg['warmup']} warmup call(s); sample = slowest rank; "
        f"P ranks at 1 thread each time-share {os.cpu_count()} cores (the ideal too): the overheads and ratios "
        f"are the figures"
    )
    if load0 > (os.cpu_count() or 1):  # at the start: our own ranks count in the load later
        print(
            f"WARNING: machine loaded (1-min load {load0:.1f} on {os.cpu_count()} cores): a rank blocked on a receive "
            f"waits for a core when it wakes, which inflates every communicating variant (not the ideal) and "
            f"the spread of the samples; compare the ratios, and rerun on an idle machine for the overheads"
        )
    if skipped:
        print(f"shaped setting not run: {skipped}")
    else:
        print(f"shaped: 2 namespaces x P/2 ranks, tc tbf {a.rate} on the veth ({qdisc})")
    for setting, res in results.items():
        print_setting(setting, res, cfg)
    table = zeco_table(results, cfg)
    print_ledger(results["loopback"], cfg)
    print(f"\nelapsed {time.time() - t0:.0f} s; 1-min load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(
        json.dumps(
            {
                "bench": "cp",
                "config": {**cfg, "ps": ps, "rate": a.rate, "state_bytes": state},
                "shaped_skipped": skipped,
                "cpus": os.cpu_count(),
                "torch_threads_per_rank": 1,
                "settings": {s: {str(P): r for P, r in res.items()} for s, res in results.items()},
                "zeco_table": {s: {str(P): r for P, r in t.items()} for s, t in table.items()},
                "elapsed_s": round(time.time() - t0, 1),
                "loadavg": [load0, os.getloadavg()[0]],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
