"""Weight all-gathers of ZeRO-3, plain or qwZ-quantized, started now and finished later.

    pending = all_gather_weights(full, shard, group, "zero_fwd_allgather", qwz_block=2048)
    ...                       # compute while the gather is on the wire
    pending.wait()            # `full` now holds every rank's shard (group-rank order)

qwZ sends int8 data plus one fp32 scale per block (two all-gathers under one phase), so
the ledger sees s + 4 s / block bytes per shard of s elements instead of s x element size.
Every rank decodes every shard, its own included, so all ranks hold bit-identical weights.
A group of size 1 moves nothing, so nothing is quantized: the shard is copied exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import comm
from ..topology import Group
from .quantize import dequantize_int8, quantize_int8


@dataclass
class PendingGather:
    """An all-gather in flight: its handles, and what to do once they are done."""

    works: list
    finish: Callable[[], None] | None = None  # qwZ: decode into the output

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()


def all_gather_weights(
    output: torch.Tensor, shard: torch.Tensor, group: Group, phase: str, qwz_block: int | None = None
) -> PendingGather:
    """Start gathering every rank's 1-D `shard` [s] into `output` [group.size * s]
    (output.dtype); `qwz_block` quantizes the transfer (int8, one fp32 scale per block)."""
    if shard.dim() != 1 or output.dim() != 1 or output.numel() != group.size * shard.numel():
        raise ValueError(
            f"output {tuple(output.shape)} must be 1-D with {group.size} x {shard.numel()} elements "
            f"of the 1-D shard {tuple(shard.shape)}"
        )
    if qwz_block is None or group.size == 1:
        return PendingGather([comm.all_gather(output, shard, group, phase, async_op=True)])
    q, scales = quantize_int8(shard, qwz_block)
    q_all = q.new_empty(group.size * q.numel())
    s_all = scales.new_empty(group.size * scales.numel())
    works = [
        comm.all_gather(q_all, q, group, phase, async_op=True),
        comm.all_gather(s_all, scales, group, phase, async_op=True),
    ]
    return PendingGather(works, lambda: output.copy_(dequantize_int8(q_all, s_all, qwz_block, output.dtype)))
