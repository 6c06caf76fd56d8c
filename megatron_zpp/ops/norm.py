"""Norm dispatch: our Triton kernels (megatron_zpp/kernels/norm.py) under --kernels (dispatch.use_triton),
else apex's fused CUDA norms when importable and the tensor is on a GPU, else the PyTorch reference
(computed in fp32, rounded once to the input's dtype). `backend()` says which path runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch

try:  # optional GPU dependency (present in NGC images)
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    HAVE_APEX = True
except Exception:  # noqa: BLE001  (ImportError, or apex built without its CUDA extension)
    HAVE_APEX = False

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WIDTH = 32768  # kernels/norm.py keeps one row in registers
dispatch.register("rms_norm", f"fp32/bf16/fp16, rows up to {MAX_WIDTH} wide")
dispatch.register("layer_norm", f"fp32/bf16/fp16, rows up to {MAX_WIDTH} wide")


def backend(device: torch.device) -> str:
    if dispatch.use_triton(torch.empty(0, device=device)):
        return "Triton norm kernels"
    if HAVE_APEX and device.type == "cuda":
        return "apex fused norm"
    return "torch norm (apex " + ("present, CPU run" if HAVE_APEX else "not installed") + ")"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps).to(x.dtype)


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        dispatch.use_triton(x)
        and x.dtype in KERNEL_DTYPES
        and weight.dtype in KERNEL_DTYPES
        and weight.dim() == 1
        and 0 < x.shape[-1] <= MAX_WIDTH
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit column stride (the kernels take a row stride)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _kernels():
    from ..kernels import norm  # lazily: triton is needed only once a kernel runs

    return norm


# The custom ops return tensors only: RMSNorm's missing mean and db come back as empty tensors.


@dispatch.kernel_op("norm_fwd")
def _norm_fwd(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = _kernels().norm_fwd(x2d, weight, bias, eps)
    return y, rstd.new_empty(0) if mean is None else mean, rstd


@_norm_fwd.register_fake
def _(x2d, weight, bias, eps):
    rows = x2d.shape[0]
    stats = x2d.new_empty(rows, dtype=torch.float32)
    return torch.empty_like(x2d), stats.new_empty(0 if bias is None else rows), stats


@dispatch.kernel_op("norm_bwd")
def _norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _kernels().norm_bwd(dy2d, x2d, weight, mean, rstd)
    return dx, dw, dw.new_empty(0) if db is None else db


@_norm_bwd.register_fake
def _(dy2d, x2d, weight, mean, rstd):
    return torch.empty_like(x2d), torch.empty_like(weight), weight.new_empty(0 if mean is None else weight.shape[0])


class NormFunction(torch.autograd.Function):
    """RMSNorm (bias None) or LayerNorm through the Triton kernels; saves x and the fp32 row statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _norm_fwd(_rows(x), weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _norm_bwd(_rows(dy), _rows(x), weight, mean if ctx.has_bias else None, rstd)
        return dx.view(x.shape), dw, db if ctx.has_bias else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _kernel_applies(x, weight):
        return NormFunction.apply(x, weight, None, eps)
    if HAVE_APEX and x.is_cuda and weight.dtype == x.dtype:  # apex's affine norms take one dtype
        return fused_rms_norm_affine(x, weight, weight.shape, eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if _kernel_applies(x, weight) and bias.dtype == weight.dtype:
        return NormFunction.apply(x, weight, bias, eps)
    if HAVE_APEX and x.is_cuda and weight.dtype == bias.dtype == x.dtype:
        return fused_layer_norm_affine(x, weight, bias, weight.shape, eps)
    return layer_norm_reference(x, weight, bias, eps)
