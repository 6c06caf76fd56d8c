"""The MoE layer: router -> (capacity dropping, on this rank's tokens) -> dispatch to the experts' ranks
(moe/dispatch.py: alltoall or allgather; on one rank a local permute) -> the local experts -> combine
(probabilities applied after each expert's output, in fp32) -> + shared expert.

forward(x [B, T, H], this rank's tokens: under tensor parallelism its sequence shard, so --sequence-parallel
is required as megatron-core requires it) returns (y [B, T, H] in x's dtype, losses): this rank's pieces of
the router's balancing and z losses (each times its coefficient), whose sum over the tp_cp group is the loss
of the whole micro-batch on one rank, for the caller to add. `tokens_per_expert` holds, after a forward, the
rows each local expert ran on this rank (for the load log). The expert bias (when enabled) is updated by
`router.update_expert_bias()` after the optimizer step."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..recompute import recomputing
from ..topology import ParallelContext
from .config import MoEConfig
from .dispatch import AllGatherDispatcher, AllToAllDispatcher
from .experts import GroupedExperts
from .permute import capacity, drop_tokens
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
        if ctx.tp_size > 1 and not ctx.sequence_parallel:
            raise ValueError(
                "mixture of experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                "(each rank routes its own tokens), as megatron-core"
            )
        self.cfg, self.ctx = cfg, ctx
        self.router = TopKRouter(cfg, init_std, ctx.sequence_parallel, ctx.tp_cp)
        self.experts = GroupedExperts(cfg, ctx.ep, ctx.etp, init_std, out_std, dtype)
        self.shared_expert = SharedExpert(cfg, ctx, init_std, out_std, dtype) if cfg.shared_expert_size else None
        if cfg.token_dispatcher == "alltoall":
            self.dispatcher: AllToAllDispatcher | AllGatherDispatcher = AllToAllDispatcher(cfg, ctx.ep, ctx.etp)
        else:
            self.dispatcher = AllGatherDispatcher(cfg, ctx.ep, ctx.etp_ep)
        self.tokens_per_expert: torch.Tensor | None = None
        # with capacity: (routes, routes kept) of this rank's tokens while training, until the step reads them
        self.route_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, tokens = self.cfg, x.reshape(-1, x.shape[-1])
        routing = self.router(x)
        probs, routing_map = routing.probs, routing.routing_map
        num_out: int | None = tokens.shape[0] * cfg.topk  # dropless: known without a host sync
        if cfg.capacity_factor is not None:
            routes = routing_map.sum()
            probs, routing_map = drop_tokens(probs, routing_map, cfg.topk, cfg.capacity_factor, cfg.pad_to_capacity)
            if self.training and torch.is_grad_enabled() and not recomputing():
                counts = torch.stack([routes, routing_map.sum()]).double()
                self.route_counts = counts if self.route_counts is None else self.route_counts + counts
            cap = capacity(tokens.shape[0], cfg.num_experts, cfg.topk, cfg.capacity_factor)
            num_out = cfg.num_experts * min(cap, tokens.shape[0]) if cfg.pad_to_capacity else None
        out, tokens_per_expert = self.dispatcher(tokens, probs, routing_map, self.experts, num_out)
        self.tokens_per_expert = tokens_per_expert.detach()
        if self.shared_expert is not None:
            out = out + self.shared_expert(x).reshape_as(out)
        return out.view_as(x), routing.losses
