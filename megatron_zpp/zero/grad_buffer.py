"""Plain data parallelism (ZeRO stage 0): gradients accumulate in one flat fp32 buffer
and are averaged over the data-parallel group in buckets.

Each parameter's `.main_grad` is a view of the buffer; a post-accumulate hook adds the
fresh `.grad` into it and frees `.grad`, so bf16 models accumulate micro-batches in
fp32 (Megatron's main_grad). Parameters are laid out in reverse order, the order in
which backward produces their gradients."""

from __future__ import annotations

import torch

from .. import comm
from ..topology import Group


class GradBuffer:
    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20):
        self.params = [p for p in params if p.requires_grad]
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        self.bucket_numel = max(bucket_bytes // 4, 1)
        offset = 0
        for p in reversed(self.params):
            p.main_grad = self.data[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        self.data.zero_()

    def all_reduce_mean(self, group: Group) -> None:
        """Average gradients over `group` (DP, or DP x CP when weights are replicated over CP)."""
        if group.size == 1:
            return
        handles = [
            comm.all_reduce(bucket, group, "grad_allreduce", async_op=True)
            for bucket in self.data.split(self.bucket_numel)
        ]
        for h in handles:
            h.wait()
        self.data.div_(group.size)
