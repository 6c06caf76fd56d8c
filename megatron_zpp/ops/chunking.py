"""What the chunked linear-attention ops share (GLA's, Gated DeltaNet's and KDA's *_chunked.py and *_naive.py), as
fla's `ops/common`: the compute dtype, the input and chunk-size checks, the chunk layout [B, T, H, ...] <->
[B, H, N, C, ...] (N chunks of C tokens) and the delta rule's unit lower triangular inverse. Pure tensor code, no
autograd, no mixer's math."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32 (bf16/fp16 accumulate in fp32)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def check_chunk_size(T: int, chunk_size: int) -> None:
    if chunk_size <= 0 or T % chunk_size != 0:
        raise ValueError(f"sequence length T={T} must be a multiple of chunk_size={chunk_size}")


def check_shapes(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor | None, per_key: bool, **gates: Tensor) -> None:
    """q, k [B, T, H, K]; v [B, T, H, V]; initial_state [B, H, K, V] or None; each gate [B, T, H, K] when
    `per_key` (GLA's g), else [B, T, H] (Gated DeltaNet's g and beta)."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q, k must share shape [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] matching q's [B, T, H]; got {tuple(v.shape)}")
    want, dims = (tuple(q.shape), "[B, T, H, K]") if per_key else (tuple(q.shape[:3]), "[B, T, H]")
    for name, x in gates.items():
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must be {dims} = {want}; got {tuple(x.shape)}")
    B, _, H, K = q.shape
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}; got {tuple(initial_state.shape)}"
        )


def to_chunks(x: Tensor, chunk_size: int, dt: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], or [B, T, H] -> [B, H, N, C], in dt, contiguous: one matmul-friendly
    block per chunk."""
    B, T, H = x.shape[:3]
    x = x.to(dt).reshape(B, T // chunk_size, chunk_size, H, *x.shape[3:]).movedim(3, 1)
    return x.contiguous()


def from_chunks(x: Tensor) -> Tensor:
    """[B, H, N, C, D] -> [B, T, H, D], or [B, H, N, C] -> [B, T, H]."""
    B, H, N, C = x.shape[:4]
    return x.movedim(1, 3).reshape(B, N * C, H, *x.shape[4:])


def unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower triangular L [..., C, C] (the delta rule's UT transform)."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
