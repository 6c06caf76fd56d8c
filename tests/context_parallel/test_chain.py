"""The CP state chain's time model (context_parallel/chain.py) against an independent event simulation of the
pipeline, and the link facts every rank reads (the same group gives the same hops on every rank)."""

import random

import pytest

from megatron_zpp.context_parallel.chain import Hop, chain_time, host_msg_s, link_hops, link_table
from megatron_zpp.topology import Topology, build_groups


def event_pipeline(hops: list[Hop], state_bytes: float, blocks: int) -> float:
    """When the last rank holds every block: rank h forwards block i once it has it and has sent block i - 1
    (a send occupies its hop for alpha + bytes / bandwidth)."""
    done = [0.0] * blocks  # when each block reached the rank before the hop
    for h in hops:
        step, free = h.alpha + state_bytes / blocks / h.bandwidth, 0.0
        for i in range(blocks):
            free = max(free, done[i]) + step
            done[i] = free
    return done[-1]


@pytest.mark.parametrize("seed", range(4))
def test_chain_time_is_the_pipeline(seed):
    rng = random.Random(seed)
    hops = [Hop(rng.uniform(1e-6, 1e-3), rng.choice([1e8, 1e9, 5e10])) for _ in range(rng.randint(1, 12))]
    for blocks in (1, 2, 3, 8, 32):
        assert chain_time(hops, 2**20, blocks) == pytest.approx(event_pipeline(hops, 2**20, blocks), rel=1e-12)
    assert chain_time([], 2**20, 4) == 0.0


def test_link_hops_follow_the_topology_and_the_preset():
    # CP 8 over 2 nodes of 4: the hop 3 -> 4 crosses them; every rank sees the same hops
    groups = [build_groups(Topology(8, cp=8, ranks_per_node=4), r).cp for r in range(8)]
    want = ("intra_node",) * 3 + ("inter_node",) + ("intra_node",) * 3
    assert {g.hop_links for g in groups} == {want}
    hops = link_hops(groups[0], "cpu")
    table, extra = link_table("cpu"), host_msg_s("cpu")
    assert hops[3] == Hop(table["inter_node"].alpha + extra, table["inter_node"].bandwidth)
    assert hops[0] == Hop(table["intra_node"].alpha + extra, table["intra_node"].bandwidth)
    assert host_msg_s("cuda") == 0.0 and link_hops(groups[0], "cuda")[3] == link_table("cuda")["inter_node"]


def test_bench_fit_recovers_the_per_message_cost():
    # bench/cp.py's fit_chain on comm-only rows made by the model itself with a known host cost and a
    # transfer term off by a constant: it returns that cost (the slope) and the K the model then picks
    from bench import cp

    cfg = {"heads": 8, "head_k": 128, "head_v": 256, "mixer": "gla"}
    hops = [[126e-6, 1.5e9]] * 3 + [[185e-6, 125e6]] + [[126e-6, 1.5e9]] * 3
    links, sb, m = [Hop(a, b) for a, b in hops], cp.state_bytes(cfg), 3e-3

    def row(K):
        t = 1e3 * (chain_time([Hop(h.alpha + m, h.bandwidth) for h in links], sb, K) + 2e-3)
        return {"comm_ms": 2 * t, "comm_fwd_ms": t, "comm_bwd_ms": t}

    rows = {"all-scan K=1": row(1), cp.AUTO: row(4), "all-scan K=2": row(2), "ring": row(1), "all-gather": row(9)}
    got = cp.fit_chain(rows, hops, 4, cfg)
    assert got["msg_s"] == pytest.approx(m, rel=1e-9)
    assert got["blocks"] == 1 and got["links_blocks"] == 4
