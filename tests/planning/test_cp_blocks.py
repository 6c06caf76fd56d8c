"""All-Scan's block choice, the one rule the runtime (context_parallel.auto_blocks) and the simulator share:

* it is the argmin over the divisors n of the cut dimension of the chain's time, checked against a brute force
  over n of the closed form (P - 2 + n) (alpha + bytes / (n beta)) written here, on the device's link facts;
* in the simulator at ZeCO's scale (P = 64, 128, 256, H100 preset), All-Scan's chain is shorter than the ring's
  and the all-gather's for a ZeCO-sized GLA (its scan hides under the local work, so the step times tie), and
  its step is shorter than both for a Gated DeltaNet of the same size, whose scan waits for the local pass.
"""

import pytest
import torch

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.context_parallel import auto_blocks
from megatron_zpp.context_parallel.chain import host_msg_s, link_table
from megatron_zpp.planning.simulator import preset, simulate
from megatron_zpp.planning.simulator.collectives import rank_groups
from megatron_zpp.planning.simulator.model import scan_time
from megatron_zpp.topology import Group
from megatron_zpp.validation import validate


def brute_force(P: int, state_bytes: float, alpha: float, beta: float, extent: int) -> int:
    times = {n: (P - 2 + n) * (alpha + state_bytes / (n * beta)) for n in range(1, extent + 1) if extent % n == 0}
    return min(times, key=lambda n: (times[n], n))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("link", ["intra_node", "inter_node"])
def test_auto_blocks_minimises_the_chain_model(device, link):
    facts = link_table(device)[link]
    alpha = facts.alpha + host_msg_s(device)
    for P in (2, 3, 4, 8, 16, 64, 256):
        group = Group("cp", tuple(range(P)), 0, link)  # no hop links: every hop on the group's link
        for state_bytes in (512, 2**16, 2**20, 2**22, 2**26):
            for extent in (64, 96, 128):
                got = auto_blocks(state_bytes, group, torch.device(device), extent)
                assert got == brute_force(P, state_bytes, alpha, facts.bandwidth, extent), (P, state_bytes, extent)
    assert auto_blocks(2**30, Group("cp", (0, 1), 0, link), torch.device(device), 128) == 1  # one hop: no pipeline


ZECO = (  # examples/reproduce/zeco_table.py's 1B GLA (24 layers cut to 2: the scan's order is per layer)
    "--mock-data --num-layers 2 --hidden-size 2048 --num-attention-heads {heads} --attention-type {mixer} "
    "--softmax-attention-every 0 --vocab-size 32000 --bf16 --micro-batch-size 1 --global-batch-size 1 "
    "--ranks-per-node 8 --seq-length {seq} --context-parallel-size {P} --cp-algo {algo}"
)
ALGOS = ("all-scan", "ring", "all-gather")


def zeco(mixer: str, P: int, algo: str):
    heads = 4 if mixer == "gla" else 16  # GLA: 4 heads of 512 (fla's GLA-1.3B); GDN: 16 of 128
    flags = ZECO.format(heads=heads, mixer=mixer, seq=P * 8192, P=P, algo=algo)
    return validate(parse_args(flags.split()), P)


@pytest.mark.parametrize("P", [64, 128, 256])
def test_all_scan_ahead_at_zeco_scale(P):
    h100 = preset("h100")
    chain = {a: scan_time(c, h100, rank_groups(c, 0).cp, 8) for a, c in ((a, zeco("gla", P, a)) for a in ALGOS)}
    assert chain["all-scan"] < chain["ring"] < chain["all-gather"], chain
    step = {a: simulate(zeco("gdn", P, a), h100).step_time_s for a in ALGOS}
    assert step["all-scan"] < min(step["ring"], step["all-gather"]), step
