"""RMSNorm and LayerNorm. Their weights are replicated over TP; under sequence
parallelism each rank sees a different part of the sequence, so the weight grads are
partial sums per TP rank (`tp_partial_grad`: the optimizer's finalize sums them).

--apply-layernorm-1p (`one_plus`): the stored weight w is zero-centred (initialised 0) and
the norm scales by 1 + w, as Megatron's zero_centered_gamma, for LayerNorm and RMSNorm alike
(its transformer-engine norms take it for both).

`FullWidthRMSNorm` (--qk-layernorm-full-width): one RMSNorm over all the heads of a projection, as OLMo 2's
q_norm/k_norm; its weight is split by heads over TP like the projection, and the sum of squares is summed over
the TP ranks (tensor_parallel.mappings.sum_over_tp: all-reduce both ways)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops import norm as norm_ops
from ..tensor_parallel.layers import mark
from ..tensor_parallel.mappings import sum_over_tp
from ..topology import Group


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False, one_plus: bool = False):
        super().__init__()
        self.eps, self.one_plus = eps, one_plus
        self.weight = mark(nn.Parameter(torch.empty(dim)), gain_init(one_plus), tp_partial_grad=sequence_parallel)

    def scale(self) -> torch.Tensor:
        return gain(self.weight, self.one_plus)


class RMSNorm(_Norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_ops.rms_norm(x, self.scale(), self.eps)


class LayerNorm(_Norm):
    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False, one_plus: bool = False):
        super().__init__(dim, eps, sequence_parallel, one_plus)
        self.bias = mark(nn.Parameter(torch.empty(dim)), ("zeros",), tp_partial_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale()
        return norm_ops.layer_norm(x, scale, self.bias.to(scale.dtype), self.eps)  # one dtype: one kernel call


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over every head of [..., heads/TP, head dim] together (`width`: all heads' channels, over TP)."""

    def __init__(self, width: int, eps: float, tp: Group | None, tp_size: int, one_plus: bool = False):
        super().__init__()
        self.width, self.eps, self.tp, self.one_plus = width, eps, tp, one_plus
        self.weight = mark(nn.Parameter(torch.empty(width // tp_size)), gain_init(one_plus), (0, (width,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2).float()
        square_sum = sum_over_tp(flat.pow(2).sum(-1, keepdim=True), self.tp)
        scale = gain(self.weight, self.one_plus).float()
        return (flat * torch.rsqrt(square_sum / self.width + self.eps) * scale).to(x.dtype).view_as(x)


def gain_init(one_plus: bool) -> tuple:
    """A norm weight's init: zeros when zero-centred (--apply-layernorm-1p: the gain 1 + w starts at 1), else ones."""
    return ("zeros",) if one_plus else ("ones",)


def gain(weight: torch.Tensor, one_plus: bool) -> torch.Tensor:
    """The weight a norm multiplies by: w, or 1 + w with --apply-layernorm-1p, formed in fp32 (fp64 stays fp64;
    as transformer-engine's zero-centred gamma and Qwen3-Next's `1.0 + weight.float()`): in bf16, 1 + w would
    round w to steps of 2^-7 near 1 and lose the zero-centred weight's precision."""
    return weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1 if one_plus else weight


def build_norm(kind: str, dim: int, eps: float, sequence_parallel: bool = False, one_plus: bool = False) -> nn.Module:
    return {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}[kind](dim, eps, sequence_parallel, one_plus)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (fp64 stays fp64) and back in x's dtype: fla's l2norm,
    the q/k norm of megatron-core's and Qwen3-Next's GDN and of Kimi Linear's KDA (eps under the root, on the sum
    of squares; F.normalize's 1e-12 bounds the norm itself)."""
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    return (y * torch.rsqrt(y.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
