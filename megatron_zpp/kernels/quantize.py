"""ZeRO++ block quantizers on the one-buffer wire of megatron_zpp/ops/quantize.py (its docstring is the
format): per row, nb fp32 scales as bytes, then the data (int8, or int4 nibbles q + 8, element 2i low).

Each program takes BLOCKS blocks of one wire row as a [BLOCKS, LANES] tile of whole blocks, LANES the
block padded to a power of two, so every load and store of float elements is contiguous along the lanes
(16-byte vector accesses). int4 packs and unpacks in registers: the [B, LANES] codes viewed
[B, LANES/2, 2] split into the even (low nibble) and odd (high nibble) elements, and the unpacked
nibbles join back into element order, so the data bytes [B, LANES/2] move contiguously too. Scales
move as a [B, 4] tile of bytes: contiguous, so the compiler merges them into 4-byte stores where it
can prove a row's alignment (the wire's row stride specialized as a multiple of 16) and keeps single
bytes otherwise: no row needs 4-byte alignment. All math in fp32; the rounding is the reference's,
operation for operation: x / max(absmax / L, smallest subnormal) (IEEE division, div.rn.f32), then
round half to even by adding 1.5 * 2^23 and reading the low bits, or for stochastic rounding
floor(v + u) clamped to +-L with u from the reference's counter hash of (element index ^ seed), so the
wire bytes match the reference bit for bit. libdevice's flush-to-zero is off for these kernels (by
default floor compiles to cvt.rmi.ftz, and floor of a negative subnormal would give -0, not -1).

Kernels: quantize (any strided [r, G, C] source: qgZ's slice reorder is read in place), dequantize
(into a float destination), dequantize + sum of the wire rows (into fp32, optionally accumulating) and
qgZ's middle hop, dequantize + sum + quantize of the next hop's reordered rows in one pass. Offsets are
int64 (blocks, rows): a wire or source may pass 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals read inside @triton.jit code must be constexpr instances (a plain float, or one merely annotated
# `: tl.constexpr`, is a NameError when the kernel compiles; the interpreter does not check it).
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 v + this has ulp 1, so it rounds v to an integer
_U24 = tl.constexpr(5.9604644775390625e-08)  # 2^-24
_TILE_ELEMS = 4096  # elements per program (fewer when a row has fewer blocks)
_NUM_WARPS = 4  # 32 elements a thread at a full tile: 8 (bf16) or 4 (fp32) of them per 16-byte access


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
def _scale_bytes(row_ptr, blocks, bmask):
    """Pointers [B, 4] to the blocks' scale bytes (contiguous: 4 * B bytes from row_ptr + 4 * blocks[0])
    and their mask."""
    k = tl.arange(0, 4)
    return row_ptr + 4 * blocks[:, None] + k[None, :], bmask[:, None] & (k < 4)[None, :], k


@triton.jit
def _store_scales(row_ptr, blocks, bmask, scales):
    """fp32 scales [B] as little-endian bytes at row_ptr + 4 * block."""
    ptrs, mask, k = _scale_bytes(row_ptr, blocks, bmask)
    bits = scales.to(tl.uint32, bitcast=True)[:, None]
    tl.store(ptrs, ((bits >> (8 * k[None, :]).to(tl.uint32)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_scales(row_ptr, blocks, bmask):
    ptrs, mask, k = _scale_bytes(row_ptr, blocks, bmask)
    b = tl.load(ptrs, mask=mask, other=0).to(tl.uint32) << (8 * k[None, :]).to(tl.uint32)
    return tl.sum(b, axis=1).to(tl.float32, bitcast=True)  # disjoint bits: the sum is the OR


@triton.jit
def _pairs(blocks, bmask, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """int4: the data bytes [B, LANES/2] of the blocks (offsets from the data start) and their mask."""
    pairs = tl.arange(0, LANES // 2)
    offs = blocks[:, None] * (BLOCK // 2) + pairs[None, :]
    return offs, bmask[:, None] & (pairs < BLOCK // 2)[None, :]


@triton.jit
def _quantize_tile(
    x, mask, bmask, row_ptr, data_offset, blocks, lanes, cols, first_index, seed,
    BITS: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """fp32 x [B, LANES] (whole blocks; masked lanes must hold 0) -> the row's scales and data.
    cols: each lane's column in the row."""
    LEVELS: tl.constexpr = 127 if BITS == 8 else 7
    ax = tl.abs(x)
    absmax = tl.max(ax, axis=1)
    finite = ax < float("inf")  # False for NaN too
    nonfinite = tl.max((finite == 0).to(tl.int32), axis=1) > 0
    scales = tl.math.div_rn(absmax, tl.full(absmax.shape, LEVELS, tl.float32))
    # an all-zero block divides +-0 by the tiniest fp32 subnormal, made from its bits: Triton 3.6 types a
    # Python float below fp32's smallest normal as fp64, and div_rn then refuses it
    tiny = tl.full(scales.shape, 1, tl.int32).to(tl.float32, bitcast=True)
    divisor = tl.maximum(scales, tiny)[:, None]
    _store_scales(row_ptr, blocks, bmask, tl.where(nonfinite, float("nan"), scales))
    data_ptr = row_ptr + data_offset
    if BITS == 8:
        q = _codes(x, divisor, first_index + cols, seed, LEVELS, 0, STOCHASTIC) & 0xFF
        tl.store(data_ptr + cols, q.to(tl.uint8), mask=mask)
    else:
        q = _codes(x, divisor, first_index + cols, seed, LEVELS, 8, STOCHASTIC) & 0xF
        lo, hi = tl.split(tl.reshape(q, (q.shape[0], LANES // 2, 2)))  # elements 2i, 2i + 1
        offs, pmask = _pairs(blocks, bmask, BLOCK, LANES)
        tl.store(data_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=pmask)


@triton.jit
def _load_codes(row_ptr, data_offset, blocks, bmask, lanes, mask, BITS: tl.constexpr, BLOCK: tl.constexpr,
                LANES: tl.constexpr):  # fmt: skip
    """One wire row's blocks -> fp32 codes [B, LANES] in element order (masked lanes 0) and the blocks'
    scales [B, 1]."""
    scales = _load_scales(row_ptr, blocks, bmask)[:, None]
    data_ptr = row_ptr + data_offset
    if BITS == 8:
        byte = tl.load(data_ptr + blocks[:, None] * BLOCK + lanes[None, :], mask=mask, other=0).to(tl.int32)
        q = ((byte ^ 0x80) - 0x80).to(tl.float32)
    else:
        offs, pmask = _pairs(blocks, bmask, BLOCK, LANES)
        byte = tl.load(data_ptr + offs, mask=pmask, other=0x88).to(tl.int32)  # 0x88: codes 0 in the padding
        q = tl.reshape(tl.join((byte & 0xF) - 8, (byte >> 4) - 8), (byte.shape[0], LANES)).to(tl.float32)
    return q, scales


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
def _tile(nb, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr):
    """This program's blocks [B] (int64), lanes [L], masks, and each lane's column [B, L] in the row."""
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    lanes = tl.arange(0, LANES)
    bmask = blocks < nb
    mask = bmask[:, None] & (lanes < BLOCK)[None, :]
    cols = blocks[:, None] * BLOCK + lanes[None, :]
    return blocks, lanes, bmask, mask, cols


@triton.jit(do_not_specialize=["seed"])
def _quantize_kernel(
    x_ptr, wire_ptr, x_row_stride, x_group_stride, chunk, m, nb, wire_row_stride, data_offset, seed,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Row j of the wire = x[j] read as [G, C] (strides x_group_stride, 1), C = chunk a multiple of BLOCK."""
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BLOCK, BLOCKS, LANES)
    col0 = blocks * BLOCK  # a block never straddles two groups: chunk % BLOCK == 0
    src = (row * x_row_stride + (col0 // chunk) * x_group_stride + col0 % chunk)[:, None] + lanes[None, :]
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    row_ptr = wire_ptr + row * wire_row_stride
    _quantize_tile(
        x, mask, bmask, row_ptr, data_offset, blocks, lanes, cols, row * m, seed, BITS, BLOCK, LANES, STOCHASTIC
    )


@triton.jit
def _dequantize_kernel(
    wire_ptr, out_ptr, wire_row_stride, out_row_stride, nb, data_offset,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BLOCK, BLOCKS, LANES)
    row_ptr = wire_ptr + row * wire_row_stride
    q, scales = _load_codes(row_ptr, data_offset, blocks, bmask, lanes, mask, BITS, BLOCK, LANES)
    tl.store(out_ptr + row * out_row_stride + cols, _round_for(q * scales, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_rows(
    wire_ptr, wire_row_stride, data_offset, start, r, blocks, bmask, lanes, mask, acc,
    BITS: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """acc + rows start.. r-1 of the wire at `blocks`, in row order, each added as one fused multiply-add
    acc + q * scale (the reference's addcmul: one rounding per row)."""
    row_ptr = wire_ptr + start * wire_row_stride
    for _ in range(start, r):  # the pointer steps row by row: 64-bit, however large r * W
        q, scales = _load_codes(row_ptr, data_offset, blocks, bmask, lanes, mask, BITS, BLOCK, LANES)
        row_ptr += wire_row_stride
        acc = tl.fma(q, scales, acc)
    return acc


@triton.jit
def _sum_all_rows(
    wire_ptr, wire_row_stride, data_offset, r, blocks, bmask, lanes, mask,
    BITS: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """Rows 0..r-1 (r >= 1) summed: row 0 is the start, as in the reference (no 0 + x: keeps -0.0)."""
    q, scales = _load_codes(wire_ptr, data_offset, blocks, bmask, lanes, mask, BITS, BLOCK, LANES)
    return _sum_rows(
        wire_ptr, wire_row_stride, data_offset, 1, r, blocks, bmask, lanes, mask, q * scales, BITS, BLOCK, LANES
    )


@triton.jit
def _dequantize_sum_kernel(
    wire_ptr, out_ptr, wire_row_stride, r, nb, data_offset,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """fp32 out [m] (+)= the sum of the r wire rows."""
    blocks, lanes, bmask, mask, cols = _tile(nb, BLOCK, BLOCKS, LANES)
    if ACCUMULATE:
        acc = tl.load(out_ptr + cols, mask=mask, other=0.0)
        acc = _sum_rows(
            wire_ptr, wire_row_stride, data_offset, 0, r, blocks, bmask, lanes, mask, acc, BITS, BLOCK, LANES
        )
    else:
        acc = _sum_all_rows(wire_ptr, wire_row_stride, data_offset, r, blocks, bmask, lanes, mask, BITS, BLOCK, LANES)
    tl.store(out_ptr + cols, acc, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _dequantize_sum_quantize_kernel(
    wire_ptr, out_ptr, wire_row_stride, out_row_stride, r, nb, rows, chunk, m_out, data_offset_in,
    data_offset, seed,
    BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, LANES: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """Output row j, column c' = the summed input viewed [G, rows, chunk] at [c' // chunk, j, c' % chunk]:
    a whole input block, since chunk % BLOCK == 0, so each output block reads one block of every row."""
    row = tl.program_id(1).to(tl.int64)
    blocks, lanes, bmask, mask, cols = _tile(nb, BLOCK, BLOCKS, LANES)
    col0 = blocks * BLOCK
    src_blocks = ((col0 // chunk) * rows * chunk + row * chunk + col0 % chunk) // BLOCK
    acc = _sum_all_rows(
        wire_ptr, wire_row_stride, data_offset_in, r, src_blocks, bmask, lanes, mask, BITS, BLOCK, LANES
    )
    acc = tl.where(mask, acc, 0.0)
    row_ptr = out_ptr + row * out_row_stride
    _quantize_tile(
        acc, mask, bmask, row_ptr, data_offset, blocks, lanes, cols, row * m_out, seed, BITS, BLOCK, LANES, STOCHASTIC
    )


# ---------------------------------------------------------------- launch wrappers
# Every launch: _NUM_WARPS warps, one stage (no loop to pipeline but _sum_rows', one tile a row), and
# libdevice's flush-to-zero off (the reference's floor of subnormals: module docstring).
_LAUNCH = dict(num_warps=_NUM_WARPS, num_stages=1, enable_reflect_ftz=False)


def _geometry(nb: int, block: int) -> tuple[int, int]:
    """(blocks per program, lanes per block) for a row of nb blocks."""
    lanes = triton.next_power_of_2(block)
    per_program = max(1, min(triton.next_power_of_2(nb), _TILE_ELEMS // lanes))
    return per_program, lanes


def _data_offset(nb: int) -> int:
    """Bytes from a wire row's start to its data: the scales (its own argument, so that the launcher
    specializes it as a multiple of 16 when it is: then the data accesses are provably aligned)."""
    return 4 * nb


def quantize(
    x: torch.Tensor, row_stride: int, group_stride: int, chunk: int, r: int, m: int,
    wire: torch.Tensor, block: int, bits: int, seed: int | None,
) -> None:  # fmt: skip
    """Row j of `wire` (uint8 [r, W], unit column stride) = row j of the source quantized, the source's row
    j being m elements at x + j * row_stride laid out as [m / chunk, chunk] with strides (group_stride, 1).
    seed: None rounds to nearest, else stochastic rounding with that int32 seed."""
    nb = m // block
    per_program, lanes = _geometry(nb, block)
    grid = (triton.cdiv(nb, per_program), r)
    _quantize_kernel[grid](
        x, wire, row_stride, group_stride, chunk, m, nb, wire.stride(0), _data_offset(nb), 0 if seed is None else seed,
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, STOCHASTIC=seed is not None, **_LAUNCH,
    )  # fmt: skip


def dequantize(wire: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int) -> None:
    """wire uint8 [r, W] -> out [r, m] (fp32/bf16/fp16, unit column stride)."""
    nb = m // block
    per_program, lanes = _geometry(nb, block)
    grid = (triton.cdiv(nb, per_program), wire.shape[0])
    _dequantize_kernel[grid](
        wire, out, wire.stride(0), out.stride(0), nb, _data_offset(nb),
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, **_LAUNCH,
    )  # fmt: skip


def dequantize_sum(wire: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int, accumulate: bool) -> None:
    """wire uint8 [r, W] (r >= 1 unless accumulate) -> fp32 out [m] (contiguous) (+)= sum of the rows."""
    nb = m // block
    per_program, lanes = _geometry(nb, block)
    _dequantize_sum_kernel[(triton.cdiv(nb, per_program),)](
        wire, out, wire.stride(0), wire.shape[0], nb, _data_offset(nb),
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, ACCUMULATE=accumulate, **_LAUNCH,
    )  # fmt: skip


def dequantize_sum_quantize(
    wire: torch.Tensor, out: torch.Tensor, m: int, rows: int, chunk: int, block: int, bits: int, seed: int | None
) -> None:
    """wire uint8 [r >= 1, W(m)] -> out uint8 [rows, W(m / rows)]: the rows' sum viewed [G, rows, chunk],
    out row j = [:, j, :] quantized."""
    m_out = m // rows
    nb = m_out // block
    per_program, lanes = _geometry(nb, block)
    grid = (triton.cdiv(nb, per_program), rows)
    _dequantize_sum_quantize_kernel[grid](
        wire, out, wire.stride(0), out.stride(0), wire.shape[0], nb, rows, chunk, m_out,
        _data_offset(m // block), _data_offset(nb), 0 if seed is None else seed,
        BITS=bits, BLOCK=block, BLOCKS=per_program, LANES=lanes, STOCHASTIC=seed is not None, **_LAUNCH,
    )  # fmt: skip
