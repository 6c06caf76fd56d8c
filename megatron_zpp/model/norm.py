"""RMSNorm and LayerNorm. Their weights are replicated over TP; under sequence
parallelism each rank sees a different part of the sequence, so the weight grads are
partial sums per TP rank (`tp_partial_grad`: the optimizer's finalize sums them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops import norm as norm_ops
from ..tensor_parallel.layers import mark


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = mark(nn.Parameter(torch.empty(dim)), ("ones",), tp_partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = mark(nn.Parameter(torch.empty(dim)), ("ones",), tp_partial_grad=sequence_parallel)
        self.bias = mark(nn.Parameter(torch.empty(dim)), ("zeros",), tp_partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_ops.layer_norm(x, self.weight, self.bias, self.eps)


def build_norm(kind: str, dim: int, eps: float, sequence_parallel: bool = False) -> nn.Module:
    return {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}[kind](dim, eps, sequence_parallel)
