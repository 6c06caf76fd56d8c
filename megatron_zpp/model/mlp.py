"""Feed-forward block: SwiGLU (default) or GeLU, column- then row-parallel."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..ops import swiglu as swiglu_ops
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .context import ParallelContext


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        ffn = cfg.ffn_size
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, [ffn, ffn] if self.swiglu else [ffn], ctx.tp, cfg.init_method_std, ctx.sequence_parallel
        )
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx.tp, out_std, ctx.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            h = swiglu_ops.swiglu(h)  # h is [gate | up] per rank: silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)
