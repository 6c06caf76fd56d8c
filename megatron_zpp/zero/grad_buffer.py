"""Plain data parallelism (ZeRO stage 0): gradients accumulate in one flat fp32 buffer
and are summed over the data-parallel group in buckets, during the backward when they
overlap it (--overlap-grad-reduce), else after it.

Each parameter's `.main_grad` is a view of the buffer; a post-accumulate hook adds the
fresh `.grad` into it and frees `.grad`, so bf16 models accumulate micro-batches in
fp32 (Megatron's main_grad). Chunks and their parameters are laid out in reverse order,
the order in which backward produces their gradients, and cut into buckets of about
`bucket_numel` elements at parameter boundaries (a bucket never spans two model chunks:
under the interleaved schedule each chunk's last backward ends at another time).

Overlap: with gradient accumulation only the step's last micro-batch may reduce, so the
schedule says before each backward of a chunk whether it is that chunk's last
(`set_last_micro_batch`). During that backward each hook counts its bucket down; a
bucket whose every gradient is in starts its async all-reduce. Buckets start in layout
order only (a complete bucket waits for the ones before it): collectives on one group
must start in the same order on every rank, and layout order is the same everywhere.
`finish()` starts what has not started (everything, without overlap or without the
schedule's signal) and waits for all. Buckets are not padded: the bytes are exactly a
ring all-reduce of the gradients, 2(n-1)/n x 4 x numel per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..topology import Group


@dataclass
class Bucket:
    data: torch.Tensor  # a view of the flat buffer
    chunk: int
    size: int  # parameters in it
    missing: int = 0  # gradients of the last micro-batch still to come
    work: dist.Work | None = None  # the all-reduce in flight, once started
    wire: torch.Tensor | None = None  # --grad-reduce-in-bf16: the bf16 copy on the wire (made once, reused)


def bucket_bounds(numels: list[int], bucket_numel: int | None) -> list[tuple[int, int]]:
    """(first, end) parameter indices of each bucket: a bucket closes at the first
    parameter boundary at or past `bucket_numel` elements (None: one bucket)."""
    bounds, start, size = [], 0, 0
    for i, n in enumerate(numels):
        size += n
        if bucket_numel is not None and size >= bucket_numel:
            bounds.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(numels):
        bounds.append((start, len(numels)))
    return bounds


class GradBuffer:
    def __init__(
        self,
        chunk_params: list[list[torch.nn.Parameter]],
        group: Group,
        bucket_numel: int | None,
        wire: torch.dtype = torch.float32,
        mean_over: int | None = None,
    ):
        """chunk_params: each model chunk's parameters (requires_grad) in model order;
        bucket_numel: elements per bucket (None: one bucket per chunk); wire: the dtype the
        buckets are all-reduced in (--grad-reduce-in-bf16: bf16; they accumulate in fp32);
        mean_over: what the sum is divided by (default the group's size; routed experts summed over
        the expert-data-parallel group are divided by DP x CP, the model replicas)."""
        self.group, self.wire = group, wire
        self.mean_over = group.size if mean_over is None else mean_over
        order = [(c, p) for c in reversed(range(len(chunk_params))) for p in reversed(chunk_params[c])]
        self.params = [p for _, p in order]
        device = self.params[0].device if self.params else None
        self.data = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=device)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        offset = 0
        for c in reversed(range(len(chunk_params))):
            params = list(reversed(chunk_params[c]))
            for first, end in bucket_bounds([p.numel() for p in params], bucket_numel):
                n = sum(p.numel() for p in params[first:end])
                bucket = Bucket(self.data[offset : offset + n], c, end - first, missing=end - first)
                for p in params[first:end]:
                    p.main_grad = self.data[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    self._bucket_of[id(p)] = bucket
                    p.register_post_accumulate_grad_hook(self._accumulate)
                self.buckets.append(bucket)
        self.last = [False] * len(chunk_params)
        self.started_in_backward = 0  # buckets whose all-reduce the backward started (this step)
        self._next = 0  # the next bucket to start, in layout order

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        self.last[chunk] = last

    def _accumulate(self, p: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        if bucket.work is not None:  # the wire reads the bucket: adding to it now would corrupt the sum
            raise RuntimeError(
                "a gradient arrived after its bucket's all-reduce started: a backward ran after the one the "
                "schedule announced as the chunk's last micro-batch (set_last_micro_batch)"
            )
        p.main_grad.add_(p.grad)
        p.grad = None
        if self.last[bucket.chunk]:
            bucket.missing -= 1
            if bucket.missing == 0:
                self._start_ready()

    def flush(self, chunk: int) -> None:
        """The end of the last backward of `chunk` (autograd's final callback): its buckets have
        every gradient they will get this step (a parameter the backward did not reach adds
        zeros), so they start now, still in layout order."""
        for bucket in self.buckets:
            if bucket.chunk == chunk:
                bucket.missing = 0
        self._start_ready()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].missing == 0:
            self._start(self.buckets[self._next])
            self.started_in_backward += 1

    def _start(self, bucket: Bucket) -> None:
        if self.wire == bucket.data.dtype:
            bucket.work = comm.all_reduce(bucket.data, self.group, "grad_allreduce", async_op=True)
        else:  # the sum runs in the wire dtype (NCCL: bf16 partial sums), then lands back in fp32
            if bucket.wire is None:  # the first step's: every later step reuses it
                bucket.wire = torch.empty(bucket.data.shape, dtype=self.wire, device=bucket.data.device)
            bucket.wire.copy_(bucket.data)
            bucket.work = comm.all_reduce(bucket.wire, self.group, "grad_allreduce", async_op=True)
        self._next += 1

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.missing, bucket.work = bucket.size, None
        self.last = [False] * len(self.last)
        self._next = 0

    def zero(self) -> None:
        self.data.zero_()
        self._reset()
        self.started_in_backward = 0

    def finish(self) -> None:
        """Sum the gradients over the group (start the buckets not yet started, in order,
        and wait for all), then divide by the group size: the mean over DP (x CP)."""
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        for bucket in self.buckets:
            assert bucket.work is not None  # every bucket was started above
            bucket.work.wait()
            if bucket.wire is not None:
                bucket.data.copy_(bucket.wire)
        self._reset()
        if self.mean_over > 1:
            self.data.div_(self.mean_over)
