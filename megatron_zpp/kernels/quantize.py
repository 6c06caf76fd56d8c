"""ZeRO++ block quantizers on the one-buffer wire of megatron_zpp/ops/quantize.py (its docstring is the
format): per row, nb fp32 scales as bytes, then the data (int8, or int4 nibbles q + 8, element 2i low).

Each program takes BLOCKS blocks of one wire row as a [BLOCKS, LANES] tile (LANES: the block's elements
for int8, its byte pairs for int4: even and odd elements load separately, so packing is lane-local).
Scales move as four byte loads/stores, so no row needs 4-byte alignment. All math in fp32; the rounding
is the reference's, operation for operation: x / max(absmax / L, smallest subnormal) (IEEE division),
then round half to even by adding 1.5 * 2^23 and reading the low bits, or for stochastic rounding
floor(v + u) clamped to +-L with u from the reference's counter hash of (element index ^ seed), so
the wire bytes match the reference bit for bit.

Kernels: quantize (any strided [r, G, C] source: qgZ's slice reorder is read in place), dequantize
(into a float destination), dequantize + sum of the wire rows (into fp32, optionally accumulating) and
qgZ's middle hop, dequantize + sum + quantize of the next hop's reordered rows in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: fp32 v + this has ulp 1, so it rounds v to an integer (ties to even)
_TINY = 1.401298464324817e-45  # smallest fp32 subnormal: the divisor of an all-zero block
_U24 = 5.9604644775390625e-08  # 2^-24
_TILE_ELEMS = 4096  # elements per program (fewer when a row has fewer blocks)


@triton.jit
def _uniform(idx, seed):
    """u in [0, 1), 24 bits, from Wellons' 2-round hash of (uint32 index ^ seed): the reference's bits."""
    h = idx ^ seed
    h ^= h >> 16
    h *= 0x21F0AAAD
    h ^= h >> 15
    h *= 0x735A2D97
    h ^= h >> 15
    return (h >> 8).to(tl.float32) * _U24


@triton.jit
def _codes(x, divisor, index, seed, LEVELS: tl.constexpr, OFFSET: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 x [B, L] and per-block divisors [B, 1] -> int32 whose low byte is q + OFFSET."""
    v = tl.math.div_rn(x, divisor)
    if STOCHASTIC:
        u = _uniform(index.to(tl.uint32), seed.to(tl.uint32, bitcast=True))
        v = tl.minimum(tl.maximum(tl.math.floor(v + u), -LEVELS), LEVELS)
    return (v + (_ROUND_MAGIC + OFFSET)).to(tl.int32, bitcast=True)


@triton.jit
def _store_scales(row_ptr, blocks, bmask, scales):
    """fp32 scales [B] as little-endian bytes at row_ptr + 4 * block."""
    bits = scales.to(tl.uint32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(row_ptr + 4 * blocks + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=bmask)


@triton.jit
def _load_scales(row_ptr, blocks, bmask):
    bits = tl.zeros(blocks.shape, dtype=tl.uint32)
    for k in tl.static_range(4):
        bits |= tl.load(row_ptr + 4 * blocks + k, mask=bmask, other=0).to(tl.uint32) << (8 * k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(
    xa, xb, mask, bmask, row_ptr, blocks, cols, first_index, seed, nb,
    BITS: tl.constexpr, BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """fp32 values of a tile (int8: xa [B, BLOCK lanes]; int4: xa even, xb odd elements, [B, BLOCK/2])
    -> the row's scales and data. Masked lanes must hold 0. cols: the tile's output column of xa."""
    LEVELS: tl.constexpr = 127 if BITS == 8 else 7
    ax = tl.abs(xa)
    finite = ax < float("inf")  # False for NaN too
    if BITS == 4:
        ax = tl.maximum(ax, tl.abs(xb))
        finite = finite & (tl.abs(xb) < float("inf"))
    absmax = tl.max(ax, axis=1)
    nonfinite = tl.max((finite == 0).to(tl.int32), axis=1) > 0
    scales = tl.math.div_rn(absmax, tl.full(absmax.shape, LEVELS, tl.float32))
    divisor = tl.maximum(scales, _TINY)[:, None]  # an all-zero block divides +-0 by the tiniest subnormal
    _store_scales(row_ptr, blocks, bmask, tl.where(nonfinite, float("nan"), scales))
    data_ptr = row_ptr + 4 * nb
    if BITS == 8:
        q = _codes(xa, divisor, first_index + cols, seed, LEVELS, 0, STOCHASTIC) & 0xFF
        tl.store(data_ptr + cols, q.to(tl.uint8), mask=mask)
    else:
        lo = _codes(xa, divisor, first_index + cols, seed, LEVELS, 8, STOCHASTIC) & 0xF
        hi = _codes(xb, divisor, first_index + cols + 1, seed, LEVELS, 8, STOCHASTIC) & 0xF
        tl.store(data_ptr + cols // 2, (lo | (hi << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _load_codes(row_ptr, blocks, bmask, lanes, mask, nb, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One wire row's blocks -> fp32 codes (int8: (q, q) [B, BLOCK lanes]; int4: (even, odd) [B, BLOCK/2];
    masked lanes 0) and the blocks' scales [B, 1]."""
    scales = _load_scales(row_ptr, blocks, bmask)[:, None]
    data_ptr = row_ptr + 4 * nb + blocks[:, None] * (BLOCK if BITS == 8 else BLOCK // 2) + lanes[None, :]
    byte = tl.load(data_ptr, mask=mask, other=0).to(tl.int32)
    if BITS == 8:
        qa = ((byte ^ 0x80) - 0x80).to(tl.float32)
        qb = qa
    else:
        qa = tl.where(mask, (byte & 0xF) - 8, 0).to(tl.float32)
        qb = tl.where(mask, (byte >> 4) - 8, 0).to(tl.float32)
    return qa, qb, scales


@triton.jit
def _round_for(v, dtype: tl.constexpr):
    """fp32 -> dtype, to nearest even. bf16 by hand: the interpreter truncates fp32 -> bf16 (GPUs round)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(v != v, 0x7FC0, bits)  # NaN stays a (quiet) NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _tile(nb, BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr):
    """This program's blocks [B] (int64), lanes [L], masks, and each lane's first column [B, L] in the row."""
    blocks = (tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)).to(tl.int64)
    lanes = tl.arange(0, LANES)
    bmask = blocks < nb
    mask = bmask[:, None] & (lanes < (BLOCK if BITS == 8 else BLOCK // 2))[None, :]
    cols = blocks[:, None] * BLOCK + lanes[None, :] * (1 if BITS == 8 else 2)
    return blocks, lanes, bmask, mask, cols


@triton.jit(do_not_specialize=["seed"])
def _quantize_kernel(
    x_ptr, wire_ptr, x_row_stride, x_group_stride, chunk, m, nb, wire_row_stride, seed,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Row j of the wire = x[j] read as [G, C] (strides x_group_stride, 1), C = chunk a multiple of BLOCK."""
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BITS, BLOCK, BLOCKS, LANES)
    col0 = blocks * BLOCK  # a block never straddles two groups: chunk % BLOCK == 0
    src = (row * x_row_stride + (col0 // chunk) * x_group_stride + col0 % chunk)[:, None] + (cols - col0[:, None])
    xa = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    xb = xa
    if BITS == 4:
        xb = tl.load(x_ptr + src + 1, mask=mask, other=0.0).to(tl.float32)
    row_ptr = wire_ptr + row * wire_row_stride
    _quantize_tile(xa, xb, mask, bmask, row_ptr, blocks, cols, row * m, seed, nb, BITS, BLOCK, STOCHASTIC)


@triton.jit
def _dequantize_kernel(
    wire_ptr, out_ptr, wire_row_stride, out_row_stride, nb,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BITS, BLOCK, BLOCKS, LANES)
    qa, qb, scales = _load_codes(wire_ptr + row * wire_row_stride, blocks, bmask, lanes, mask, nb, BITS, BLOCK)
    dst = out_ptr + row * out_row_stride + cols
    tl.store(dst, _round_for(qa * scales, out_ptr.dtype.element_ty), mask=mask)
    if BITS == 4:
        tl.store(dst + 1, _round_for(qb * scales, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_rows(
    wire_ptr, wire_row_stride, start, r, blocks, bmask, lanes, mask, nb, acc_a, acc_b,
    BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """acc + rows start.. r-1 of the wire at `blocks`, in row order, each added as one fused multiply-add
    acc + q * scale (the reference's addcmul: one rounding per row)."""
    row_ptr = wire_ptr + start * wire_row_stride
    for _ in range(start, r):  # the pointer steps row by row: 64-bit, however large r * W
        qa, qb, scales = _load_codes(row_ptr, blocks, bmask, lanes, mask, nb, BITS, BLOCK)
        row_ptr += wire_row_stride
        acc_a = tl.fma(qa, scales, acc_a)
        if BITS == 4:
            acc_b = tl.fma(qb, scales, acc_b)
    return acc_a, acc_b


@triton.jit
def _sum_all_rows(
    wire_ptr, wire_row_stride, r, blocks, bmask, lanes, mask, nb, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    """Rows 0..r-1 (r >= 1) summed: row 0 is the start, as in the reference (no 0 + x: keeps -0.0)."""
    qa, qb, scales = _load_codes(wire_ptr, blocks, bmask, lanes, mask, nb, BITS, BLOCK)
    acc_a, acc_b = qa * scales, qb * scales
    return _sum_rows(wire_ptr, wire_row_stride, 1, r, blocks, bmask, lanes, mask, nb, acc_a, acc_b, BITS, BLOCK)


@triton.jit
def _dequantize_sum_kernel(
    wire_ptr, out_ptr, wire_row_stride, r, nb,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """fp32 out [m] (+)= the sum of the r wire rows."""
    blocks, lanes, bmask, mask, cols = _tile(nb, BITS, BLOCK, BLOCKS, LANES)
    if ACCUMULATE:
        acc_a = tl.load(out_ptr + cols, mask=mask, other=0.0)
        acc_b = acc_a
        if BITS == 4:
            acc_b = tl.load(out_ptr + cols + 1, mask=mask, other=0.0)
        acc_a, acc_b = _sum_rows(
            wire_ptr, wire_row_stride, 0, r, blocks, bmask, lanes, mask, nb, acc_a, acc_b, BITS, BLOCK
        )
    else:
        acc_a, acc_b = _sum_all_rows(wire_ptr, wire_row_stride, r, blocks, bmask, lanes, mask, nb, BITS, BLOCK)
    tl.store(out_ptr + cols, acc_a, mask=mask)
    if BITS == 4:
        tl.store(out_ptr + cols + 1, acc_b, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _dequantize_sum_quantize_kernel(
    wire_ptr, out_ptr, wire_row_stride, out_row_stride, r, nb_in, nb, rows, chunk, m_out, seed,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Output row j, column c' = the summed input viewed [G, rows, chunk] at [c' // chunk, j, c' % chunk]:
    a whole input block, since chunk % BLOCK == 0, so each output block reads one block of every row."""
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BITS, BLOCK, BLOCKS, LANES)
    col0 = blocks * BLOCK
    src_blocks = ((col0 // chunk) * rows * chunk + row * chunk + col0 % chunk) // BLOCK
    acc_a, acc_b = _sum_all_rows(wire_ptr, wire_row_stride, r, src_blocks, bmask, lanes, mask, nb_in, BITS, BLOCK)
    acc_a, acc_b = tl.where(mask, acc_a, 0.0), tl.where(mask, acc_b, 0.0)
    row_ptr = out_ptr + row * out_row_stride
    _quantize_tile(acc_a, acc_b, mask, bmask, row_ptr, blocks, cols, row * m_out, seed, nb, BITS, BLOCK, STOCHASTIC)


# ---------------------------------------------------------------- launch wrappers


def _geometry(nb: int, block: int, bits: int) -> tuple[int, int]:
    """(blocks per program, lanes per block) for a row of nb blocks."""
    lanes = triton.next_power_of_2(block if bits == 8 else block // 2)
    per_program = max(1, min(triton.next_power_of_2(nb), _TILE_ELEMS // lanes))
    return per_program, lanes


def quantize(
    x: torch.Tensor, row_stride: int, group_stride: int, chunk: int, r: int, m: int,
    wire: torch.Tensor, block: int, bits: int, seed: int | None,
) -> None:  # fmt: skip
    """Row j of `wire` (uint8 [r, W], unit column stride) = row j of the source quantized, the source's row
    j being m elements at x + j * row_stride laid out as [m / chunk, chunk] with strides (group_stride, 1).
    seed: None rounds to nearest, else stochastic rounding with that int32 seed."""
    nb = m // block
    per_program, lanes = _geometry(nb, block, bits)
    grid = (triton.cdiv(nb, per_program), r)
    _quantize_kernel[grid](
        x, wire, row_stride, group_stride, chunk, m, nb, wire.stride(0), 0 if seed is None else seed,
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, STOCHASTIC=seed is not None,
    )  # fmt: skip


def dequantize(wire: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int) -> None:
    """wire uint8 [r, W] -> out [r, m] (fp32/bf16/fp16, unit column stride)."""
    nb = m // block
    per_program, lanes = _geometry(nb, block, bits)
    grid = (triton.cdiv(nb, per_program), wire.shape[0])
    _dequantize_kernel[grid](
        wire, out, wire.stride(0), out.stride(0), nb, BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes
    )


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int, accumulate: bool) -> None:
    """wire uint8 [r, W] (r >= 1 unless accumulate) -> fp32 out [m] (contiguous) (+)= sum of the rows."""
    nb = m // block
    per_program, lanes = _geometry(nb, block, bits)
    _dequantize_sum_kernel[(triton.cdiv(nb, per_program),)](
        wire, out, wire.stride(0), wire.shape[0], nb,
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, ACCUMULATE=accumulate,
    )  # fmt: skip


def dequantize_sum_quantize(
    wire: torch.Tensor, out: torch.Tensor, m: int, rows: int, chunk: int, block: int, bits: int, seed: int | None
) -> None:
    """wire uint8 [r >= 1, W(m)] -> out uint8 [rows, W(m / rows)]: the rows' sum viewed [G, rows, chunk],
    out row j = [:, j, :] quantized."""
    m_out = m // rows
    nb = m_out // block
    per_program, lanes = _geometry(nb, block, bits)
    grid = (triton.cdiv(nb, per_program), rows)
    _dequantize_sum_quantize_kernel[grid](
        wire, out, wire.stride(0), out.stride(0), wire.shape[0], m // block, nb, rows, chunk, m_out,
        0 if seed is None else seed,
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, STOCHASTIC=seed is not None,
    )  # fmt: skip
