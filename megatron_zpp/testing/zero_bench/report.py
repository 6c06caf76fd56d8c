"""bench/zero.py's printed report: the header, one table per dtype and rate, the targets, the
ledger and peer-wire checks, the notes and the warnings of a noisy machine."""

from __future__ import annotations

import os

from megatron_zpp.testing.cluster import Cluster, parse_rate
from megatron_zpp.testing.zero_bench.results import (
    absent_peers,
    best_peer,
    check_targets,
    headline,
    speedup,
    step_s,
)
from megatron_zpp.testing.zero_bench.systems import COLUMNS, SPREAD_WARN, SYSTEMS


def fmt(v, spec: str, na: str = "n/a") -> str:
    return na if v is None else format(v, spec)


def times(v) -> str:
    """A speedup: 2.26x, or n/a."""
    return "n/a" if v is None else f"{v:.2f}x"


def mb(v) -> str:
    return fmt(v and v / 1e6, "7.1f", "      -")


def rate_title(rate: str, dtype: str, netns: bool) -> str:
    if not netns:
        return f"\n== {dtype}, {rate} (NOT shaped: loopback, no namespaces) =="
    return f"\n== {dtype}, {rate}{'' if parse_rate(rate) is None else ' (tbf on the cross-node veth)'} =="


def print_rate_table(results: dict, rate: str, names: list[str], columns: list) -> dict:
    """One dtype at one rate; the speedups of every row."""
    refs = " ".join(f"{lab:>7}" for _, lab in [("best", "best")] + columns)
    head = (
        f"{'system':37} {'step s':>6} {'spread':>6} | {'ledger x-node MB':>15} | {'wire x-node MB':>15} | "
        f"{'peak MB':>7} {'loss@end':>8} | {refs}"
    )
    print(head)
    print(
        f"{'':37} {'median':>6} {'rounds':>6} | {'rank':>7} {'node':>7} | {'rank':>7} {'node':>7} | "
        f"{'per rank':>16} | speedup vs"
    )
    print("-" * len(head))
    best, best_s = best_peer(results, rate)
    ratios = {}
    for name in names:
        res, label = results[name], SYSTEMS[name][0]
        if res["status"] != "ok":
            print(f"{label:37} {res['status']}: {res['reason']}")
            continue
        r, led = res["rates"][rate], res["ledger"] or {}
        row = {n: speedup(step_s(results, n, rate), r["step_s"]) for n, _ in columns}
        ratios[name] = row = {"best": speedup(best_s, r["step_s"]), **row}
        cells = " ".join(fmt(v, "7.2f") for v in row.values())
        spread = f"{100 * r['spread']:5.1f}%" if r["spread"] is not None else "n/a"
        print(
            f"{label:37} {fmt(r['step_s'], '6.2f')} {spread:>6} | {mb(led.get('inter_node_per_rank'))} "
            f"{mb(led.get('inter_node_per_node'))} | {mb(r['wire_bytes_per_rank'])} {mb(r['wire_bytes_per_node'])} | "
            f"{fmt(r['peak_rss_mb_max'], '7.0f')} {fmt(r['loss_last'], '8.4f')} | {cells}"
        )
    return ratios


def print_headline(h: dict, absent: list) -> None:
    best = SYSTEMS[h["best_peer"]][0] if h["best_peer"] else "none ran"
    if absent:
        best += f" (of those that ran; did not run: {', '.join(x.peer for x in absent)})"
    print(
        f"  best peer: {best}; speedups: ours ZeRO++ / best peer {times(h['zpp_vs_best'])}, ours ZeRO-3 / "
        f"best peer {times(h['z3_vs_best'])}, ours ZeRO++ / ours ZeRO-3 {times(h['zpp_vs_z3'])}"
    )


def print_dtype(results: dict, dtype: str, a, netns: bool) -> tuple[dict, dict]:
    """Every rate's table of one dtype: (speedups, headline ratios) by rate."""
    columns = [(n, lab) for n, lab in COLUMNS if n in a.names]
    ratios, heads, absent = {}, {}, absent_peers(results, a.names)
    for rate in a.rates:
        print(rate_title(rate, dtype, netns))
        ratios[rate] = print_rate_table(results, rate, a.names, columns)
        heads[rate] = headline(results, rate)
        print_headline(heads[rate], absent)
    return ratios, heads


def print_targets(targets: list[dict]) -> None:
    print("\nTargets (bf16 table; reported, nothing is tuned to them):")
    for t in targets:
        need = f"need >= {t['minimum']:.2f}x"
        print(f"  {t['target']:56} measured {times(t['measured'])} ({need}): {t['verdict']}")


def print_ledger_check(results_by_dtype: dict, rates: list[str]) -> None:
    """Ours: the ledger's cross-node bytes, what they put on the veth, and what the veth carried."""
    lines = []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            led = res.get("ledger") or {}
            if res["status"] != "ok" or not led.get("on_wire_per_node"):
                continue
            for rate in rates:
                wire, expect = res["rates"][rate]["wire_bytes_per_node"], led["on_wire_per_node"]
                if not wire:
                    continue
                lines.append(
                    f"  {dtype} {rate:8} {SYSTEMS[name][0]:26} ledger {mb(led['inter_node_per_rank'])} MB/rank "
                    f"{mb(led['inter_node_per_node'])} MB/node, on the wire {mb(expect)} MB/node; measured "
                    f"{mb(wire)} MB/node (x {wire / expect:.3f})"
                )
    if lines:
        print(
            "\nours, ledger vs wire: the ledger counts all a rank sends in a node-spanning collective; the veth "
            "carries only the hops between the nodes: a 4-rank ring (gloo's all-gather, all-reduce) crosses once "
            "per node, a pairwise all-to-all (and comm.py's SUM reduce-scatter on gloo) sends 2 of its 3 parts "
            "across; measured / that = IP/TCP headers and ACKs (~1.03-1.05) if the ledger is right:"
        )
        print("\n".join(lines))


PEER_WIRE_TOLERANCE = 0.05  # measured / traced real-fabric volume beyond 1 +- this: the peers' figure is off


def print_peer_wire_check(results_by_dtype: dict, rates: list[str], params: int) -> list[str]:
    """The peers: their traced collectives (testing/peers/gloo_collectives.py), the cross-node bytes those put on the
    veth, at the real-fabric reduce-scatter volume and as run, and what the veth carried; the lines whose
    measured bytes are off the real-fabric volume by more than PEER_WIRE_TOLERANCE (for warnings_of)."""
    lines, off = [], []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            if res["status"] != "ok" or SYSTEMS[name][1] not in ("fsdp2", "ds"):
                continue
            for rate in rates:
                r = res["rates"][rate]
                comm, wire = r.get("peer_comm"), r["wire_bytes_per_node"]
                if not comm or not wire:
                    continue
                calls = ", ".join(
                    f"{n} {e['calls']:.0f}x {mb(e['payload']).strip()} MB ({e['payload'] / params:.2f} B/param)"
                    for n, e in sorted(comm["by_entry"].items(), key=lambda kv: -kv[1]["payload"])
                    if e["payload"] >= 1e5
                )
                real, as_run = comm["x_node_real_per_node"], comm["x_node_per_node"]
                ratio = wire / real if real else float("nan")
                native = comm["native_rs"]
                lines.append(
                    f"  {dtype} {rate:8} {SYSTEMS[name][0]:36} per rank and step: {calls}\n"
                    f"  {'':50} x-node per node: real-fabric reduce-scatter {mb(real)} MB"
                    + (f", as run (gloo's own: an all-reduce) {mb(as_run)} MB" if native else "")
                    + f"; measured {mb(wire)} MB (x {ratio:.3f} of real-fabric"
                    + (f", x {wire / as_run:.3f} of as run)" if native and as_run else ")")
                )
                if not native and abs(ratio - 1) > PEER_WIRE_TOLERANCE:
                    off.append(
                        f"{dtype} {rate} {SYSTEMS[name][0]}: measured {mb(wire).strip()} MB/node, x {ratio:.3f} of the "
                        f"real-fabric {mb(real).strip()} MB/node (tolerance {100 * PEER_WIRE_TOLERANCE:.0f}%)"
                    )
    if lines:
        print(
            "\npeers, traced collectives vs wire (every torch.distributed collective a peer calls, counted in its "
            "ranks; a ring all-gather / all-reduce crosses once per node, the real-fabric reduce-scatter is an "
            "all-to-all of (n-1)/n of its input per rank, 2 of its 3 parts across; measured / real-fabric = IP/TCP "
            "headers and ACKs if the peers move the real-fabric volume):"
        )
        print("\n".join(lines))
    return off


def warnings_of(results_by_dtype: dict) -> list[str]:
    """Per dtype and system: failed rounds, rounds whose medians disagree, timed steps far apart."""
    out = []
    for dtype, results in results_by_dtype.items():
        for name, res in results.items():
            if res["status"] != "ok":
                continue
            label = f"{dtype} {SYSTEMS[name][0]}"
            out += [f"{label}: a round failed ({reason}); figures from the others" for reason in res["failed_repeats"]]
            apart, noisy = [], []
            for rate, v in res["rates"].items():
                steps = [t for ts in v["step_times_s"] for t in ts]
                if v["spread"] is not None and v["spread"] > SPREAD_WARN:
                    apart.append(f"{rate} {100 * v['spread']:.0f}%")
                if steps and max(steps) > 1.25 * min(steps):
                    noisy.append(f"{rate} {min(steps):.2f}..{max(steps):.2f} s")
            if apart:
                out.append(f"{label}: the rounds' medians differ by > {100 * SPREAD_WARN:.0f}%: {', '.join(apart)}")
            if noisy:
                out.append(f"{label}: timed steps more than 25% apart: {', '.join(noisy)}")
    return out


def print_notes(results_by_dtype: dict, names: list[str], native_rs: bool) -> None:
    if any(SYSTEMS[n][1] in ("fsdp2", "ds") for n in names):
        print(
            "\nOn gloo, torch's reduce-scatter runs as an all-reduce: twice the bytes of the ring reduce-scatter NCCL "
            "would send. Ours sends a SUM reduce-scatter as an all-to-all + local sum (megatron_zpp/comm.py), and "
            + (
                "the peers' (FSDP2's, DeepSpeed's) here ran gloo's own (--gloo-native-reduce-scatter): their "
                "gradient bytes are 2x the real-fabric ones, a handicap of gloo's, not of their algorithms."
                if native_rs
                else "so do the peers' (FSDP2's, DeepSpeed's: megatron_zpp/testing/peers/gloo_collectives.py): every "
                "system's "
                "reduce-scatter moves the real-fabric volume."
            )
        )
    if any(SYSTEMS[n][1] == "ds" for n in names):
        info = {
            d: next((r["peer_info"] for r in res.values() if r.get("peer_info")), None)
            for d, res in results_by_dtype.items()
        }
        print(
            "DeepSpeed ZeRO-3 uses its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9): "
            "a model this small stays gathered from forward to backward (no backward all-gather, more memory); "
            "'regather' sets both to 0, the paper's ZeRO-3 (3M per step), which hpZ needs to act. Its gradient "
            f"reduce-scatter and accumulation dtypes, as run: {({d: i for d, i in info.items() if i}) or 'n/a'}"
        )


def print_header(a, cluster: Cluster, params: int, paths: dict, estimate: float, compute: dict) -> None:
    if cluster.netns:
        print(
            f"\nZeRO on an emulated 2-node cluster: {a.world} ranks = 2 network namespaces x {a.per_node}, veth + tc "
            f"tbf between the nodes, loopback inside each"
        )
    else:
        print(
            f"\nZeRO on ONE loopback host ({cluster.reason}): {a.world} ranks, nothing shaped; ours still lays "
            f"out {a.per_node} ranks per node for its ledger"
        )
    bf16 = " (bf16: fp32 masters; gradients reduced in fp32 by ours and FSDP2, in bf16 by DeepSpeed's defaults)"
    print(
        f"model: Llama-style GPT {params / 1e6:.2f}M params (hidden {a.hidden_size}, {a.num_layers} layers, "
        f"{a.num_attention_heads} heads, seq {a.seq_length}, vocab {a.vocab_size}), micro-batch "
        f"{a.micro_batch_size} x {a.world} ranks = global batch {a.micro_batch_size * a.world}; same weights and "
        "tokens "
        f"for every system; dtypes: {' then '.join(a.dtypes)}{bf16 if 'bf16' in a.dtypes else ''}"
    )
    print(
        f"per dtype {a.repeats} round(s) over the systems (every other one reversed), each launch {a.warmup} warmup "
        f"step(s) then {a.steps} timed steps per rate; step s = median of all rounds' timed steps, spread = "
        f"(max - min) / min of the rounds' medians; {a.world} ranks share {os.cpu_count()} CPU cores at 1 thread each: "
        f"absolute times are this machine's, the ratios are the figure; expected duration ~{estimate / 60:.0f} min"
    )
    print(
        "one forward + backward of one micro-batch on one thread (the compute of a rank's step; the ranks share "
        f"the cores): {', '.join(f'{d} {t:.2f} s' for d, t in compute.items())}"
        + (
            f" (bf16 {compute['bf16'] / compute['fp32']:.0f}x slower than fp32: no native bf16 on this CPU, so the "
            "bf16 steps carry far more compute per byte sent than on a GPU)"
            if len(compute) == 2 and compute["bf16"] > 2 * compute["fp32"]
            else ""
        )
    )
    print(
        "x-node MB per step: ledger = our comm ledger (all a rank sends in a node-spanning collective), per rank "
        "(mean) and per node (sum of its 2 ranks); wire = veth tx bytes per node (headers included) and per rank "
        "(node / 2); peak MB = max over ranks and rounds of the peak RSS in the timed steps; speedup = reference "
        "step time / this step time; best = the fastest of FSDP2 and DeepSpeed (every variant run)"
    )
    if paths:
        print(
            f"path check: cross-node {paths['cross_node']['mbit_per_s']:.0f} Mbit/s, intra-node "
            f"{paths['intra_node']['mbit_per_s']:.0f} Mbit/s with {paths['intra_node']['veth_tx_mb']:.2f} MB on "
            f"the veth (intra-node traffic stays off the shaped link)"
        )


def print_report(a, results: dict, netns: bool, params: int) -> dict:
    """Every table, the targets, the checks, the notes and warnings; what of them goes in the JSON line."""
    ratios, heads = {}, {}
    for dtype in a.dtypes:
        ratios[dtype], heads[dtype] = print_dtype(results[dtype], dtype, a, netns)
    absent = absent_peers(results["bf16"], a.names) if "bf16" in heads else []
    targets = check_targets(heads["bf16"], a.rates, netns, absent) if "bf16" in heads else []
    if targets:
        print_targets(targets)
    else:
        print("\nTargets: checked on the bf16 table, which this run did not make (--dtype fp32)")
    print_ledger_check(results, a.rates)
    peer_off = print_peer_wire_check(results, a.rates, params)
    print_notes(results, a.names, a.gloo_native_reduce_scatter)
    warnings = warnings_of(results)
    if warnings:
        print(f"\nWARNING: the machine was not quiet ({os.cpu_count()} cores shared with other processes?):")
        print("\n".join(f"  {ln}" for ln in warnings))
    if peer_off:
        print("\nWARNING: a peer's measured wire bytes are off its real-fabric volume (see above):")
        print("\n".join(f"  {ln}" for ln in peer_off))
    return {
        "speedup": ratios,
        "headline": heads,
        "targets": targets,
        "absent_peers": [vars(x) for x in absent],
        "warnings": warnings,
        "peer_wire_off": peer_off,
    }
