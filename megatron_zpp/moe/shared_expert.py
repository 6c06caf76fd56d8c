"""The shared expert: a dense MLP every token passes through beside the routed experts (megatron-core's
SharedExpertMLP, --moe-shared-expert-intermediate-size), tensor-parallel like the dense MLP (column- then
row-parallel, with sequence parallelism when the context has it), optionally scaled per token by a sigmoid
gate Linear(h, 1) (--moe-shared-expert-gate; Qwen3-Next's `shared_expert_gate`). The gate is replicated
over TP and applied to this rank's tokens (its sequence shard under SP, whose gradient is then a partial
sum per TP rank, marked `tp_partial_grad`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import swiglu as swiglu_ops
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark
from ..topology import ParallelContext
from .config import MoEConfig


class SharedExpert(nn.Module):
    def __init__(self, cfg: MoEConfig, ctx: ParallelContext, init_std: float, out_std: float, dtype: torch.dtype):
        super().__init__()
        assert cfg.shared_expert_size, "SharedExpert needs MoEConfig.shared_expert_size"
        self.swiglu = cfg.activation == "swiglu"
        h, s, sp = cfg.hidden_size, cfg.shared_expert_size, ctx.sequence_parallel
        self.fc1 = ColumnParallelLinear(h, [s, s] if self.swiglu else s, ctx.tp, init_std, sp)
        self.fc2 = RowParallelLinear(s, h, ctx.tp, out_std, sp)
        self.gate = nn.Linear(h, 1, bias=False) if cfg.shared_expert_gate else None
        if self.gate is not None:
            mark(self.gate.weight, ("normal", init_std), tp_partial_grad=sp)
        for lin in (self.fc1, self.fc2, self.gate):
            if (
                lin is not None and not lin.weight.is_meta
            ):  # a local draw, so that a layer built alone runs; the model's
                # init redraws by name (on meta a draw is shapes only)
                nn.init.normal_(lin.weight, std=lin.weight.init[1])
        self.to(dtype)  # in place: the parameters keep their marks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's tokens [..., H] (its sequence shard under SP) -> [..., H] alike."""
        h = self.fc1(x)
        out = self.fc2(swiglu_ops.swiglu(h) if self.swiglu else F.gelu(h))
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out
