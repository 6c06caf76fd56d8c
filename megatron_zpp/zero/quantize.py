"""Block-wise symmetric quantization (ZeRO++ qwZ / qgZ): the codecs, no communication.

A 1-D tensor of n elements is cut into n/block blocks; each block gets one fp32 scale
= absmax/L (L = 127 for int8, 7 for int4) and its values become round(x/scale) in
-L..L. Dequantized error per element <= scale/2 = absmax/(2L): absmax/254 (int8),
absmax/14 (int4). All arithmetic runs in fp32 whatever the input dtype (bf16 is upcast,
never reinterpreted: DeepSpeed's fp16-only kernels read bf16 as fp16). An all-zero
block gets scale 0 and decodes to zeros; a NaN/inf in a block turns that whole block
into NaN after decoding, so overflow checks downstream still see it.

int4 storage: value q in -7..7 stored as the nibble q+8 (1..15), two per uint8 byte,
element 2i in the low nibble and element 2i+1 in the high nibble.

Everything is pure torch and allocates on the input's device (CPU or GPU).
"""

from __future__ import annotations

import torch

INT8_LEVELS = 127
INT4_LEVELS = 7


def _blocks(x: torch.Tensor, block: int, even: bool = False) -> torch.Tensor:
    """x [n] -> fp32 [n/block, block], after checking the shape contract."""
    if x.dim() != 1:
        raise ValueError(f"quantization takes a 1-D tensor, got shape {tuple(x.shape)}")
    if block < 1 or (even and block % 2):
        raise ValueError(f"block must be a positive{' even' if even else ''} integer, got {block}")
    if x.numel() % block:
        raise ValueError(
            f"numel {x.numel()} is not a multiple of block {block}; pad to {-(-x.numel() // block) * block}"
        )
    return x.reshape(-1, block).float()


def _quantize(x: torch.Tensor, block: int, levels: int, even: bool = False):
    """x [n] -> (q fp32 [n/block, block] integer-valued in -levels..levels, scales fp32 [n/block])."""
    xb = _blocks(x, block, even)
    scales = xb.abs().amax(dim=1) / levels
    # divide by 1 in zero blocks (q = 0, no 0/0); NaN/inf scales stay as they are
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(xb / safe[:, None]).clamp_(-levels, levels)  # round to nearest (ties to even)
    return q, scales


def _check_scales(numel: int, scales: torch.Tensor, block: int):
    if scales.numel() * block != numel:
        raise ValueError(f"{numel} values do not match {scales.numel()} scales of block {block}")


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (any float dtype, n % block == 0) -> (q int8 [n], scales fp32 [n/block])."""
    q, scales = _quantize(x, block, INT8_LEVELS)
    return q.to(torch.int8).reshape(-1), scales


def dequantize_int8(
    q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q int8 [n], scales fp32 [n/block] -> values [n] in `dtype` (computed in fp32)."""
    _check_scales(q.numel(), scales, block)
    return (q.reshape(-1, block).float() * scales.float()[:, None]).reshape(-1).to(dtype)


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (n % block == 0, block even) -> (packed uint8 [n/2], scales fp32 [n/block])."""
    q, scales = _quantize(x, block, INT4_LEVELS, even=True)
    nib = (q + 8).to(torch.uint8).reshape(-1, 2)  # 1..15, pairs (low, high)
    return nib[:, 0] | (nib[:, 1] << 4), scales


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [n/2], scales fp32 [n/block] -> values [n] in `dtype` (computed in fp32)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed int4 data must be uint8, got {packed.dtype}")
    _check_scales(2 * packed.numel(), scales, block)
    q = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1, block).float() - 8
    return (q * scales.float()[:, None]).reshape(-1).to(dtype)
