"""Feed-forward block: SwiGLU or GeLU (the default), column- then row-parallel, with biases under
--add-bias-linear (fc1's split like its output rows, gate and up sections alike)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..ops import swiglu as swiglu_ops
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .context import ParallelContext


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float, layer: int = 0):
        super().__init__()
        self.swiglu, self.gelu_approximate = cfg.activation == "swiglu", cfg.gelu_approximate
        self.squared_relu = cfg.activation == "squared_relu"
        shape = cfg.ffn(layer)  # a dense layer's (beside MoE layers too: --ffn-hidden-size, not the experts')
        ffn, bias, sp = shape.hidden, cfg.add_bias_linear, ctx.sequence_parallel
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, list(shape.sections), ctx.tp, cfg.init_method_std, sp, bias=bias
        )
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx.tp, out_std, sp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            h = swiglu_ops.swiglu(h)  # h is [gate | up] per rank: silu(gate) * up
        elif self.squared_relu:  # Megatron's squared_relu
            h = torch.square(F.relu(h))
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.fc2(h)
