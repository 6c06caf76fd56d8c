"""Gradient reduce-scatters that run while the backward goes on: flat, or qgZ's hierarchy
of all-to-alls, optionally quantized.

A flat reduce-scatter over DP ranks spread on several nodes sends most of its bytes
across nodes. ZeRO++'s qgZ instead reduces hop by hop, innermost (fastest link) first:
each hop is one all-to-all inside a small group followed by a local sum, so the data a
rank sends shrinks by the hop's group size before it reaches the slower link. With
`bits` set, each hop quantizes what it sends once (int4 or int8, block-wise; data and
scales in one buffer, ops/quantize.py's wire format), so a k-level hierarchy quantizes
exactly k times whatever the world size, and every sum runs in fp32 on dequantized
values. Without `bits` the hierarchy moves fp32 and equals a flat reduce-scatter to
round-off (--zero-hierarchy without --zero-quantized-gradients).

Slice order: rank p of the DP group owns chunk p of the result (as in reduce-scatter).
Write p in mixed radix over the hop sizes r_0, r_1, ...: p = d0 + r0*d1 + r0*r1*d2 + ...
with d_i = this rank's index in its hop-i group. Viewing the flat gradient as
[r_k, ..., r_1, r_0, C], hop i moves the axis of digit i to the front, so slice j of the
send buffer holds exactly the chunks whose digit i is j and goes to hop member j. For
two levels (D ranks per node) this is the ZeRO++ paper's reordering "slice p goes to
position (p % D) * nodes + p // D", generalised to any number of tiers and any hop
sizes (odd node counts included).

Overlap: a reduction is an object in flight. `advance()` finishes its current hop (waits
for its all-to-all, dequantizes and sums) and starts the next; the engine advances every
pending reduction by one hop each time a later unit's gradients are ready, so each hop's
transfer overlaps a unit's backward; `result()` runs the rest. Collectives on one group
must start in the same order on every rank, so hops start only at these program points,
never on a timing-dependent condition such as "the transfer happens to be done".

The result is the SUM over all DP ranks, not the mean: the caller divides by the DP
size exactly once (DeepSpeed's qgZ shipped results scaled by D by dividing per hop).

Buffers: every buffer a reduction writes (wire copies, outputs, each hop's send, receive and sum)
comes from its `buffers` lease (zero/reduce_buffers.py: the engine's pool, reused every step; by
default plain allocations) and stays held by it until the caller gives it back after `finish`'s event.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..ops.quantize import dequantize_sum_quantize_wire, dequantize_sum_wire, quantize_wire, wire_bytes
from ..topology import Group
from .reduce_buffers import Lease

QGZ_BITS = 4  # qgZ: gradients travel as int4 (ZeRO++)


def padded_numel(n: int, dp: int, block: int) -> int:
    """Smallest multiple of dp*block >= n: the flat gradient size qgZ accepts."""
    unit = dp * block
    return -(-n // unit) * unit


def _ready_event(dev, stream):
    """`stream` waits for what the current (compute) stream has queued so far: the gradient."""
    ready = dev.Event()
    ready.record(dev.current_stream())
    stream.wait_event(ready)


class ReduceScatter:
    """A flat reduce-scatter of `flat` over `group` into an fp32 shard, in flight, on
    `stream` (default: the current one); `wire` (--grad-reduce-in-bf16: torch.bfloat16) is
    the dtype on the wire and of the sum, fp32 by default; `buffers`: where its buffers come from."""

    def __init__(
        self,
        flat: torch.Tensor,
        group: Group,
        phase: str,
        wire: torch.dtype = torch.float32,
        stream=None,
        buffers: Lease | None = None,
    ):
        self.dev = torch.get_device_module(flat.device)
        self.stream = stream or self.dev.current_stream()
        self.flat = flat  # read on the reduce stream: alive until the compute stream waited for `done`
        self.buffers = buffers or Lease(flat.device)
        _ready_event(self.dev, self.stream)
        with self.dev.stream(self.stream):
            self.out = self.buffers.empty((flat.numel() // group.size,), wire)
            self.source = flat if flat.dtype == wire else self.buffers.empty(flat.shape, wire).copy_(flat)
            self.work = comm.reduce_scatter(self.out, self.source, group, phase, async_op=True)

    def advance(self) -> None:
        """One collective: nothing to advance."""

    def finish(self, into: torch.Tensor):
        """On the reduce stream: wait for the wire, add the fp32 shard into `into`; returns the
        event the compute stream must wait on before it reads `into` or reuses `flat`."""
        with self.dev.stream(self.stream):
            self.work.wait()
            into.add_(self.out)  # in fp32 (type promotion), as the fp32 copy of `out` would
            done = self.dev.Event()
            done.record(self.stream)
        self.source = self.out = None
        return done

    def result(self) -> torch.Tensor:
        out = torch.zeros(self.out.numel(), dtype=torch.float32, device=self.out.device)
        self.dev.current_stream().wait_event(self.finish(out))
        return out


class HierarchicalReduceScatter:
    """Reduce-scatter `flat` over the DP ranks spanned by `hops`, hop by hop, in flight.

    flat: [N] full local gradient (any float dtype), N a multiple of dp*block where
        dp = prod(h.size for h in hops) (use padded_numel).
    hops: this rank's group per hop, innermost first (e.g. [intra-node, inter-node]);
        group-rank index in hops[i] = DP digit d_i (see the module docstring), as
        Topology.dp_tier_groups builds them.
    bits: None (send `wire`, default flat.dtype; every sum in fp32), 8 or 4 (quantize once
        per hop; `stochastic` rounding for unbiased int4 sums).
    streams: one stream per hop (--zero-hierarchy's link tiers; default: the current one):
        hop i's quantize -> all-to-all -> wait -> dequantize-sum (-> requantize) runs on
        streams[i], which waits for hop i-1's stream by an event (hop 0's waits for the
        compute stream, where the gradient was written). A hop's buffers are allocated, used
        on its own stream after the previous hop's wait (which orders that stream after NCCL's)
        and held by `buffers` (with `flat`, the compute stream's) until the caller has waited
        for finish()'s event: safe with TORCH_NCCL_AVOID_RECORD_STREAMS=1 and without.
    result(): [N/dp] fp32, chunk p (p = this rank's DP index) of the SUM over all DP ranks;
    finish(into): the same added into `into` on the last hop's stream, returning the event.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        hops: list[Group],
        phase: str,
        bits: int | None,
        block: int,
        stochastic: bool = False,
        wire: torch.dtype | None = None,
        streams: list | None = None,
        buffers: Lease | None = None,
    ):
        if bits not in (None, 4, 8):
            raise ValueError(f"bits must be None, 4 or 8, got {bits}")
        radices = [g.size for g in hops]
        dp = math.prod(radices)
        if flat.dim() != 1 or flat.numel() % (dp * block):
            raise ValueError(
                f"flat gradient of shape {tuple(flat.shape)} must be 1-D with numel a multiple of "
                f"dp*block = {dp}*{block}; pad it to padded_numel({flat.numel()}, {dp}, {block}) = "
                f"{padded_numel(flat.numel(), dp, block)} elements"
            )
        self.hops, self.phase, self.bits, self.block, self.stochastic = hops, phase, bits, block, stochastic
        self.wire = wire or flat.dtype
        self.chunk = flat.numel() // dp
        self.dev = torch.get_device_module(flat.device)
        self.streams = list(streams) if streams else [self.dev.current_stream()] * len(hops)
        self.flat = flat  # read on the reduce streams: alive until the compute stream waited for finish()
        self.buffers = buffers or Lease(flat.device)  # every buffer below, held until finish()'s event
        _ready_event(self.dev, self.streams[0])
        self.cur = flat.view(*reversed(radices), self.chunk)  # [r_k, ..., r_1, r_0, C]
        self.hop, self.work = 0, None
        self._start_hop()

    def _on(self):
        return self.dev.stream(self.streams[self.hop])

    def _handoff(self) -> None:
        """Hop `self.hop`'s stream waits for the previous hop's."""
        ev = self.dev.Event()
        ev.record(self.streams[self.hop - 1])
        self.streams[self.hop].wait_event(ev)

    @property
    def done(self) -> bool:
        return self.hop == len(self.hops)

    def _start_hop(self) -> None:
        with self._on():
            self._start_hop_here()

    def _start_hop_here(self) -> None:
        group = self.hops[self.hop]
        send = self.cur.movedim(-2, 0)  # [r_i, r_k, ..., r_{i+1}, C], a strided view
        self.rest = send.shape[1:]
        if group.size == 1:  # nothing moves, so nothing is quantized
            self.recv, self.work = send.contiguous(), None
            return
        if self.bits is None:
            self.send = self.buffers.empty(tuple(send.shape), self.wire).copy_(send)
        else:  # the quantizer reads the reordered slices in place
            out = self._wire_buffer(send.shape[0], math.prod(self.rest))
            self.send = quantize_wire(send, self.block, self.bits, stochastic=self.stochastic, out=out)
        self._send_wire(group)

    def _wire_buffer(self, rows: int, m: int) -> torch.Tensor:
        assert self.bits is not None  # only the quantized wire has a byte buffer
        return self.buffers.empty((rows, wire_bytes(m, self.block, self.bits)), torch.uint8)

    def _send_wire(self, group: Group) -> None:
        self.recv = self.buffers.empty(tuple(self.send.shape), self.send.dtype)
        self.work = comm.all_to_all(self.recv, self.send, group, self.phase, async_op=True)

    def _finish_hop(self) -> None:
        with self._on():
            nxt = self._finish_hop_here()
        if nxt:
            self._handoff()
            self._start_hop()

    def _finish_hop_here(self) -> bool:
        """Returns whether the next hop must start (on its own stream)."""
        if self.work is not None:
            self.work.wait()
        r, m = self.recv.shape[0], math.prod(self.rest)
        nxt = self.hops[self.hop + 1] if self.hop + 1 < len(self.hops) else None
        if self.bits is not None and self.work is not None and nxt is not None and nxt.size > 1:
            # a middle hop: the sum is requantized straight into the next hop's reordered wire
            out = self._wire_buffer(nxt.size, m // nxt.size)  # made on this hop's stream, read on the next's
            self.send = dequantize_sum_quantize_wire(
                self.recv, m, self.block, self.bits, nxt.size, self.chunk, stochastic=self.stochastic, out=out
            )
            self.rest, self.hop = (*self.rest[:-2], self.chunk), self.hop + 1
            self._handoff()
            with self._on():
                self._send_wire(nxt)
            return False
        out = self.buffers.empty((m,), torch.float32)
        if self.bits is None or self.work is None:
            summed = torch.sum(self.recv.view(r, m), 0, dtype=torch.float32, out=out)
        else:
            summed = dequantize_sum_wire(self.recv, m, self.block, self.bits, out)
        self.cur, self.send, self.recv = summed.view(self.rest), None, None  # fp32: [r_k, ..., r_{i+1}, C]
        self.hop += 1
        return not self.done

    def advance(self) -> None:
        if not self.done:
            self._finish_hop()

    def finish(self, into: torch.Tensor):
        """Run the remaining hops, add the fp32 result into `into` on the last hop's stream;
        returns the event the compute stream must wait on."""
        while not self.done:
            self._finish_hop()
        last = self.streams[-1]
        with self.dev.stream(last):
            into.add_(self.cur.reshape(self.chunk))
            done = self.dev.Event()
            done.record(last)
        self.cur = None
        return done

    def result(self) -> torch.Tensor:
        out = torch.zeros(self.chunk, dtype=torch.float32, device=self.flat.device)
        self.dev.current_stream().wait_event(self.finish(out))
        return out


def hierarchical_reduce_scatter(
    flat: torch.Tensor, hops: list[Group], phase: str, bits: int | None, block: int
) -> torch.Tensor:
    """HierarchicalReduceScatter run to the end; the result in flat.dtype (with bits=None
    it equals a flat reduce-scatter: exactly on integer-valued inputs, to round-off else)."""
    return HierarchicalReduceScatter(flat, hops, phase, bits, block).result().to(flat.dtype)
