"""bench/zero.py's figures: each launch's probe files -> step times, ledger and wire bytes, peak
memory per rate; the repeats combined into one row per system; the speedups and the targets."""

from __future__ import annotations

import json
import os
import statistics

from megatron_zpp.testing.cluster import parse_rate
from megatron_zpp.testing.verdict import INSTALL_FIX, Absent, verdict
from megatron_zpp.testing.zero_bench.systems import BEST_PEER_POOL, HEADLINE, NODES, SYSTEMS


def ledger_bytes(ranks: dict, per_node: int) -> dict | None:
    """Our ledger's bytes per step from each rank's own rows (ours.py writes them): inter-node per
    rank (mean) and per node (the sum over its ranks, mean over nodes), the rest per rank."""
    if not all("ledger_rows" in r for r in ranks.values()):
        return None

    def link_sum(r: int, inter: bool, key: str = "bytes") -> float:
        return sum(row[key] for row in ranks[r]["ledger_rows"] if (row["link"] == "inter_node") == inter)

    world = len(ranks)
    inter = [link_sum(r, True) for r in range(world)]
    return {
        "inter_node_per_rank": sum(inter) / world,
        "inter_node_per_node": sum(inter) / NODES,
        "inter_node_by_rank": inter,
        # rank r is on node r // per_node (--ranks-per-node, and torchrun's order of the namespaces)
        "inter_node_by_node": [sum(inter[n * per_node : (n + 1) * per_node]) for n in range(NODES)],
        "gloo_inter_node_per_rank": sum(link_sum(r, True, "gloo_bytes") for r in range(world)) / world,
        "intra_node_per_rank": sum(link_sum(r, False) for r in range(world)) / world,
        "on_wire_per_node": ledger_on_wire(ranks, per_node),
    }


def group_shapes(world: int, per_node: int) -> dict[str, tuple[int, int]]:
    """The bench's groups that span the nodes, by ledger role: (ranks, ranks of it per node)."""
    return {"dp_cp": (world, per_node), "dp": (world, per_node), "world": (world, per_node), "dp_tier1": (NODES, 1)}


def ledger_on_wire(ranks: dict, per_node: int) -> float | None:
    """The bytes per step and node that the ledger's inter-node rows put on the veth, if gloo runs an
    all-gather or all-reduce as a ring in group-rank order (one of a node's m ranks in the group sends
    its share across) and a pairwise all-to-all ((n - m) of each rank's n - 1 parts go across; a SUM
    reduce-scatter is one on gloo, see comm.py). None if a row's group shape is unknown."""
    total, shapes = 0.0, group_shapes(len(ranks), per_node)
    for info in ranks.values():
        for row in info["ledger_rows"]:
            if row["link"] != "inter_node":
                continue
            if row["role"] not in shapes:
                return None
            n, m = shapes[row["role"]]
            ring = row["op"] in ("all_gather", "all_reduce")
            total += row["bytes"] / m if ring else row["bytes"] * (n - m) / (n - 1)
    return total / NODES


def wire_bytes_by_node(ranks: dict, first: int, last: int) -> list[float] | None:
    """veth tx bytes per step of each node over timed steps [first, last) (its first rank reads them)."""
    per_node = []
    for r in ranks.values():
        tb, te = r.get("tx_begin") or [], r.get("tx_end") or []
        if r.get("iface") and len(tb) >= last and len(te) >= last and tb[first] is not None:
            per_node.append((te[last - 1] - tb[first]) / (last - first))
    return per_node if len(per_node) == NODES else None


def peer_comm(ranks: dict, first: int, last: int) -> dict | None:
    """The peers' traced collectives (testing/peers/gloo_collectives.py CommTrace) per step over timed steps
    [first, last): per torch.distributed entry point its calls and payload per rank, and the modelled
    cross-node bytes per node as run ("x_node") and with every reduce-scatter at the real-fabric volume
    ("x_node_real"); None for ours (its ledger) or a run without the trace."""
    if not all(r.get("comm_end") and len(r["comm_end"]) >= last for r in ranks.values()):
        return None
    steps, by_entry = last - first, {}
    for r in ranks.values():
        begin, end = r["comm_begin"][first], r["comm_end"][last - 1]
        for name, tot in end.items():
            d = [t - b for t, b in zip(tot, begin.get(name, [0] * len(tot)))]
            e = by_entry.setdefault(name, {"calls": 0.0, "payload": 0.0, "x_node": 0.0, "x_node_real": 0.0})
            for key, v in zip(e, d):
                e[key] += v / steps
    for e in by_entry.values():
        e["calls"] /= len(ranks)
        e["payload"] /= len(ranks)  # per rank
        e["x_node"] /= NODES  # per node: the sum over its ranks
        e["x_node_real"] /= NODES
    return {
        "by_entry": {n: e for n, e in by_entry.items() if e["calls"]},
        "x_node_per_node": sum(e["x_node"] for e in by_entry.values()),
        "x_node_real_per_node": sum(e["x_node_real"] for e in by_entry.values()),
        "native_rs": any(r.get("native_rs") for r in ranks.values()),
    }


def collect(kind: str, out_dir: str, ranks: dict, a) -> dict:
    metrics = []
    if kind == "ours":
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(ln) for ln in f if ln.strip()]
    out = {"rates": {}, "ledger": ledger_bytes(ranks, a.per_node), "losses": ranks[0]["losses"]}
    for k, rate in enumerate(a.rates):
        first, last = a.warmup + k * a.steps, a.warmup + (k + 1) * a.steps  # timed steps [first, last)
        # ours: pretrain_gpt's own step_time (--metrics-file) too; it includes the gate wait at a rate's first step
        own = [m["step_time"] for m in metrics if first + (k > 0) < m["iteration"] <= last]
        peaks = [p[k] for r in ranks.values() if len(p := r.get("peak_rss_by_rate") or []) > k and p[k]]
        out["rates"][rate] = {
            "step_times_s": ranks[0]["step_times"][first:last],  # the probe's, the same for every system
            "step_s_metrics_file": statistics.median(own) if own else None,
            "wire_bytes_by_node": wire_bytes_by_node(ranks, first, last),
            "peak_rss_mb_max": max(peaks) / 2**20 if peaks else None,
            "peer_comm": peer_comm(ranks, first, last),
            "loss_last": ranks[0]["losses"][last - 1] if len(ranks[0]["losses"]) >= last else None,
        }
    out["maxrss_lifetime_mb"] = max(r.get("maxrss_lifetime", 0) for r in ranks.values()) / 2**20
    out["peer_info"] = {k: v for k, v in ranks[0].items() if k in ("communication_data_type", "grad_accum_dtype")}
    return out


# ---------------------------------------------------------------- repeats -> one row


def mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def combine_rate(runs: list[dict], rate: str, per_node: int) -> dict:
    """One system at one rate over its successful repeats."""
    rs = [run["rates"][rate] for run in runs]
    medians = [statistics.median(r["step_times_s"]) for r in rs if r["step_times_s"]]
    pooled = [t for r in rs for t in r["step_times_s"]]
    wire_node = mean_or_none([sum(w) / NODES for r in rs if (w := r["wire_bytes_by_node"])])
    return {
        "step_s": statistics.median(pooled) if pooled else None,
        "repeat_step_s": medians,
        "spread": (max(medians) - min(medians)) / min(medians) if len(medians) > 1 else None,
        "step_times_s": [r["step_times_s"] for r in rs],
        "step_s_metrics_file": mean_or_none([r["step_s_metrics_file"] for r in rs]),
        "wire_bytes_per_node": wire_node,
        "wire_bytes_per_rank": wire_node / per_node if wire_node is not None else None,
        "peak_rss_mb_max": max((r["peak_rss_mb_max"] for r in rs if r["peak_rss_mb_max"]), default=None),
        "loss_last": rs[0]["loss_last"],
        "peer_comm": rs[0].get("peer_comm"),  # the same calls in every round
        "loss_last_repeats": [r["loss_last"] for r in rs],
    }


def combine(runs: list[dict], rates: list[str], per_node: int) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] != "ok"]
    if not ok:
        return {**failed[0], "repeats": runs}
    return {
        "status": "ok",
        "rates": {rate: combine_rate(ok, rate, per_node) for rate in rates},
        "ledger": ok[0]["ledger"],
        "peer_info": ok[0]["peer_info"],
        "failed_repeats": [r["reason"] for r in failed],
        "repeats": runs,
    }


# ---------------------------------------------------------------- ratios and targets


def step_s(results: dict, name: str, rate: str) -> float | None:
    res = results.get(name, {})
    return res["rates"][rate]["step_s"] if res.get("status") == "ok" else None


def best_peer(results: dict, rate: str) -> tuple[str | None, float | None]:
    """The fastest peer (FSDP2 or DeepSpeed, any variant that ran) at this rate: (name, step s)."""
    times = [(t, n) for n in BEST_PEER_POOL if (t := step_s(results, n, rate))]
    return (min(times)[1], min(times)[0]) if times else (None, None)


def speedup(ref_s: float | None, this_s: float | None) -> float | None:
    return ref_s / this_s if ref_s and this_s else None


def headline(results: dict, rate: str) -> dict:
    best, best_s = best_peer(results, rate)
    z3, zpp = step_s(results, "ours-z3", rate), step_s(results, "ours-zpp", rate)
    return {
        "best_peer": best,
        "zpp_vs_best": speedup(best_s, zpp),
        "z3_vs_best": speedup(best_s, z3),
        "zpp_vs_z3": speedup(z3, zpp),
    }


# The peers the best-peer targets are judged against: every headline peer must have run.
HEADLINE_PEERS = tuple(n for n in HEADLINE if n in BEST_PEER_POOL)


def absent_peers(results: dict, names: list[str]) -> list[Absent]:
    """The headline peers that did not run (not selected, not installed, failed), each with why and the fix."""
    out = []
    for n in HEADLINE_PEERS:
        label, res = SYSTEMS[n][0], results.get(n)
        if n not in names or res is None:
            out.append(Absent(label, "not among the systems run", f"add {n} to --systems"))
        elif res.get("status") != "ok":
            why, _, _ = str(res.get("reason", res.get("status"))).partition(f"; {INSTALL_FIX}")
            fix = INSTALL_FIX if "not installed" in why or "is installed" in why else "see its row and the logs"
            out.append(Absent(label, why, fix))
    return out


# (rate in bits/s, None: unshaped; what; headline key; the speedup it needs)
TARGETS = (
    (200e6, "200 Mbit/s: ours ZeRO++ >= 2.5x the best peer", "zpp_vs_best", 2.5),
    (1e9, "1 Gbit/s: ours ZeRO++ >= 1.5x the best peer", "zpp_vs_best", 1.5),
    (None, "unshaped: ours ZeRO++ step within 15% of ours ZeRO-3's", "zpp_vs_z3", 1 / 1.15),
    (None, "unshaped: ours ZeRO-3 no slower than the best peer", "z3_vs_best", 1.0),
)


def check_targets(heads: dict, rates: list[str], netns: bool, absent: list[Absent] = ()) -> list[dict]:
    """Each target: MET / NOT MET / not measured / not judged (a headline peer in `absent`: a best-peer
    target is then judged against none, whatever the others gave), with the measured speedup."""
    out = []
    for bits, what, key, minimum in TARGETS:
        rate = next((r for r in rates if parse_rate(r) == bits), None)
        value = heads[rate][key] if rate else None
        if rate is None:
            v = "not measured (rate not run)"
        elif bits is not None and not netns:
            v, value = "not measured (link not shaped: no namespaces)", None
        else:
            missing = absent if key.endswith("_vs_best") else ()
            v = verdict(None if value is None else value >= minimum, missing, "not measured (a system did not run)")
        out.append({"target": what, "minimum": minimum, "measured": value, "verdict": v})
    return out
