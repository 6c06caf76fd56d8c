"""The buffers of ZeRO's gradient reductions, allocated once and reused every step.

Each reduction (zero/grad_reduce.py) takes what it needs from one pool through a `Lease`: ZeRO-2/3's
fp32 accumulator of a unit's flat gradient, the wire copy (--grad-reduce-in-bf16), the reduce-scatter
output, each qgZ hop's quantized send and receive buffers and its fp32 sum. The lease keeps them all
alive until the compute stream has waited for the reduction's last event, then gives them back with
that event; a later take on any stream first makes that stream wait for it, so a buffer is never
rewritten while a collective or another stream may still read it (with TORCH_NCCL_AVOID_RECORD_STREAMS=1
and without: the buffers are never freed to the caching allocator).

The reduction schedule is fixed by the program, so every step takes and gives back the same buffers in
the same order: the pool grows to the step's peak during the first step and allocates nothing after it
(`allocations` stays put), and since a take gets the free buffer of lowest address, every later step
hands out the very same buffers in the same order (as DeepSpeed's reduce buckets and Megatron's grad
buffers, but sized by the units actually in flight, not by the model).
"""

from __future__ import annotations

import heapq
import itertools
import math

import torch


class ReduceBuffers:
    """Free 1-D buffers by (numel, dtype), lowest address first, each with the event after which it may be
    reused."""

    def __init__(self, device: torch.device):
        self.device = device
        self.dev = torch.get_device_module(device)
        self._free: dict[tuple[int, torch.dtype], list[tuple[int, int, torch.Tensor, object]]] = {}  # heaps
        self._order = itertools.count()  # ties (empty buffers share an address) go first in, first out
        self.allocations = 0  # buffers ever allocated: constant from the second step on
        self.taken: list[int] = []  # data_ptr of every buffer handed out (tests clear and compare it)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of `numel` elements (contents undefined), usable on the current stream."""
        free = self._free.get((numel, dtype))
        if free:
            *_, buf, ready = heapq.heappop(free)
            if ready is not None:
                self.dev.current_stream().wait_event(ready)
        else:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self.allocations += 1
        self.taken.append(buf.data_ptr())
        return buf

    def give(self, buf: torch.Tensor, ready=None) -> None:
        """Return `buf`; `ready`: the event after which no stream reads or writes it (None: now)."""
        heapq.heappush(
            self._free.setdefault((buf.numel(), buf.dtype), []), (buf.data_ptr(), next(self._order), buf, ready)
        )

    def lease(self) -> Lease:
        return Lease(self.device, self)


class Lease:
    """The buffers one reduction took, held until `give_back` (with no pool: plain allocations, held
    the same way and then dropped)."""

    def __init__(self, device: torch.device, pool: ReduceBuffers | None = None):
        self.device, self.pool = device, pool
        self.held: list[torch.Tensor] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.pool.take(n, dtype) if self.pool else torch.empty(n, dtype=dtype, device=self.device)
        self.held.append(buf)
        return buf.view(shape)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def adopt(self, buf: torch.Tensor) -> None:
        """Hold `buf` (a buffer taken from the pool before the reduction existed) with the others."""
        self.held.append(buf)

    def give_back(self, ready=None) -> None:
        if self.pool is not None:
            for buf in self.held:
                self.pool.give(buf, ready)
        self.held = []
