"""ZeRO's gradient reductions reuse the same buffers every step (zero/reduce_buffers.py).

One spawn of 4 gloo ranks (2 emulated nodes) trains 3 steps of each layout, recording after every
step how many buffers the engine's pool has ever allocated and the data_ptr of every buffer the
step's reductions took: ZeRO-1 (persistent accumulators), ZeRO-2 with --grad-reduce-in-bf16 (the
bf16 wire copies), ZeRO-3 under 1F1B (two stages), the unquantized hierarchy with more reductions
in flight than hops, ZeRO++ (qgZ's int4 send/receive buffers per hop) and ZeRO-3 with each chain
enqueued whole (the accelerator's schedule); and plain DP's bf16 bucket copies (--grad-reduce-in-bf16),
made by the first step's all-reduces and kept. The first step allocates what the schedule needs;
steps 2 and 3 allocate nothing and take exactly the same buffers in the same order. The fp32 layouts
still give plain data parallelism's losses (to 1e-5, the parity bound).
"""

import numpy as np
import torch

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate
from megatron_zpp.zero.reduce_buffers import Lease, ReduceBuffers
from tests.dist import run_distributed
from tests.zero.test_zero_training import BASE, ZPP

STEPS = ["--train-iters", "3"]
VARIANTS = {
    "plain": [],
    "zero1": ["--zero-stage", "1"],
    "zero2_bf16_wire": ["--zero-stage", "2", "--grad-reduce-in-bf16"],
    "zero3_pp2": ["--zero-stage", "3", "--pipeline-model-parallel-size", "2"],
    "zero3_hierarchy": ["--zero-stage", "3", "--zero-hierarchy", "2", "--zero-reduce-in-flight", "3"],
    "zeropp": ZPP,
    "zero3_whole_chain": ["--zero-stage", "3"],
    "plain_bf16_wire": ["--grad-reduce-in-bf16"],
}
AT_PARITY = ("zero1", "zero3_pp2", "zero3_hierarchy", "zero3_whole_chain")


def _train(argv: list[str], world_size: int, whole_chain: bool) -> dict:
    run = training.setup(validate(parse_args(argv), world_size))
    dp, steps = run.dp, []
    pool = getattr(dp, "buffers", None)
    if pool is not None:
        dp.enqueue_whole_chain = dp.enqueue_whole_chain or whole_chain
    step = dp.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if pool is not None:
            steps.append((pool.allocations, list(pool.taken)))
            pool.taken.clear()
        else:  # plain DP: its buckets' wire copies
            wires = [b.wire.data_ptr() for b in dp.grads.buckets if b.wire is not None]
            steps.append((len(wires), wires))
        return out

    dp.step = recording_step
    losses = [h["loss"] for h in training.train(run)]
    return {"losses": losses, "steps": steps}


def _worker(rank, world_size):
    return [_train(BASE + STEPS + flags, world_size, name.endswith("whole_chain")) for name, flags in VARIANTS.items()]


def test_reduction_buffers_are_reused_every_step():
    per_rank = run_distributed(_worker, 4, timeout=600)
    for rank_res in per_rank:
        res = dict(zip(VARIANTS, rank_res))
        ref = res.pop("plain")["losses"]
        for name, r in res.items():
            (alloc1, taken1), (alloc2, taken2), (alloc3, taken3) = r["steps"]
            assert alloc1 > 0 and taken1, name
            assert alloc2 == alloc1 and alloc3 == alloc1, (name, alloc1, alloc2, alloc3)  # nothing new after step 1
            assert taken2 == taken3, name  # the same buffers, in the same order
            if name in AT_PARITY:
                np.testing.assert_allclose(r["losses"], ref, rtol=1e-5, err_msg=name)


def test_pool_gives_each_take_the_free_buffer_of_lowest_address():
    """The same takes and gives, in the same order, hand out the same buffers whatever order the
    previous round gave them back in; a lease holds its buffers until it gives them back."""
    pool = ReduceBuffers(torch.device("cpu"))

    def one_round():
        a, b = pool.lease(), pool.lease()
        a.empty((4, 2), torch.float32), b.zeros((8,), torch.float32), a.empty((3,), torch.bfloat16)
        assert (b.held[0] == 0).all() and b.held[0].numel() == 8
        b.give_back()  # given back in another order than taken
        a.give_back()

    one_round()
    first = list(pool.taken)
    for _ in range(2):
        pool.taken.clear()
        one_round()
        assert pool.taken == sorted(first[:2]) + first[2:] and pool.allocations == 3
    assert Lease(torch.device("cpu")).empty((2, 3), torch.float32).shape == (2, 3)  # no pool: allocates
