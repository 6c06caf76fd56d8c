"""Weight all-gathers of ZeRO-3, plain or qwZ-quantized, started now and finished later.

    pending = all_gather_weights(full, shard, group, "zero_fwd_allgather", qwz_block=2048)
    ...                       # compute while the gather is on the wire
    pending.wait()            # `full` now holds every rank's shard (group-rank order)

qwZ sends one wire buffer per rank (quantize.quantize_wire: int8 data and one fp32 scale
per block in the same bytes), so one all-gather moves s + 4 s / block bytes per shard of s
elements instead of s x element size. Every rank decodes every shard, its own included,
straight into `output`, so all ranks hold bit-identical weights. A group of size 1 moves
nothing, so nothing is quantized: the shard is copied exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import comm
from ..ops.quantize import dequantize_wire, quantize_wire
from ..topology import Group

QWZ_BITS = 8


@dataclass
class PendingGather:
    """An all-gather in flight: its handles, and what to do once they are done."""

    works: list
    finish: Callable[[], None] | None = None  # qwZ: decode into the output
    sending: torch.Tensor | None = None  # qwZ: the wire buffer on the wire, kept alive until wait()

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
        self.sending = None


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
    s = shard.numel()
    wire = quantize_wire(shard.reshape(1, s), qwz_block, QWZ_BITS)
    gathered = wire.new_empty(group.size, wire.shape[1])  # row j: group rank j's wire
    work = comm.all_gather(gathered.view(-1), wire.view(-1), group, phase, async_op=True)

    def decode() -> None:
        dequantize_wire(gathered, s, qwz_block, QWZ_BITS, out=output.view(group.size, s))

    return PendingGather([work], decode, sending=wire)
