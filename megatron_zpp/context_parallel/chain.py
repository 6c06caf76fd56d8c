"""The time of the CP state chain and All-Scan's block count, written once for the runtime (all_scan.auto_blocks)
and the simulator (planning/simulator/model.py scan_time).

The chain passes one state of `state_bytes` from rank 0 to rank P - 1 over P - 1 hops, cut into n blocks (ZeCO's
All-Scan: all_scan.pipelined_chain; the LASP-1 ring is n = 1). Hop h costs

    t_h(n) = alpha_h + state_bytes / (n * beta_h)

per block: alpha_h the seconds per message (the link's latency plus the host's cost of one send: on the emulated
CPU cluster, a rank woken to forward a block waits for a core) and beta_h its bytes/s. The blocks form a pipeline:
the first crosses every hop, the others follow at the pace of the slowest, so the last rank holds its whole state
after

    T(n) = sum_h t_h(n) + (n - 1) * max_h t_h(n)

which over one link class is (P - 2 + n) * (alpha + bytes / (n * beta)): P - 1 hops for block 0, one more step for
each later block. More blocks shorten the transfer term (P - 2) * bytes / (n * beta) and lengthen the latency term
n * alpha; `best_blocks` takes the divisor of the cut dimension that minimises T (searched, not the sqrt rule, so a
chain with one slow hop among fast ones, or the divisibility, gets the true minimum).

The link facts (`link_hops`) are the same on every rank (the group's hop classes and the device's link table), so
every rank picks the same n without measuring anything at run time: the collectives stay data-independent. GPU
(cuda) links: stated NVLink / InfiniBand figures (the simulator times the chosen n on its own cluster's links). CPU
(gloo): the emulated cluster's calibrated preset (package data; tools/calibrate_cluster.py): each link class's
measured alpha and bandwidth, plus the chain's measured per-message host cost (host_msg_s: bench/cp.py fits it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from ..topology import Group

# the emulated cluster's calibrated preset: package data of the simulator, read here without importing it
# (planning/ sits above context_parallel/); planning.simulator.hardware reads the same file through this name
EMULATED_PRESET = resources.files("megatron_zpp").joinpath("planning", "simulator", "presets", "emulated_cluster.json")


@dataclass(frozen=True)
class Hop:
    """One hop of the chain: seconds per message and bytes per second."""

    alpha: float
    bandwidth: float


# Stated (alpha s, bandwidth B/s) per link class where no calibration applies. cuda: NVLink and 200 Gbit/s
# InfiniBand p2p. cpu: gloo over TCP, loopback and a 1 Gbit/s link (only if the calibrated preset is missing).
STATED = {
    "cuda": {"intra_node": Hop(10e-6, 100e9), "inter_node": Hop(20e-6, 25e9)},
    "cpu": {"intra_node": Hop(50e-6, 2e9), "inter_node": Hop(100e-6, 125e6)},
}


def chain_time(hops: Sequence[Hop], state_bytes: float, blocks: int) -> float:
    """Seconds until the last rank of the chain holds its entering state, sent in `blocks` blocks (module
    docstring: sum_h t_h + (blocks - 1) max_h t_h); 0 without hops."""
    if not hops:
        return 0.0
    steps = [h.alpha + state_bytes / blocks / h.bandwidth for h in hops]
    return sum(steps) + (blocks - 1) * max(steps)


def best_blocks(hops: Sequence[Hop], state_bytes: float, extent: int) -> int:
    """The divisor n of `extent` (the state dimension the blocks cut: K for GLA, V for GDN) that minimises
    chain_time; the fewest blocks among equal times (1 for a single hop: nothing to pipeline)."""
    divisors = [d for d in range(1, extent + 1) if extent % d == 0]
    return min(divisors, key=lambda n: (chain_time(hops, state_bytes, n), n))


def hop_classes(cp: Group) -> tuple[str, ...]:
    """The link class of each hop of the chain (member i to i + 1): the group's hop_links where the topology
    gave them, else its slowest link for every hop."""
    return cp.hop_links or (cp.link,) * (cp.size - 1)


@functools.cache
def _preset() -> dict:
    return json.loads(EMULATED_PRESET.read_text()) if EMULATED_PRESET.is_file() else {}


def link_table(device_type: str) -> dict[str, Hop]:
    """Per link class, the link's own (alpha, bytes/s) on `device_type`: the calibrated emulated preset's
    measured links on CPU, STATED otherwise (or where the preset is missing)."""
    links = _preset().get("links") if device_type == "cpu" else None
    if not links:
        return STATED.get(device_type, STATED["cuda"])
    return {name: Hop(link["alpha"], link["bandwidth"]) for name, link in links.items()}


def host_msg_s(device_type: str) -> float:
    """Seconds the host adds to each chain message beyond the link's alpha: on the emulated CPU cluster, with
    more ranks than cores, a rank woken to forward a block waits for a core held by another rank's local pass
    (the preset's measured["cp_chain"]["msg_s"], fitted by bench/cp.py from its comm-only rows); 0 on GPUs,
    whose host hands a block to NCCL and goes on."""
    if device_type != "cpu":
        return 0.0
    return float(_preset().get("measured", {}).get("cp_chain", {}).get("msg_s", 0.0))


def link_hops(cp: Group, device_type: str) -> list[Hop]:
    """The chain's hops over `cp` on `device_type` (the same on every rank): link alpha + host_msg_s, bandwidth."""
    table, extra = link_table(device_type), host_msg_s(device_type)

    def hop(c: str) -> Hop:
        link = table.get(c, table["intra_node"] if c.startswith("tier") else table["inter_node"])
        return Hop(link.alpha + extra, link.bandwidth)

    return [hop(c) for c in hop_classes(cp)]
