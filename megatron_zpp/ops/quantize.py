"""Block-wise symmetric quantization (ZeRO++ qwZ / qgZ): the codecs and their wire format, no communication.

A 1-D tensor of n elements is cut into n/block blocks; each block gets one fp32 scale
= absmax/L (L = 127 for int8, 7 for int4) and its values become round(x/scale) in
-L..L. Dequantized error per element <= scale/2 = absmax/(2L): absmax/254 (int8),
absmax/14 (int4). All arithmetic runs in fp32 whatever the input dtype (bf16 is upcast,
never reinterpreted: DeepSpeed's fp16-only kernels read bf16 as fp16). An all-zero
block gets scale 0 and decodes to zeros; a NaN/inf in a block gives that block a NaN
scale, so the whole block decodes to NaN and overflow checks downstream still see it
(the data bytes of such a block are unspecified).

int4 storage: value q in -7..7 stored as the nibble q+8 (1..15), two per uint8 byte,
element 2i in the low nibble and element 2i+1 in the high nibble.

Wire format (one buffer, so data and scales travel in ONE collective): a [r, m] tensor
becomes uint8 [r, wire_bytes(m, block, bits)]; row j is row j of the input quantized on
its own, laid out as

    [ m/block fp32 scales (native byte order) | data: m int8 bytes, or m/2 int4 bytes ]

so an all-to-all sends row j to rank j and an all-gather concatenates rows. Required:
m a multiple of block, block even for int4. A fp32 view of the scales needs 4-byte
alignment (row stride a multiple of 4: m % 4 == 0 for int8, m % 8 == 0 for int4, as any
power-of-two block >= 8 gives); otherwise the scales are copied (m/block values), never
the data. `stochastic=True` rounds to floor(x/scale + u), u uniform in [0, 1) from a
counter-based hash of the element index and a seed drawn from `generator`: unbiased
(E[dequantized] = x, up to fp32 rounding of x/scale + u) and within one level of x.

Speed: eager torch, chunk by chunk (512K elements on CPU, 2 MiB of fp32) so that after
the first read of a chunk its few in-place passes run in cache, and no whole-buffer fp32
temporary exists; dequantize writes straight into `out`, the reduce of wire rows adds each
row into `out`. The chunk scratch is kept per thread on CPU (a fresh one per call would
page-fault every call). Everything is pure torch and runs on the input's device (on GPU in
16M-element chunks).

Kernels: under --kernels (ops/dispatch.py) the wire functions run megatron_zpp/kernels/quantize.py
instead, with the same bytes out (round to nearest and stochastic: the kernel computes the same hash);
a float side in fp32/bf16/fp16 (else the reference). quantize_wire then reads a strided [r, G, C]
source in place (qgZ's slice reorder), and dequantize_sum_quantize_wire (qgZ's middle hop) sums and
requantizes in one pass. The separate data/scales API (quantize_int8, ...) is reference only.
`quantizer_backend(device)` names the path for the start-up log.
"""

from __future__ import annotations

import math
import sys
import threading

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from . import dispatch

INT8_LEVELS = 127
INT4_LEVELS = 7
LEVELS = {8: INT8_LEVELS, 4: INT4_LEVELS}
SCALE_BYTES = 4  # one fp32 per block
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the Triton kernels' float side
dispatch.register("quantize", "int8/int4 wire, fp32/bf16/fp16; qgZ reorder and middle hop fused")

# elements per eager chunk: on CPU its fp32 scratch stays in cache (512K measured best on a Zen 3 core,
# bench/quantize.py); elsewhere it only bounds the temporaries
_CHUNK = {"cpu": 1 << 19}
_CHUNK_DEFAULT = 1 << 24

# ---------------------------------------------------------------- shapes and the wire layout


def _check_geometry(m: int, block: int, bits: int) -> int:
    """m elements in blocks of `block` for `bits`; returns the number of blocks."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    even = bits == 4
    if block < 1 or (even and block % 2):
        raise ValueError(f"block must be a positive{' even' if even else ''} integer, got {block}")
    if m < 0 or m % block:
        raise ValueError(f"numel {m} is not a multiple of block {block}; pad to {-(-m // block) * block}")
    return m // block


def data_bytes(numel: int, bits: int) -> int:
    """Bytes of the quantized values of `numel` elements (no scales)."""
    return numel if bits == 8 else numel // 2


def wire_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes of one quantized slice of `numel` elements on the wire: its data + its fp32 scales."""
    nb = _check_geometry(numel, block, bits)
    return SCALE_BYTES * nb + data_bytes(numel, bits)


def _split_wire(buf: torch.Tensor, m: int, block: int, bits: int):
    """uint8 [r, W] -> (scale bytes [r, 4 nb], data [r, nb, block or block/2] int8/uint8 views)."""
    nb = _check_geometry(m, block, bits)
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != wire_bytes(m, block, bits):
        raise ValueError(
            f"wire buffer must be uint8 [r, {wire_bytes(m, block, bits)}] for {m} elements, block {block}, "
            f"int{bits}; got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.shape[0] and buf.stride(1) != 1:
        raise ValueError("wire buffer rows must be contiguous")
    head = SCALE_BYTES * nb
    data = buf[:, head:]
    data = data.view(torch.int8) if bits == 8 else data
    return buf[:, :head], data.unflatten(1, (nb, data_bytes(block, bits)))


def _read_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [r, 4 nb] -> fp32 [r, nb]: a view when 4-byte aligned, else a copy (nb values per row)."""
    r, head = scale_bytes.shape
    aligned = scale_bytes.data_ptr() % SCALE_BYTES == 0 and (r <= 1 or scale_bytes.stride(0) % SCALE_BYTES == 0)
    if not aligned:
        scale_bytes = scale_bytes.contiguous()
    if r <= 1:  # a size-1 dim's stride need not be a multiple of 4
        return scale_bytes.reshape(-1).view(torch.float32).view(r, head // SCALE_BYTES)
    return scale_bytes.view(torch.float32)


def _scales_from_absmax(absmax: torch.Tensor, levels: int) -> torch.Tensor:
    """fp32 absmax -> scales absmax/L; a non-finite block gets a NaN scale so it decodes to NaN."""
    scales = absmax / levels
    return scales.masked_fill_(~torch.isfinite(scales), float("nan"))


# ---------------------------------------------------------------- stochastic rounding noise


def _draw_seed(generator: torch.Generator | None) -> int:
    """A 32-bit seed (as int32) from `generator` (the default CPU generator when None). Drawn outside any
    FakeTensorMode: the generator is real host state, so a shapes-only run draws (and advances) as eager does."""
    device = generator.device if generator is not None else "cpu"
    with unset_fake_temporarily():
        return int(torch.randint(-(1 << 31), 1 << 31, (), generator=generator, device=device, dtype=torch.int64))


def _logical_shift_xor_(h: torch.Tensor, shift: int, tmp: torch.Tensor) -> torch.Tensor:
    """h ^= h >> shift as unsigned 32-bit (int32 >> sign-extends, so mask the copied sign bits)."""
    torch.bitwise_right_shift(h, shift, out=tmp).bitwise_and_((1 << (32 - shift)) - 1)
    return h.bitwise_xor_(tmp)


def _add_uniform_(v: torch.Tensor, first_index: int, seed: int, s: _Scratch) -> None:
    """v += u, u in [0, 1) (24 bits) from Wellons' 2-round 32-bit hash of (element index ^ seed), in
    place in int32 (multiplies wrap mod 2^32 as the hash wants). The chunk's elements have consecutive
    indices from `first_index` (mod 2^32); the same bits on every device."""
    h = s.take("i32", v.shape).view(-1)
    torch.arange(h.numel(), dtype=torch.int32, device=v.device, out=h)
    tmp = s.take("i32b", h.shape)
    h.add_(_to_int32(first_index)).bitwise_xor_(seed)
    _logical_shift_xor_(h, 16, tmp).mul_(0x21F0AAAD)
    _logical_shift_xor_(h, 15, tmp).mul_(0x735A2D97)
    _logical_shift_xor_(h, 15, tmp)
    torch.bitwise_right_shift(h, 8, out=tmp).bitwise_and_(0xFFFFFF)
    v.add_(tmp.view(v.shape), alpha=2.0**-24)


def _to_int32(i: int) -> int:
    """i mod 2^32 as a signed int32 value."""
    i &= 0xFFFFFFFF
    return i - (1 << 32) if i >= 1 << 31 else i


# ---------------------------------------------------------------- eager kernels, chunk by chunk


def _on_host(t: torch.Tensor) -> bool:
    """A real CPU tensor: cache-sized chunks and per-thread scratch. A fake one (a dry run) is chunked as
    on an accelerator, what the run it stands for does, and keeps no scratch beyond the call."""
    return t.device.type == "cpu" and not is_fake(t)


def _chunk_elems(t: torch.Tensor) -> int:
    return _CHUNK["cpu"] if _on_host(t) else _CHUNK_DEFAULT


def _chunks(r: int, nb: int, block: int, elems: int):
    """(rows, blocks) slices covering [r, nb] in chunks of about `elems` elements."""
    per_chunk = max(1, elems // block)  # blocks
    if nb <= per_chunk:  # whole rows
        rows = max(1, per_chunk // max(nb, 1))
        return [(slice(a, a + rows), slice(None)) for a in range(0, r, rows)]
    return [(slice(a, a + 1), slice(b, b + per_chunk)) for a in range(r) for b in range(0, nb, per_chunk)]


class _Scratch:
    """Chunk-sized scratch buffers viewed at the chunk's shape. On CPU they are kept per thread and
    reused across calls (a fresh allocation per call page-faults every call); elsewhere they live for
    one call (the caching allocator reuses them)."""

    DTYPES = {"f32": torch.float32, "i8": torch.int8, "i16": torch.int16, "i16b": torch.int16}
    DTYPES |= {"i32": torch.int32, "i32b": torch.int32}  # stochastic rounding's hash
    _local = threading.local()

    def __init__(self, elems: int, like: torch.Tensor):
        self.elems, self.device, self.bufs = elems, like.device, {}
        if _on_host(like):
            self.bufs = self._local.__dict__.setdefault("bufs", {})

    def take(self, name: str, shape) -> torch.Tensor:
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < self.elems:
            buf = self.bufs[name] = torch.empty(self.elems, dtype=self.DTYPES[name], device=self.device)
        return buf[: shape.numel()].view(shape)


def _pack_int4_(nibbles: torch.Tensor, out: torch.Tensor, s: _Scratch) -> None:
    """int8 nibbles q+8 [.., block] (1..15) -> packed into uint8 `out` [.., block/2]. Pairs read as
    little-endian int16 w = lo + 256 hi, so the low byte of w | w >> 4 is lo | hi << 4 (the narrowing
    copy to uint8 keeps the low byte)."""
    w = nibbles.view(torch.int16)
    packed = torch.bitwise_right_shift(w, 4, out=s.take("i16", w.shape))
    out.copy_(packed.bitwise_or_(w))


def _unpack_int4(packed: torch.Tensor, s: _Scratch) -> torch.Tensor:
    """uint8 [.., block/2] -> int8 values [.., block] in -7..7 (scratch): w = byte | byte << 4 spreads
    the nibbles to the two bytes of an int16; & 0x0F0F keeps one nibble per byte."""
    w = s.take("i16", packed.shape)
    w.copy_(packed)
    spread = torch.bitwise_left_shift(w, 4, out=s.take("i16b", packed.shape))
    w.bitwise_or_(spread).bitwise_and_(0x0F0F)
    return w.view(torch.int8).sub_(8)


# Adding 1.5 * 2^23 to a fp32 |v| < 2^22 rounds it to the nearest integer, ties to even (the sum's ulp
# is 1): the low bits of the sum's int32 pattern are then that integer, two's complement.
_ROUND_MAGIC = 12582912.0
_TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23  # smallest subnormal


def _quantize_chunk_(xc: torch.Tensor, absmax: torch.Tensor, v: torch.Tensor, bits: int, noise) -> torch.Tensor:
    """fp32 chunk [k, c, block] -> writes its absmax into `absmax` [k, c, 1]; returns the int32 view of
    `v` whose low byte holds q (int8) or q + 8 (int4). noise: None (to nearest) or a callable adding
    uniforms in [0, 1) to v in place (stochastic rounding)."""
    levels = LEVELS[bits]
    # max(max x, -min x): two reads of the chunk, no |x| temporary; NaN propagates; abs_ makes -0.0 +0.0
    torch.maximum(xc.amax(-1, keepdim=True), xc.amin(-1, keepdim=True).neg_(), out=absmax).abs_()
    # x / scale; a zero block (all x = +-0) divides by the smallest subnormal instead (q = 0, no 0/0)
    torch.div(xc, (absmax / levels).clamp_min_(_TINY), out=v)
    if noise is not None:
        noise(v)
        v.floor_().clamp_(-levels, levels)
    return v.add_(_ROUND_MAGIC + (8 if bits == 4 else 0)).view(torch.int32)


def _eager_quantize(x: torch.Tensor, data: torch.Tensor, bits: int, seed: int | None) -> torch.Tensor:
    """x [r, nb, block] (any float) -> data [r, nb, block (int8) | block/2 (uint8)] filled; returns absmax
    fp32 [r, nb]. seed: None rounds to nearest, else stochastic rounding with that seed."""
    r, nb, block = x.shape
    absmax = torch.empty(r, nb, 1, dtype=torch.float32, device=x.device)
    s = _Scratch(min(_chunk_elems(x), r * nb * block), x)
    for rows, blocks in _chunks(r, nb, block, s.elems):
        xc = x[rows, blocks]
        v = s.take("f32", xc.shape)
        if xc.dtype != torch.float32:
            xc = v.copy_(xc)  # upcast once; the rest runs in fp32 in place
        noise = None
        if seed is not None:  # the chunk's first element is (row, column) = (rows.start, blocks.start * block)
            first = rows.start * nb * block + (blocks.start or 0) * block
            noise = lambda v, first=first: _add_uniform_(v, first, seed, s)  # noqa: E731
        ints = _quantize_chunk_(xc, absmax[rows, blocks], v, bits, noise)
        if bits == 8:
            data[rows, blocks].copy_(ints)  # the narrowing copy keeps the low byte: q
        else:
            _pack_int4_(s.take("i8", ints.shape).copy_(ints), data[rows, blocks], s)
    return absmax[..., 0]


def _dequantize_chunk(data: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor, s: _Scratch):
    """One chunk: data [k, c, B] and fp32 scales [k, c] -> fp32 `out` [k, c, block] = q * scale."""
    q = data if bits == 8 else _unpack_int4(data, s)
    torch.mul(q, scales[..., None], out=out)  # int8 -> fp32 inside the multiply: one pass, not two


def _eager_dequantize(data: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """data [r, nb, B], scales fp32 [r, nb] -> out [r, nb, block] (any float dtype, fp32 math, one rounding)."""
    r, nb, block = out.shape
    s = _Scratch(min(_chunk_elems(out), r * nb * block), out)
    for rows, blocks in _chunks(r, nb, block, s.elems):
        oc = out[rows, blocks]
        target = oc if oc.dtype == torch.float32 else s.take("f32", oc.shape)
        _dequantize_chunk(data[rows, blocks], scales[rows, blocks], bits, target, s)
        if target is not oc:
            oc.copy_(target)


def _eager_dequantize_sum(data, scales, bits: int, out: torch.Tensor, accumulate: bool) -> None:
    """data [r, nb, B], scales [r, nb] -> fp32 out [nb, block] = (out if accumulate) + row 0 + row 1 + ...,
    in that order; a row is added as out += q * scale in one addcmul (which may fuse the multiply-add)."""
    r, nb, block = data.shape[0], *out.shape
    if not accumulate and r == 0:
        out.zero_()
    s = _Scratch(min(_chunk_elems(out), nb * block), out)
    for _, blocks in _chunks(1, nb, block, s.elems):
        oc = out[blocks]
        for j in range(r):
            q = data[j, blocks] if bits == 8 else _unpack_int4(data[j, blocks], s)
            scale = scales[j, blocks, None]
            if j == 0 and not accumulate:
                oc.copy_(q).mul_(scale)
            else:
                oc.addcmul_(s.take("f32", oc.shape).copy_(q), scale)


# ---------------------------------------------------------------- public API: the wire format


def quantize_wire(
    x: torch.Tensor,
    block: int,
    bits: int,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [r, m] or [r, *rest] (any float dtype, any strides; rest read row-major as m = prod(rest)) ->
    uint8 [r, wire_bytes(m, block, bits)]: row j quantized on its own, its scales then its data (module
    docstring). A strided x (qgZ's reordered slices) is read in place by the kernel when its last dim is
    unit-stride and a multiple of block, else copied. `out` (uint8 [r, W]) is filled instead of allocating."""
    if x.dim() < 2:
        raise ValueError(f"quantize_wire takes a 2-D [r, m] (or [r, *rest]) tensor, got shape {tuple(x.shape)}")
    r, m = x.shape[0], math.prod(x.shape[1:])
    nb = _check_geometry(m, block, bits)
    if out is None:
        out = torch.empty(r, wire_bytes(m, block, bits), dtype=torch.uint8, device=x.device)
    scale_bytes, data = _split_wire(out, m, block, bits)
    if r * nb == 0:
        return out
    seed = _draw_seed(generator) if stochastic else None
    if _kernel_applies(x):
        _quantize_kernel(x, out, block, bits, seed)
        return out
    absmax = _eager_quantize(x.reshape(r, nb, block), data, bits, seed)
    scale_bytes.copy_(_scales_from_absmax(absmax, LEVELS[bits]).view(torch.uint8))  # bytes: any alignment
    return out


def dequantize_wire(buf: torch.Tensor, m: int, block: int, bits: int, out: torch.Tensor) -> torch.Tensor:
    """uint8 [r, W] from quantize_wire -> `out` [r, m] (any float dtype, computed in fp32, rounded once;
    rows contiguous, e.g. a view of a flat buffer)."""
    scale_bytes, data = _split_wire(buf, m, block, bits)
    r, nb = buf.shape[0], m // block
    if out.shape != (r, m) or not out.is_floating_point():
        raise ValueError(f"out must be a float [{r}, {m}] tensor, got {out.dtype} {tuple(out.shape)}")
    if r * nb == 0:
        return out
    if _kernel_applies(out) and out.stride(1) == 1:
        _dequantize_kernel(buf, out, m, block, bits)
    else:
        _eager_dequantize(data, _read_scales(scale_bytes), bits, out.view(r, nb, block))
    return out


def dequantize_sum_wire(
    buf: torch.Tensor, m: int, block: int, bits: int, out: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """uint8 [r, W] -> fp32 `out` [m] = sum over the r rows of their dequantized values (in fp32, row 0
    first), added to `out` when accumulate. Works chunk by chunk: no [r, m] fp32 tensor is made."""
    scale_bytes, data = _split_wire(buf, m, block, bits)
    if out.shape != (m,) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [{m}], got {out.dtype} {tuple(out.shape)}")
    if not m:
        return out
    if _kernel_applies(out) and out.is_contiguous() and (buf.shape[0] or accumulate):
        _dequantize_sum_kernel(buf, out, m, block, bits, accumulate)
    else:
        _eager_dequantize_sum(data, _read_scales(scale_bytes), bits, out.view(m // block, block), accumulate)
    return out


def dequantize_sum_quantize_wire(
    buf: torch.Tensor,
    m: int,
    block: int,
    bits: int,
    rows: int,
    chunk: int,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qgZ's middle hop: uint8 [r, W(m)] -> uint8 [rows, W(m / rows)]. The fp32 sum of the r rows (as
    dequantize_sum_wire), viewed [m / (rows * chunk), rows, chunk], has its slice [:, j, :] quantized
    into row j (as quantize_wire, same seed draw): the next hop's reorder. chunk a multiple of block.
    The kernel does it in one pass, no fp32 sum in memory; the reference materializes the sum."""
    if rows < 1 or chunk < 1 or chunk % block or m % (rows * chunk):
        raise ValueError(f"{m} elements do not split into [G, rows={rows}, chunk={chunk}] with chunk % {block} == 0")
    _split_wire(buf, m, block, bits)
    m_out = m // rows
    if out is None:
        out = torch.empty(rows, wire_bytes(m_out, block, bits), dtype=torch.uint8, device=buf.device)
    _split_wire(out, m_out, block, bits)
    if not m or not buf.shape[0] or not _kernel_applies(buf, torch.float32):
        summed = dequantize_sum_wire(buf, m, block, bits, torch.empty(m, dtype=torch.float32, device=buf.device))
        return quantize_wire(summed.view(-1, rows, chunk).movedim(1, 0), block, bits, stochastic, generator, out)
    seed = _draw_seed(generator) if stochastic else None
    _dequantize_sum_quantize_kernel(buf, out, m, rows, chunk, block, bits, seed)
    return out


# ---------------------------------------------------------------- kernel dispatch


def _kernel_applies(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """The Triton kernels run on `t` (the float tensor read or written) under --kernels. A fake tensor (a
    dry run, which stands for the accelerator's run) takes the launch too: its custom op's fake writes
    nothing, so no reference chunk loop runs and only what the kernel allocates is counted."""
    return (is_fake(t) or dispatch.use_triton(t)) and (dtype or t.dtype) in KERNEL_DTYPES


def _groups_layout(x: torch.Tensor, block: int) -> tuple[int, int, int] | None:
    """x [r, *rest] -> (m, group stride, chunk) when each row reads as [G, chunk] with strides
    (group stride, 1) and chunk % block == 0 (e.g. qgZ's movedim view), else None."""
    dims = [(n, s) for n, s in zip(x.shape[1:], x.stride()[1:]) if n != 1]
    merged: list[list[int]] = []  # [size, stride], innermost last
    for n, s in dims:
        if merged and merged[-1][1] == s * n:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    m = math.prod(x.shape[1:])
    if not merged:
        return m, 0, m
    if merged[-1][1] != 1 or len(merged) > 2 or merged[-1][0] % block:
        return None
    group_stride = merged[0][1] if len(merged) == 2 else 0
    return m, group_stride, merged[-1][0]


def _kernels():
    from ..kernels import quantize  # lazily: triton is needed only once a kernel runs

    return quantize


# The launches as custom ops (dispatch.kernel_op), each filling its `out`: their fakes return nothing.


@dispatch.kernel_op("quantize_wire", mutates_args=("out",))
def _quantize_kernel(x: torch.Tensor, out: torch.Tensor, block: int, bits: int, seed: int | None) -> None:
    """x [r, *rest] -> wire rows in `out`; the strides are read here, from the tensor the kernel gets."""
    r, m = x.shape[0], math.prod(x.shape[1:])
    layout = _groups_layout(x, block)
    if layout is None:  # no [G, C] view with unit stride in C: one copy, then the kernel
        x = x.reshape(r, m).contiguous()
        layout = (m, 0, m)
    _kernels().quantize(x, x.stride(0), layout[1], layout[2], r, m, out, block, bits, seed)


@dispatch.kernel_op("dequantize_wire", mutates_args=("out",))
def _dequantize_kernel(buf: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int) -> None:
    _kernels().dequantize(buf, out, m, block, bits)


@dispatch.kernel_op("dequantize_sum_wire", mutates_args=("out",))
def _dequantize_sum_kernel(
    buf: torch.Tensor, out: torch.Tensor, m: int, block: int, bits: int, accumulate: bool
) -> None:
    _kernels().dequantize_sum(buf, out, m, block, bits, accumulate)


@dispatch.kernel_op("dequantize_sum_quantize_wire", mutates_args=("out",))
def _dequantize_sum_quantize_kernel(
    buf: torch.Tensor, out: torch.Tensor, m: int, rows: int, chunk: int, block: int, bits: int, seed: int | None
) -> None:
    _kernels().dequantize_sum_quantize(buf, out, m, rows, chunk, block, bits, seed)


for _op in (_quantize_kernel, _dequantize_kernel, _dequantize_sum_kernel, _dequantize_sum_quantize_kernel):
    _op.register_fake(lambda *args: None)  # they only write their `out`, whose shape the caller checked


# ---------------------------------------------------------------- public API: separate data and scales


def _blocks_1d(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """x [n] -> [1, n/block, block] view, after checking the shape contract."""
    if x.dim() != 1:
        raise ValueError(f"quantization takes a 1-D tensor, got shape {tuple(x.shape)}")
    nb = _check_geometry(x.numel(), block, bits)
    return x.reshape(1, nb, block)


def _check_scales(numel: int, scales: torch.Tensor, block: int):
    if scales.numel() * block != numel:
        raise ValueError(f"{numel} values do not match {scales.numel()} scales of block {block}")


def _quantize_1d(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks_1d(x, block, bits)
    data = torch.empty(data_bytes(x.numel(), bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(xb.shape[1], dtype=torch.float32, device=x.device)
    if scales.numel():
        absmax = _eager_quantize(xb, data.view(*xb.shape[:2], -1), bits, None)
        scales = _scales_from_absmax(absmax, LEVELS[bits]).reshape(-1)
    return data, scales


def _dequantize_1d(data: torch.Tensor, scales: torch.Tensor, block: int, bits: int, dtype) -> torch.Tensor:
    numel = data.numel() * (1 if bits == 8 else 2)
    _check_scales(numel, scales, block)
    out = torch.empty(numel, dtype=dtype, device=data.device)
    if numel:
        nb = numel // block
        q = data.reshape(1, nb, data_bytes(block, bits))
        _eager_dequantize(q, scales.float().reshape(1, nb), bits, out.view(1, nb, block))
    return out


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (any float dtype, n % block == 0) -> (q int8 [n], scales fp32 [n/block])."""
    return _quantize_1d(x, block, 8)


def dequantize_int8(
    q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q int8 [n], scales fp32 [n/block] -> values [n] in `dtype` (computed in fp32)."""
    return _dequantize_1d(q.reshape(-1), scales, block, 8, dtype)


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (n % block == 0, block even) -> (packed uint8 [n/2], scales fp32 [n/block])."""
    return _quantize_1d(x, block, 4)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [n/2], scales fp32 [n/block] -> values [n] in `dtype` (computed in fp32)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed int4 data must be uint8, got {packed.dtype}")
    return _dequantize_1d(packed.reshape(-1), scales, block, 4, dtype)


# ---------------------------------------------------------------- the path that runs


def quantizer_backend(device: torch.device | None = None) -> str:
    """Which quantizer path runs on `device` (default: CUDA when present, else CPU) for the start-up log."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dispatch.use_triton(torch.empty(0, device=device)):
        return "Triton wire kernels (quantize, dequantize, dequantize+sum, qgZ middle hop fused)"
    return f"eager torch, {_CHUNK['cpu'] >> 10}K-element chunks on CPU (no compiled kernels)"


assert sys.byteorder == "little", "the int4 pack/unpack and the wire's fp32 scales assume little-endian"
