"""Context parallelism for gated linear attention: ZeCO's All-Scan vs LASP-2 all-gather vs LASP-1 ring vs ideal.

    .venv/bin/python bench/cp.py --quick        (smoke test: P = 2, 4 on loopback, T_local 1024, 2 iterations, < 2 min)
    sudo .venv/bin/python bench/cp.py           (P = 2, 4, 8 on loopback and on the shaped link, ~20 min on 2 cores)
    .venv/bin/python bench/cp.py --no-netns --ps 2 4 --blocks 8 --iters 4
    sudo .venv/bin/python bench/cp.py --mixer gdn --ps 4 8    (Gated DeltaNet, K = V = 128: All-Scan vs all-gather)
    .venv/bin/python bench/cp.py --mixer kda --no-netns --ps 2   (Kimi Delta Attention: the operator's own cost)

--mixer gdn / kda run the same rows on Gated DeltaNet's / Kimi Delta Attention's operator
(context_parallel/delta_rule.py): ideal = chunk_gdn / chunk_kda on the slice, the operator =
delta_rule_context_parallel (the plain local pass and a K x K transition pass for (U, M, r); the scan waits for
(U, M), so the overhead target is GLA's only; its own target: the no-comm op at most 1.3x the ideal, wall and CPU
time), the all-gather = fla's KCP exchange ((U, M): (P-1) x (1 + K/V) states forward), All-Scan's blocks cut
along V; All-Scan against the all-gather at every P > 2.

Shape: B = 1, H = 8 heads, K = 128, V = 256, T_local = 2048 tokens per rank in chunks of 64 (32 a rank), fp32; weak
scaling as in the ZeCO paper (the sequence is P * T_local). A state is B*H*K*V*4 = 1 MiB. 2048 x 64 is the smallest
point of the long-sequence regime (>= 2048 tokens and >= 16 chunks per rank, where the local work can hide the scan):
one rank's forward+backward is ~1 s on one core (GLA; KDA ~0.7 s, GDN ~0.3 s at V = 128), the CP operator's 1.0-1.1x
that; the default run (6 rows x 7 calls x P = 2, 4, 8, two settings) takes ~20 min, T_local 4096 twice that.

Rows, every one on the same tensors (each rank its own slice, the same seed in every row):
  ideal          chunk_gla_local on the slice from a zero state: the local pass only, no communication
  no-comm op     the CP operator (context_parallel.gla.ContextParallelGLA) on a scan that sends nothing and
                 returns zero states: its own arithmetic (the local pass in two parts, the state correction
                 and its gradients, the background thread) without communication; not an algorithm
  all-scan K=1   ZeCO All-Scan in one block: the state chain without pipelining
  all-scan auto  All-Scan with blocks=0, i.e. K = context_parallel.auto_blocks (printed per P and link):
                 what the model runs; the targets are judged on this row
  all-scan K=n   All-Scan in --blocks n blocks (only when --blocks is given)
  all-gather     LASP-2: every rank all-gathers every state ((P-1) states per rank each way)
  ring           LASP-1: serial ring of whole states
What is measured, on every rank, all rows interleaved in every iteration (a load change hits all alike):
  e2e         the operator: dist.barrier(), then gla_context_parallel forward + backward (loss o.sum(),
              autograd; the scan runs in its background thread under the local work), wall time; and
              the process's CPU time (time.process_time: on a shared machine the arithmetic's own cost)
  comm-only   the scan alone: the same scan object the operator builds (context_parallel.scans.make_scan:
              AllScan(cp, K), GatherScan, RingScan) on random states of the operator's sizes (S_loc and
              dS_corr [B,H,K,V] fp32, log gamma [B,H,K]): dist.barrier(), scan.forward, dist.barrier(),
              scan.backward, each timed; --comm-reps repetitions per iteration. It includes the scan's own
              arithmetic (the chain's adds, LASP-2's local scan over ranks) and no GLA compute.
The block choice: per P and setting, the chain's per-message host cost fitted from the comm-only rows (All-Scan at
each K and the ring, forward and backward) against context_parallel/chain.py's model on the calibrated links, and the
K that model then picks (fit_chain); the emulated preset's measured["cp_chain"]["msg_s"] (what auto_blocks reads on
CPU) comes from this line.
Statistics: an e2e sample is the slowest rank's time in one iteration; a comm-only sample is the slowest
rank's forward plus the slowest rank's backward of one repetition; figures are medians over --iters
iterations after the ledger call (the first, untimed call of every row) and --warmup. overhead = e2e / ideal
- 1 (medians): the target's figure, which holds the operator's own arithmetic (the no-comm op row's overhead)
and the communication left exposed. exposed = median over iterations of (row - no-comm op) in the same
iteration, with its interquartile range (the noise): the communication and waiting the overlap did not hide.
The overlap shows where exposed is below comm-only by more than that noise; where comm-only is inside the
noise it cannot show. The ledger (megatron_zpp.comm.LEDGER) gives the bytes the busiest rank
sends per forward + backward, in states: All-Scan 1 + 1 whatever P, all-gather (P-1) + (P-1).

Every rank flushes subnormal floats to zero, as training on CPU does (training/distributed.py): a decaying state
passes through them, and on x86 each costs ~100x (GDN's operator ran 5x slower without it).
Settings: "loopback": megatron_zpp/testing/dist.py's run_distributed, all ranks on this host. "shaped": the emulated
2-node cluster of megatron_zpp/testing/cluster.py (shared with bench/zero.py: namespaces zpp_n0/zpp_n1, veth, tc tbf at
--rate on both veth ends), P/2 ranks per namespace, MASTER_ADDR = node 0's veth address, GLOO_SOCKET_IFNAME
= the namespace's veth; only the hop between ranks P/2-1 and P/2 crosses the shaped link (the all-gather
ring crosses it twice). Needs root and iproute2, else it is skipped with the reason. Every rank runs at 1
thread: at P = 2 on 2 cores one rank per core (the honest figure); at P = 4, 8 ranks share cores (rows
labelled "shared cores"), the ideal too, so absolute times are this machine's and the ratios the figures.
Targets (printed with whether met; nothing is tuned to them): All-Scan (auto) overhead over the ideal <= 5%
at P = 2 and 4, loopback and shaped; All-Scan faster than the all-gather at every P > 2 (judged on e2e and,
separately, on comm-only). Then a table laid out like ZeCO's All-Scan vs all-gather table (rows P). The
last stdout line is one JSON object.
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

import torch
import torch.distributed as dist

from megatron_zpp import comm
from megatron_zpp.testing.cluster import ADDRS, VETHS, Cluster, parse_rate, take_lock
from megatron_zpp.testing.cp_operators import DELTA_RULE, NO_COMM, make_inputs, run_operator
from megatron_zpp.testing.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AUTO = "all-scan auto"  # the row the targets judge: what gla_context_parallel runs by default
DELTA_COST_TARGET = 1.3  # GDN's and KDA's CP operator against the plain local pass (issue 41)
OVERHEAD_TARGET_PCT, OVERHEAD_TARGET_PS = 5.0, (2, 4)


def variants(blocks: int | None) -> list[tuple[str, str | None, int]]:
    """(row name, algorithm (None: the ideal, NO_COMM: the operator on a silent scan), all-scan blocks; 0 = auto)."""
    rows = [("ideal", None, 0), ("no-comm op", NO_COMM, 0), ("all-scan K=1", "all-scan", 1), (AUTO, "all-scan", 0)]
    if blocks:
        rows.append((f"all-scan K={blocks}", "all-scan", blocks))
    return rows + [("all-gather", "all-gather", 0), ("ring", "ring", 0)]


def state_bytes(cfg: dict) -> int:
    return cfg["heads"] * cfg["head_k"] * cfg["head_v"] * 4  # B = 1, fp32: what the CP operators compute


def label(cfg: dict) -> str:
    return {"gdn": "Gated DeltaNet", "kda": "Kimi Delta Attention"}.get(cfg["mixer"], "GLA")


def block_extent(cfg: dict) -> int:
    """The state dimension All-Scan's blocks cut: K for GLA, V for GDN and KDA (their M mixes the K rows)."""
    return cfg["head_v"] if cfg["mixer"] in DELTA_RULE else cfg["head_k"]


# ---------------------------------------------------------------- one rank


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of fn() on this rank after a barrier (every rank starts together). CPU time is the
    process's (all its threads): on a shared machine the arithmetic's own cost, without the waits for a core."""
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def ledger_bytes(fn) -> dict:
    """Bytes this rank sends in fn(), forward and backward phases apart."""
    comm.LEDGER.reset()
    fn()
    rows = comm.LEDGER.local_rows()
    return {d: sum(r["bytes"] for r in rows if r["phase"].endswith("_" + d)) for d in ("fwd", "bwd")}


def measure(rank: int, world: int, cfg: dict) -> dict:
    """Every row's e2e times, comm-only (forward, backward) times and ledger bytes on this rank."""
    from megatron_zpp.context_parallel import auto_blocks
    from megatron_zpp.context_parallel.chain import hop_classes, link_table
    from megatron_zpp.context_parallel.scans import make_scan
    from megatron_zpp.topology import Topology, build_groups

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as training on CPU runs (training/distributed.py): subnormals are ~100x slower
    cp = build_groups(Topology(world, cp=world, ranks_per_node=cfg["per_node"]), rank).cp
    x, rows, cpu = make_inputs(cfg, rank), variants(cfg["blocks"]), torch.device("cpu")
    op = {
        name: (lambda a=algo, b=blocks: run_operator(x, cp, a, b, cfg["chunk"], cfg["mixer"]))
        for name, algo, blocks in rows
    }
    # the operator's own factory, so comm-only times the very objects (and block counts) the operator runs
    extent = block_extent(cfg)
    scans = {n: make_scan(a, cp, b, state_bytes(cfg), cpu, extent) for n, a, b in rows if a not in (None, NO_COMM)}
    ledger = {name: ledger_bytes(fn) for name, fn in op.items()}  # one call each: also the first warmup
    times, comm, cpu_s = {name: [] for name in op}, {name: [] for name in scans}, {name: [] for name in op}
    for it in range(cfg["warmup"] + cfg["iters"]):
        keep = it >= cfg["warmup"]
        for name, fn in op.items():
            t, c = timed(fn)
            times[name] += [t] if keep else []
            cpu_s[name] += [c] if keep else []
        for _ in range(cfg["comm_reps"]):
            for name, scan in scans.items():
                f = timed(lambda s=scan: s.forward(x["S"], x["T"], None))[0]
                b = timed(lambda s=scan: s.backward(x["dS"]))[0]
                comm[name] += [(f, b)] if keep else []
    k_auto = auto_blocks(state_bytes(cfg), cp, cpu, extent)
    hops = [[h.alpha, h.bandwidth] for h in map(link_table("cpu").__getitem__, hop_classes(cp))]  # links alone
    return {
        "times": times,
        "cpu": cpu_s,
        "comm": comm,
        "ledger": ledger,
        "k_auto": k_auto,
        "link": cp.link,
        "hops": hops,
    }


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
    env = {**os.environ, "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(29650 + world), "WORLD_SIZE": str(world)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for r in range(world):
        node = r // (world // 2)
        log = open(os.path.join(out_dir, f"rank{r}.log"), "w")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", os.path.join(out_dir, f"rank{r}.json")]
        p = subprocess.Popen(
            cluster.prefix(node) + argv + [json.dumps(cfg)],
            env={**env, "RANK": str(r), "GLOO_SOCKET_IFNAME": VETHS[node]},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        log.close()
        procs.append(p)
        cluster.children.append(p)  # cluster.cleanup() ends them whatever happens
    wait_all(procs, timeout)
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


def wait_all(procs: list, timeout: float) -> None:
    """Until all have ended, one has failed (the others would hang on it), or the deadline."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            return
        time.sleep(0.2)


# ---------------------------------------------------------------- report


def iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def slowest(per_rank: list[dict], name: str, what: str = "times") -> list[float]:
    """Per iteration, the slowest rank's e2e time (s), or its CPU time (what="cpu")."""
    return [max(ts) for ts in zip(*(r[what][name] for r in per_rank))]


def slowest_comm(per_rank: list[dict], name: str) -> tuple[list[float], list[float]]:
    """Per repetition, the slowest rank's forward and backward scan times (s)."""
    reps = list(zip(*(r["comm"][name] for r in per_rank)))
    return [max(f for f, _ in rep) for rep in reps], [max(b for _, b in rep) for rep in reps]


def summarize(per_rank: list[dict], cfg: dict) -> dict:
    """Medians of the slowest rank, overheads, exposed time, comm-only time, ledger; per row."""
    ideal, silent = slowest(per_rank, "ideal"), slowest(per_rank, "no-comm op")
    rows = {}
    for name in per_rank[0]["times"]:
        e2e = slowest(per_rank, name)
        led = {d: max(r["ledger"][name][d] for r in per_rank) for d in ("fwd", "bwd")}
        row = {
            "e2e_ms": 1e3 * statistics.median(e2e),
            "samples_ms": [round(1e3 * s, 1) for s in e2e],
            "overhead_pct": 100 * (statistics.median(e2e) / statistics.median(ideal) - 1),
            "cpu_ms": 1e3 * statistics.median(slowest(per_rank, name, "cpu")),
            "ledger_states_max_rank": {d: b / state_bytes(cfg) for d, b in led.items()},
        }
        if name in per_rank[0]["comm"]:  # a real scan: what it left exposed, and its own time
            exposed = [a - b for a, b in zip(e2e, silent)]
            row.update(exposed_ms=1e3 * statistics.median(exposed), exposed_iqr_ms=1e3 * iqr(exposed))
            f, b = slowest_comm(per_rank, name)
            fb = [x + y for x, y in zip(f, b)]
            row.update(comm_ms=1e3 * statistics.median(fb), comm_iqr_ms=1e3 * iqr(fb))
            row.update(comm_fwd_ms=1e3 * statistics.median(f), comm_bwd_ms=1e3 * statistics.median(b))
        rows[name] = row
    sc = slowest(per_rank, AUTO)
    vs = {}  # All-Scan (auto K) against each baseline; paired: the same iteration's samples, one load for both
    for other in ("all-gather", "ring"):
        ot = slowest(per_rank, other)
        vs[other] = {
            "e2e_ratio": rows[other]["e2e_ms"] / rows[AUTO]["e2e_ms"],
            "e2e_wins": sum(a < b for a, b in zip(sc, ot)),
            "iterations": len(sc),
            "paired_pct": 100 * statistics.median(b / a - 1 for a, b in zip(sc, ot)),
            "comm_ratio": rows[other]["comm_ms"] / rows[AUTO]["comm_ms"],
        }
    own = rows["no-comm op"]  # the operator's own arithmetic against the plain local pass, wall and CPU time
    cost = {"wall": own["e2e_ms"] / rows["ideal"]["e2e_ms"], "cpu": own["cpu_ms"] / rows["ideal"]["cpu_ms"]}
    out = {"k_auto": per_rank[0]["k_auto"], "link": per_rank[0]["link"], "rows": rows, "auto_vs": vs}
    return {**out, "operator_cost": cost, "chain": fit_chain(rows, per_rank[0]["hops"], per_rank[0]["k_auto"], cfg)}


def fit_chain(rows: dict, hops: list, k_auto: int, cfg: dict) -> dict:
    """The chain's per-message host cost m, fitted from the comm-only medians of every chain row (All-Scan at
    its K, the ring at K = 1; forward and backward apart) against context_parallel/chain.py's model on the
    links' calibrated alpha and bandwidth: t(K) - T_links(K) = c + (P - 2 + K) m, least squares with m >= 0.
    The intercept c takes what the transfer term gets wrong where the rows hold two or more K; m is then the
    cost of one more block step, what the choice of K turns on (c = 0 with a single K). Also the K the model
    picks with it (what the preset's measured["cp_chain"]["msg_s"] feeds auto_blocks on CPU)."""
    from megatron_zpp.context_parallel.chain import Hop, best_blocks, chain_time

    links, sb = [Hop(a, b) for a, b in hops], state_bytes(cfg)
    points = []  # (P - 2 + K, residual s)
    for name, v in rows.items():
        if "comm_ms" not in v or name == "all-gather":
            continue
        K = k_auto if name == AUTO else 1 if name == "ring" else int(row_k(name, {"k_auto": k_auto}))
        points += [
            (len(links) - 1 + K, t / 1e3 - chain_time(links, sb, K)) for t in (v["comm_fwd_ms"], v["comm_bwd_ms"])
        ]
    m = 0.0
    if len({w for w, _ in points}) > 1:
        mw, mr = statistics.fmean(w for w, _ in points), statistics.fmean(r for _, r in points)
        m = sum((w - mw) * (r - mr) for w, r in points) / sum((w - mw) ** 2 for w, _ in points)
    elif points:
        m = sum(w * r for w, r in points) / sum(w * w for w, _ in points)
    m = max(m, 0.0)
    with_m = [Hop(h.alpha + m, h.bandwidth) for h in links]
    ext = block_extent(cfg)
    return {"msg_s": m, "blocks": best_blocks(with_m, sb, ext), "links_blocks": best_blocks(links, sb, ext)}


def cores_label(P: int) -> str:
    ncpu = os.cpu_count() or 1
    return "1 core per rank" if P <= ncpu else f"shared cores ({P / ncpu:g} ranks/core)"


def row_k(name: str, r: dict) -> str:
    if name == AUTO:
        return str(r["k_auto"])
    return name.split("K=")[1] if "K=" in name else "-"


def print_setting(title: str, res: dict, cfg: dict) -> None:
    print(f"\n== {title}: {label(cfg)} operator forward+backward under CP; ms = median of the slowest rank ==")
    head = (
        f"{'P':>2} {'cores':<28} {'row':<14} {'K':>3} {'e2e ms':>9} {'ovh %':>6} {'exposed ms (IQR)':>18} "
        f"{'comm-only ms = fwd + bwd (IQR)':>32} {'sent (states)':>14}"
    )
    print(head + "\n" + "-" * len(head))
    for P, r in res.items():
        for i, (name, v) in enumerate(r["rows"].items()):
            lead = f"{P:>2} {cores_label(P):<28}" if i == 0 else f"{'':>2} {'':<28}"
            if "comm_ms" not in v:  # the ideal and the no-comm operator
                ovh = f"{v['overhead_pct']:+6.1f}" if name != "ideal" else f"{'-':>6}"
                print(f"{lead} {name:<14} {'-':>3} {v['e2e_ms']:9.1f} {ovh} {'-':>18} {'-':>32} {'-':>14}")
                continue
            exp = f"{v['exposed_ms']:7.1f} ({v['exposed_iqr_ms']:5.1f})"
            com = f"{v['comm_ms']:6.1f} = {v['comm_fwd_ms']:5.1f} + {v['comm_bwd_ms']:5.1f} ({v['comm_iqr_ms']:4.1f})"
            st = v["ledger_states_max_rank"]
            print(
                f"{lead} {name:<14} {row_k(name, r):>3} {v['e2e_ms']:9.1f} {v['overhead_pct']:+6.1f} {exp:>18} "
                f"{com:>32} {st['fwd']:6.2f}+{st['bwd']:<6.2f}"
            )
        cost, ch = r["operator_cost"], r["chain"]
        print(
            f"{'':>31} CP operator's own arithmetic (no-comm op / ideal): wall x{cost['wall']:.3f}, CPU time "
            f"x{cost['cpu']:.3f} (ideal {r['rows']['ideal']['cpu_ms']:.1f} ms CPU)"
        )
        print(
            f"{'':>31} chain per-message host cost fitted from comm-only (context_parallel/chain.py): "
            f"{ch['msg_s'] * 1e3:.2f} ms -> the model picks K={ch['blocks']} (links alone: K={ch['links_blocks']})"
        )
        for other, vs in r["auto_vs"].items():
            print(
                f"{'':>31} all-scan auto vs {other}: e2e x{vs['e2e_ratio']:.3f}, paired median "
                f"{vs['paired_pct']:+.1f}% (faster in {vs['e2e_wins']}/{vs['iterations']} iterations), "
                f"comm-only x{vs['comm_ratio']:.2f}"
            )


def zeco_table(results: dict, cfg: dict) -> dict:
    """Rows P; All-Scan (auto K) vs all-gather: operator time and the scan's own time."""
    name = label(cfg)
    print(f"\n== like ZeCO's table: All-Scan (auto K) vs all-gather, {name} operator forward+backward ==")
    print(
        f"   e2e = operator ms; comm = the scan alone (comm-only ms, no {name} compute); ratio = all-gather / All-Scan"
    )
    table = {}
    for setting, res in results.items():
        print(f"\n   {setting}")
        head = (
            f"   {'P':>2} {'K':>3} {'all-gather e2e':>14} {'All-Scan e2e':>12} {'ratio':>6} | {'all-gather comm':>15} "
            f"{'All-Scan comm':>13} {'ratio':>6}"
        )
        print(head + "\n   " + "-" * (len(head) - 3))
        table[setting] = {}
        for P, r in res.items():
            ag, sc = r["rows"]["all-gather"], r["rows"][AUTO]
            e2e_ratio, comm_ratio = ag["e2e_ms"] / sc["e2e_ms"], ag["comm_ms"] / sc["comm_ms"]
            table[setting][P] = {
                "k": r["k_auto"],
                "all_gather_e2e_ms": ag["e2e_ms"],
                "all_scan_e2e_ms": sc["e2e_ms"],
                "e2e_ratio": e2e_ratio,
                "all_gather_comm_ms": ag["comm_ms"],
                "all_scan_comm_ms": sc["comm_ms"],
                "comm_ratio": comm_ratio,
            }
            print(
                f"   {P:>2} {r['k_auto']:>3} {ag['e2e_ms']:14.1f} {sc['e2e_ms']:12.1f} {e2e_ratio:6.3f} | "
                f"{ag['comm_ms']:15.2f} {sc['comm_ms']:13.2f} {comm_ratio:6.2f}"
            )
    return table


def check_targets(results: dict, cfg: dict) -> list[dict]:
    """Each target with its measured value and whether met. The overhead target is GLA's (its scan hides
    behind the local pass); GDN's and KDA's operator waits for its scan: its own arithmetic has its target."""
    out = []

    def add(what, value, met):
        out.append({"target": what, "value": value, "met": bool(met)})

    for setting, res in results.items():
        for P, r in res.items():
            sc, ag = r["rows"][AUTO], r["rows"]["all-gather"]
            where = f"{setting} P={P} ({cores_label(P)}), K={r['k_auto']}"
            if P in OVERHEAD_TARGET_PS and cfg["mixer"] == "gla":
                ovh, own = sc["overhead_pct"], r["rows"]["no-comm op"]["overhead_pct"]
                value = f"{ovh:+.1f}% (no-comm op {own:+.1f}%, exposed {sc['exposed_ms']:.1f} ms)"
                add(f"{where}: All-Scan overhead over ideal <= {OVERHEAD_TARGET_PCT:g}%", value, ovh <= 5)
            if cfg["mixer"] in DELTA_RULE:
                for what, ratio in r["operator_cost"].items():
                    target = f"{where}: CP operator (no comm) <= {DELTA_COST_TARGET:g}x the plain local pass, {what}"
                    add(target, f"x{ratio:.3f}", ratio <= DELTA_COST_TARGET)
            if P > 2:
                e2e, comm = ag["e2e_ms"] / sc["e2e_ms"], ag["comm_ms"] / sc["comm_ms"]
                add(f"{where}: All-Scan faster than all-gather, e2e", f"all-gather/All-Scan {e2e:.3f}", e2e > 1)
                add(f"{where}: All-Scan faster than all-gather, comm-only", f"all-gather/All-Scan {comm:.2f}", comm > 1)
    return out


def print_targets(targets: list[dict], quick: bool) -> None:
    met = sum(t["met"] for t in targets)
    note = " [--quick: a smoke test at T_local below the targets' regime]" if quick else ""
    print(f"\n== targets: {met}/{len(targets)} met{note} ==")
    for t in targets:
        print(f"   {'MET ' if t['met'] else 'MISS'}  {t['target']}: {t['value']}")


def print_ledger(res: dict, cfg: dict) -> None:
    print(
        f"\n== ledger (comm.LEDGER): states ({state_bytes(cfg) / 2**20:.2f} MiB) the busiest rank sends per "
        f"forward + backward, loopback =="
    )
    print(f"{'':16}" + "".join(f"{'P=' + str(P):>16}" for P in res))
    for name in next(iter(res.values()))["rows"]:
        if name != "ideal":
            cells = [res[P]["rows"][name]["ledger_states_max_rank"] for P in res]
            print(f"{name:16}" + "".join(f"{c['fwd']:7.2f} +{c['bwd']:6.2f}" for c in cells))
    extra = "transitions M: (P-1) * (1 + K/V)" if cfg["mixer"] in DELTA_RULE else "gammas: (P-1) * (1 + 1/V)"
    print(f"   (all-gather forward also carries the P-1 {extra} states)")


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="See the module docstring.")
    ap.add_argument("--quick", action="store_true", help="smoke test: P = 2, 4 on loopback, T_local 1024, 2 iters")
    ap.add_argument("--ps", type=int, nargs="+", default=None, help="CP sizes (even; default 2 4 8, quick 2 4)")
    ap.add_argument("--rate", default="1gbit", help="shaped link rate, e.g. 1gbit or 200mbit (default 1gbit)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only: no namespaces, no shaping")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-k", type=int, default=128)
    ap.add_argument("--head-v", type=int, default=None, help="value head dim (default GLA 256, GDN 128)")
    ap.add_argument("--mixer", choices=["gla", *DELTA_RULE], default="gla", help="the CP operator: GLA, GDN or KDA")
    ap.add_argument("--t-local", type=int, help="tokens per rank (weak scaling; default 2048, quick 1024)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=None, help="add an all-scan row with this many blocks")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 6, quick 2)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed iterations after the ledger call (itself one)")
    ap.add_argument("--comm-reps", type=int, default=5, help="comm-only repetitions per iteration")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "CFG"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def make_cfg(a: argparse.Namespace) -> dict:
    cfg = {
        "heads": a.heads,
        "head_k": a.head_k,
        "head_v": a.head_v or (128 if a.mixer in DELTA_RULE else 256),
        "mixer": a.mixer,
        "t_local": a.t_local or (1024 if a.quick else 2048),
        "chunk": a.chunk_size,
        "blocks": a.blocks,
        "iters": a.iters or (2 if a.quick else 6),
        "warmup": a.warmup,
        "comm_reps": a.comm_reps,
    }
    if cfg["t_local"] % cfg["chunk"]:
        raise SystemExit(f"error: --t-local {cfg['t_local']} is not a multiple of --chunk-size {cfg['chunk']}")
    return cfg


def run_loopback(ps: list[int], cfg: dict, timeout: float) -> dict:
    res = {}
    for P in ps:
        print(f"[cp-bench] loopback P={P}", file=sys.stderr, flush=True)
        res[P] = summarize(run_distributed(measure, P, {**cfg, "per_node": P}, timeout=timeout), cfg)
    return res


def run_shaped(results: dict, ps: list[int], cfg: dict, a: argparse.Namespace, lock_fd: int) -> tuple[str, str]:
    """Adds results['shaped <rate>']; returns (reason it was not run or '', the qdisc)."""
    cluster, work = Cluster(True, lock_fd), tempfile.mkdtemp(prefix="zpp_cp_bench_")
    try:
        if not cluster.netns:
            return cluster.reason, ""
        cluster.shape(parse_rate(a.rate))
        key, qdisc = f"shaped {a.rate}", cluster.qdisc()
        results[key] = {}
        try:
            for P in ps:
                print(f"[cp-bench] {key} P={P}", file=sys.stderr, flush=True)
                per_rank = launch_shaped(cluster, P, {**cfg, "per_node": P // 2}, work, a.timeout)
                results[key][P] = summarize(per_rank, cfg)
        except RuntimeError as e:  # report the loopback figures anyway
            print(f"[cp-bench] {e}", file=sys.stderr, flush=True)
            results.pop(key)
            return f"failed: {str(e).splitlines()[0]}", qdisc
        return "", qdisc
    finally:
        cluster.cleanup()


def print_header(a: argparse.Namespace, cfg: dict, skipped: str, qdisc: str, load0: float) -> None:
    T, C, ncpu = cfg["t_local"], cfg["chunk"], os.cpu_count()
    print(
        f"\n{label(cfg)} context parallelism: B=1, H={a.heads}, K={a.head_k}, V={cfg['head_v']}, "
        f"T_local={T} tokens per rank ({T // C} chunks of {C}; sequence = P * {T}), fp32, forward+backward "
        f"(loss = o.sum()); state = {state_bytes(cfg) / 2**20:.2f} MiB"
    )
    print(
        f"e2e: median of {cfg['iters']} iterations after {1 + cfg['warmup']} warmup call(s); comm-only: median of "
        f"{cfg['iters'] * cfg['comm_reps']} repetitions; sample = slowest rank; 1 thread per rank on {ncpu} cores"
    )
    if load0 > (ncpu or 1) / 2:  # at the start: our own ranks count in the load later
        print(
            f"WARNING: machine busy (1-min load {load0:.1f} on {ncpu} cores): a rank woken from a receive waits "
            f"for a core, which inflates every communicating row (not the ideal) and the spread of the samples"
        )
    print(f"shaped setting not run: {skipped}" if skipped else f"shaped: 2 namespaces x P/2 ranks, tc tbf ({qdisc})")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker_main(*a.worker)
        return 0
    ps = a.ps or ([2, 4] if a.quick else [2, 4, 8])
    if any(P < 2 or P % 2 for P in ps):
        raise SystemExit("error: --ps: each P must be even and >= 2 (P/2 ranks per emulated node)")
    parse_rate(a.rate)  # a bad rate fails before the loopback runs, not after
    cfg, t0, load0 = make_cfg(a), time.time(), os.getloadavg()[0]
    skipped, qdisc, lock_fd = "--quick" if a.quick else "--no-netns" if a.no_netns else "", "", None
    # megatron_zpp/testing/cluster.py's lock: one emulated cluster (and one bench on the cores) at a time
    if not skipped:
        try:
            lock_fd = take_lock()
        except SystemExit as e:
            skipped = str(e)
    results = {"loopback": run_loopback(ps, cfg, a.timeout)}
    if lock_fd is not None:
        skipped, qdisc = run_shaped(results, ps, cfg, a, lock_fd)
    print_header(a, cfg, skipped, qdisc, load0)
    for setting, res in results.items():
        print_setting(setting, res, cfg)
    table = zeco_table(results, cfg)
    print_ledger(results["loopback"], cfg)
    targets = check_targets(results, cfg)
    print_targets(targets, a.quick)
    print(f"\nelapsed {time.time() - t0:.0f} s; 1-min load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    summary = {
        "bench": "cp",
        "config": {**cfg, "ps": ps, "rate": a.rate, "state_bytes": state_bytes(cfg), "quick": a.quick},
        "shaped_skipped": skipped or None,
        "cpus": os.cpu_count(),
        "torch_threads_per_rank": 1,
        "settings": {s: {str(P): r for P, r in res.items()} for s, res in results.items()},
        "zeco_table": {s: {str(P): r for P, r in t.items()} for s, t in table.items()},
        "targets": targets,
        "targets_met": all(t["met"] for t in targets),
        "elapsed_s": round(time.time() - t0, 1),
        "loadavg": [load0, os.getloadavg()[0]],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
