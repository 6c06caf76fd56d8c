"""The MoE layer on one rank: router -> (capacity dropping) -> permute -> grouped experts -> unpermute
(probabilities applied here, after each expert's output, in fp32) -> + shared expert.

forward(x [B, T, H]) returns (y [B, T, H] in x's dtype, losses): the router's balancing and z losses, each
already times its coefficient, for the caller to add to the language-model loss. The expert bias (when
enabled) is updated by `router.update_expert_bias()` after the optimizer step."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..topology import ParallelContext
from .config import MoEConfig
from .experts import GroupedExperts
from .permute import capacity, drop_tokens, permute, unpermute
from .router import TopKRouter
from .shared_expert import SharedExpert


class MoELayer(nn.Module):
    def __init__(
        self,
        cfg: MoEConfig,
        ctx: ParallelContext | None = None,
        init_std: float = 0.02,
        out_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        ctx = ParallelContext() if ctx is None else ctx
        self.cfg, self.ctx = cfg, ctx
        self.router = TopKRouter(cfg, init_std, ctx.sequence_parallel)
        self.experts = GroupedExperts(cfg, ctx.ep, ctx.etp, init_std, out_std, dtype)
        self.shared_expert = SharedExpert(cfg, ctx, init_std, out_std, dtype) if cfg.shared_expert_size else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, tokens = self.cfg, x.reshape(-1, x.shape[-1])
        routing = self.router(x)
        probs, routing_map = routing.probs, routing.routing_map
        num_out: int | None = tokens.shape[0] * cfg.topk  # dropless: known without a host sync
        if cfg.capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, cfg.topk, cfg.capacity_factor, cfg.pad_to_capacity)
            cap = capacity(tokens.shape[0], cfg.num_experts, cfg.topk, cfg.capacity_factor)
            num_out = cfg.num_experts * min(cap, tokens.shape[0]) if cfg.pad_to_capacity else None
        permuted, perm = permute(tokens, probs, routing_map, cfg.topk, num_out)
        out = unpermute(self.experts(permuted, perm.tokens_per_expert), perm, x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x).reshape_as(out)
        return out.view_as(x), routing.losses
