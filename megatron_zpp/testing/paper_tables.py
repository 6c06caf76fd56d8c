"""Shared by the paper-table scripts of examples/reproduce/: simulate a layout on a preset, print paper vs ours."""

from __future__ import annotations

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.planning.simulator import preset, simulate, throughput
from megatron_zpp.planning.simulator.collectives import rank_step
from megatron_zpp.planning.simulator.model import node_egress
from megatron_zpp.topology import topology_from_config
from megatron_zpp.validation import validate

TOLERANCE = 0.15


def config(flags: str, world: int):
    return validate(parse_args(flags.split()), world)


def run(flags: str, world: int, system: str, gbps: float | None = None) -> dict:
    """Simulated step of `flags` on `world` ranks of preset `system` (inter-node Gbit/s per node)."""
    cluster = preset(system)
    if gbps is not None:
        cluster = cluster.with_inter_node(gbps)
    cfg = config(flags, world)
    bd = simulate(cfg, cluster)
    return {"cfg": cfg, "breakdown": bd, "step_time_s": bd.step_time_s, **throughput(cfg, bd)}


def cross_node_bytes(flags: str, world: int) -> float:
    """Bytes leaving one node per step (the papers' per-node view): rank 0's inter-node
    collectives (the ledger's bytes) times the node sharing rule of simulator/model.py."""
    cfg = config(flags, world)
    rpn = topology_from_config(cfg).ranks_per_node
    return sum(node_egress(c, rpn, gloo=False) for c in rank_step(cfg, 0).all() if c.link == "inter_node")


def table(title: str, rows: list[tuple[str, float | None, float, str, str]]) -> bool:
    """rows: (what, paper value or None, ours, where the paper says it, why ours differs).
    Prints the comparison; True when every row with a paper value is within 15%."""
    print(title)
    print(f"{'quantity':<58} {'paper':>8} {'ours':>8} {'ours/paper':>10}  within 15%")
    ok = True
    for what, paper, ours, source, why in rows:
        if paper is None:
            print(f"{what:<58} {'n/a':>8} {ours:8.3f} {'':>10}  (no number in the paper)")
        else:
            ratio = ours / paper
            inside = abs(ratio - 1) <= TOLERANCE
            ok &= inside
            print(f"{what:<58} {paper:8.3f} {ours:8.3f} {ratio:10.3f}  {'yes' if inside else 'NO'}")
        print(f"    source: {source}")
        if why:
            print(f"    note: {why}")
    return ok
