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
from types import ModuleType

import torch

from .. import comm
from ..ops.quantize import dequantize_wire, quantize_wire
from ..topology import Group

QWZ_BITS = 8


@dataclass
class PendingGather:
    """An all-gather in flight on `stream`: its handles, and what to do once they are done.

    wait() runs on the gather stream: the collective's wait (on NCCL it only orders the
    stream), the qwZ decode, then `then` (hpZ: the secondary shard's copy); the compute
    stream then waits for an event recorded there, never the host. The wire buffers were
    made on the gather stream and are dropped after its wait; the shard read by the gather
    stream is the caller's persistent one."""

    works: list
    finish: Callable[[], None] | None = None  # qwZ: decode into the output
    sending: torch.Tensor | None = None  # qwZ: the wire buffer on the wire, kept alive until wait()
    stream: torch.Stream | None = None
    dev: ModuleType | None = None  # torch's device module (torch.cuda, torch.cpu)
    then: Callable[[], None] | None = None

    def wait(self) -> None:
        dev = self.dev or torch.get_device_module("cpu")
        stream = self.stream or dev.current_stream()
        with dev.stream(stream):
            for work in self.works:
                work.wait()
            if self.finish is not None:
                self.finish()
            if self.then is not None:
                self.then()
            done = dev.Event()
            done.record(stream)
        dev.current_stream().wait_event(done)
        self.sending = None


def all_gather_weights(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: Group,
    phase: str,
    qwz_block: int | None = None,
    stream=None,
) -> PendingGather:
    """Start gathering every rank's 1-D `shard` [s] into `output` [group.size * s]
    (output.dtype); `qwz_block` quantizes the transfer (int8, one fp32 scale per block).
    `stream` (the engine's all-gather stream; default the current one) runs the quantize
    and the collective, after what the compute stream has queued (the shard's update, the
    output's allocation)."""
    if shard.dim() != 1 or output.dim() != 1 or output.numel() != group.size * shard.numel():
        raise ValueError(
            f"output {tuple(output.shape)} must be 1-D with {group.size} x {shard.numel()} elements "
            f"of the 1-D shard {tuple(shard.shape)}"
        )
    dev = torch.get_device_module(output.device)
    stream = stream or dev.current_stream()
    ready = dev.Event()
    ready.record(dev.current_stream())
    stream.wait_event(ready)
    with dev.stream(stream):
        if qwz_block is None or group.size == 1:
            work = comm.all_gather(output, shard, group, phase, async_op=True)
            return PendingGather([work], stream=stream, dev=dev)
        s = shard.numel()
        wire = quantize_wire(shard.reshape(1, s), qwz_block, QWZ_BITS)
        gathered = wire.new_empty(group.size, wire.shape[1])  # row j: group rank j's wire
        work = comm.all_gather(gathered.view(-1), wire.view(-1), group, phase, async_op=True)

    def decode() -> None:
        dequantize_wire(gathered, s, qwz_block, QWZ_BITS, out=output.view(group.size, s))

    return PendingGather([work], decode, sending=wire, stream=stream, dev=dev)


class SecondaryShard:
    """hpZ: this rank's slice of a unit's full weights within its hpZ group (`group`, inside one node).

    The step's first forward gather of the unit reads the primary shards over the whole ZeRO group and,
    on the gather stream before the compute stream may read the weights, leaves its slice here (`keep`);
    every later gather until the step (`stale`: the backward's, a recomputation's, the next
    micro-batches' forwards) reads only these (`serves`), so it never leaves the node. The weights change
    only at the step, so the secondary is never older than what the forward used."""

    def __init__(self, group: Group, padded: int, full: torch.Tensor | None, dtype, device):
        """`full`: the unit's full weights when it has them (else zeros: the first forward gather,
        which is its first reader, writes it)."""
        self.group = group
        self.numel = padded // group.size
        self.lo = group.rank * self.numel
        if full is None:
            self.shard = torch.zeros(self.numel, dtype=dtype, device=device)
        else:
            self.shard = full[self.lo : self.lo + self.numel].clone()
        self.current = False  # holds the weights of this step's first forward gather

    def serves(self, backward: bool) -> bool:
        """Whether a gather reads the secondaries: the backward's, and every one after the step's first."""
        return backward or self.current

    def keep(self, full: torch.Tensor) -> Callable[[], None] | None:
        """At the wait of a gather into `full`: the copy that refreshes the secondary (a PendingGather's
        `then`), if this is the step's first forward gather; None otherwise."""
        if self.current:
            return None
        self.current = True
        return lambda: self.shard.copy_(full[self.lo : self.lo + self.numel])

    def stale(self) -> None:
        """The shard changed (a step, a load): the next forward gather reads the primaries again."""
        self.current = False
