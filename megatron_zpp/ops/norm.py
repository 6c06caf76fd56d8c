"""Norm dispatch: apex's fused CUDA norms when importable and the tensor is on a GPU,
else the PyTorch reference (computed in fp32). `backend()` says which path runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional GPU dependency (present in NGC images)
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    HAVE_APEX = True
except Exception:  # noqa: BLE001  (ImportError, or apex built without its CUDA extension)
    HAVE_APEX = False


def backend(device: torch.device) -> str:
    if HAVE_APEX and device.type == "cuda":
        return "apex fused norm"
    return "torch norm (apex " + ("present, CPU run" if HAVE_APEX else "not installed") + ")"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if HAVE_APEX and x.is_cuda:
        return fused_rms_norm_affine(x, weight, weight.shape, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if HAVE_APEX and x.is_cuda:
        return fused_layer_norm_affine(x, weight, bias, weight.shape, eps)
    return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps).to(x.dtype)
