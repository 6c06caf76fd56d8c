"""megatron_zpp/ops/quantize.py: block-wise int8/int4 error bounds in one process, the one-buffer
wire format (against a numpy decoder of its layout written here), the reduce of wire rows against
an fp64 sum, stochastic rounding's bias, and qwZ's quantized all-gather on 4 gloo ranks against a
plain all-gather.

Bound under test: round-to-nearest on a grid of step scale = absmax/L leaves
|x - deq(q(x))| <= scale/2 per element, i.e. absmax/254 (int8) and absmax/14 (int4),
absmax taken over the element's own block. A few fp32 ulps of slack cover x/scale.
"""

import numpy as np
import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.ops.quantize import (
    dequantize_int4,
    dequantize_int8,
    dequantize_sum_wire,
    dequantize_wire,
    quantize_int4,
    quantize_int8,
    quantize_wire,
    wire_bytes,
)
from megatron_zpp.topology import Topology, build_groups
from megatron_zpp.zero.gather import all_gather_weights
from tests.dist import run_distributed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # pure torch: same code on GPU
CODECS = {"int8": (quantize_int8, dequantize_int8, 127), "int4": (quantize_int4, dequantize_int4, 7)}


def bound(x, block, levels):
    """Per-element bound scale/2 = block absmax / (2L), plus fp32 round-off slack."""
    absmax = x.float().reshape(-1, block).abs().amax(1, keepdim=True)
    return (absmax / (2 * levels) * (1 + 1e-5) + 1e-30).expand(-1, block).reshape(-1)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_error_bound_and_shapes(codec, dtype, device):
    quant, dequant, L = CODECS[codec]
    block = 64
    g = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes, so a global scale would fail the bound
    x = (torch.randn(32 * block, generator=g) * torch.logspace(-3, 3, 32).repeat_interleave(block)).to(device, dtype)
    q, scales = quant(x, block)
    assert q.device == scales.device == x.device
    assert scales.dtype == torch.float32 and scales.shape == (32,)
    assert (q.dtype, q.numel()) == ((torch.int8, x.numel()) if codec == "int8" else (torch.uint8, x.numel() // 2))
    y = dequant(q, scales, block, torch.float32)
    # the bound holds against the bf16 values read as bf16 (upcast), not reinterpreted
    assert ((y - x.float()).abs() <= bound(x, block, L)).all()
    assert torch.equal(scales, x.float().reshape(-1, block).abs().amax(1) / L)
    # the requested output dtype is the fp32 result rounded once
    assert torch.equal(dequant(q, scales, block, torch.bfloat16), y.to(torch.bfloat16))


@pytest.mark.parametrize("codec", CODECS)
def test_grid_values_round_trip_exactly(codec):
    quant, dequant, L = CODECS[codec]
    block = 2 * L + 2  # holds every level once (+ an extra 0)
    levels = torch.cat([torch.arange(-L, L + 1.0), torch.zeros(1)])
    x = torch.cat([levels * 2.0**-3, levels.flip(0) * 2.0**5])  # power-of-two steps: exact grid
    for dtype in (torch.float32, torch.bfloat16):
        q, scales = quant(x.to(dtype), block)
        assert torch.equal(dequant(q, scales, block, torch.float32), x)


@pytest.mark.parametrize("codec", CODECS)
def test_zeros_outlier_and_nonfinite(codec):
    quant, dequant, L = CODECS[codec]
    block = 16
    x = torch.randn(4 * block, generator=torch.Generator().manual_seed(1))
    x[block : 2 * block] = 0  # an all-zero block: scale 0, no NaN
    x[2 * block + 3] = 1e6  # one huge outlier in block 2
    q, scales = quant(x, block)
    y = dequant(q, scales, block)
    assert scales[1] == 0 and torch.isfinite(y).all() and (y[block : 2 * block] == 0).all()
    ref_q, ref_s = quant(torch.cat([x[: 2 * block], x[3 * block :]]), block)  # without the outlier's block
    ref = dequant(ref_q, ref_s, block)
    assert torch.equal(y[: 2 * block], ref[: 2 * block]) and torch.equal(y[3 * block :], ref[2 * block :])
    assert y[2 * block + 3] == 1e6  # the outlier itself is exact (it is the absmax)
    assert ((y - x).abs() <= bound(x, block, L)).all()  # its block is coarse but within its own bound
    assert torch.equal(dequant(*quant(torch.zeros(block), block), block), torch.zeros(block))
    x[5] = float("nan")  # a NaN gradient is not silently lost: its block decodes to NaN
    y = dequant(*quant(x, block), block)
    assert torch.isnan(y[:block]).all() and torch.isfinite(y[block:]).all()


def test_int4_nibble_layout():
    packed, scales = quantize_int4(torch.tensor([-7.0, 7.0, 0.0, 1.0]), 4)  # scale 1
    assert scales.tolist() == [1.0]
    assert packed.tolist() == [1 | (15 << 4), 8 | (9 << 4)]  # q+8, element 2i in the low nibble


def test_shape_errors():
    with pytest.raises(ValueError, match="not a multiple of block 8"):
        quantize_int8(torch.zeros(12), 8)
    with pytest.raises(ValueError, match="even"):
        quantize_int4(torch.zeros(9), 3)
    with pytest.raises(ValueError, match="1-D"):
        quantize_int8(torch.zeros(2, 8), 8)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int8(torch.zeros(16, dtype=torch.int8), torch.ones(3), 8)


# ------------------------------------------------------------------ the wire format


def decode_wire(buf, m, block, bits):
    """Independent decoder of quantize_wire's layout (numpy, fp64): per row, m/block fp32 scales
    then the data; returns (values fp64 [r, m] = q * scale exactly, scales fp64 [r, m/block])."""
    rows = np.ascontiguousarray(buf.cpu().numpy())
    nb = m // block
    values, scales = np.empty((rows.shape[0], m)), np.empty((rows.shape[0], nb))
    for j, row in enumerate(rows):
        scales[j] = row[: 4 * nb].view("<f4")
        data = row[4 * nb :]
        if bits == 8:
            q = data.view(np.int8).astype(np.float64)
        else:
            q = np.empty(m)
            q[0::2], q[1::2] = (data & 15).astype(np.float64) - 8, (data >> 4).astype(np.float64) - 8
        values[j] = (q.reshape(nb, block) * scales[j][:, None]).reshape(-1)
    return values, scales


def same(a, b):
    """Equal values, NaN where the other is NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def wire_input(r, m, block, dtype, seed=0):
    """[r, m]: blocks of magnitudes 1e-3..1e3, the last two blocks of each row zero (padding tails)."""
    g = torch.Generator().manual_seed(seed)
    nb = m // block
    mags = torch.logspace(-3, 3, r * nb).view(r, nb)[:, torch.randperm(nb, generator=g)]
    x = torch.randn(r, nb, block, generator=g) * mags[..., None]
    x[:, -2:] = 0
    return x.reshape(r, m).to(dtype)


def block_bound(x, block, levels):
    """absmax/(2L) of each element's block, in fp64 from x as given (bf16 read as bf16), plus fp32
    round-off: x/scale and q*scale each round by <= L ulps of a level, i.e. 2^-24 absmax each."""
    absmax = x.double().reshape(x.shape[0], -1, block).abs().amax(-1, keepdim=True)
    return (absmax / (2 * levels) + absmax * 2.0**-22).expand(-1, -1, block).reshape(x.shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [6, 64, 256])
@pytest.mark.parametrize("device", DEVICES)
def test_wire_round_trip_within_bound(bits, dtype, block, device):
    L = 127 if bits == 8 else 7
    r, m = 3, 8 * block
    x = wire_input(r, m, block, dtype)
    x[1, 3 * block + 5] = float("nan")  # row 1, block 3: decodes to NaN; the rest of the row does not
    x[2, block] = float("inf")  # row 2, block 1: likewise
    buf = quantize_wire(x.to(device), block, bits)
    assert (
        buf.dtype == torch.uint8 and buf.shape == (r, wire_bytes(m, block, bits)) and buf.device == x.to(device).device
    )
    assert wire_bytes(m, block, bits) == 4 * m // block + m * bits // 8
    out = dequantize_wire(buf, m, block, bits, out=torch.empty(r, m, device=device)).cpu()
    ref, scales = decode_wire(buf, m, block, bits)
    assert same(out, torch.from_numpy(ref).float())  # our decoder reads the layout the test reads
    bad = torch.zeros(r, m // block, dtype=torch.bool)
    bad[1, 3] = bad[2, 1] = True
    bad_elems = bad.repeat_interleave(block, 1)
    assert torch.isnan(out[bad_elems]).all() and torch.isfinite(out[~bad_elems]).all()
    assert np.isnan(scales[bad.numpy()]).all()
    err = (out.double() - x.double()).abs()
    assert (err[~bad_elems] <= block_bound(x, block, L)[~bad_elems]).all()
    assert (out.view(r, -1, block)[:, -2:] == 0).all() and (scales[:, -2:] == 0).all()  # zero tails stay zero
    # another output dtype: the fp32 result rounded once
    out16 = dequantize_wire(buf, m, block, bits, torch.empty(r, m, dtype=torch.bfloat16, device=device))
    assert same(out16.cpu(), out.bfloat16())


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_rows_are_independent_and_match_the_separate_codecs(bits):
    block, m = 16, 64
    x = wire_input(4, m, block, torch.float32, seed=3)
    buf = quantize_wire(x, block, bits)
    quant = quantize_int8 if bits == 8 else quantize_int4
    for j in range(4):
        assert torch.equal(quantize_wire(x[j : j + 1], block, bits)[0], buf[j])
        q, scales = quant(x[j], block)
        assert torch.equal(buf[j, : 4 * m // block], scales.view(torch.uint8))
        assert torch.equal(buf[j, 4 * m // block :], q.view(torch.uint8))


def test_wire_nibble_layout_and_scale_bytes():
    buf = quantize_wire(torch.tensor([[-7.0, 7.0, 0.0, 1.0]]), 4, 4)  # scale 1.0: fp32 0x3f800000, little-endian
    assert buf.tolist() == [[0x00, 0x00, 0x80, 0x3F, 1 | (15 << 4), 8 | (9 << 4)]]
    buf = quantize_wire(torch.tensor([[-127.0, 127.0, 0.0, 1.0]]), 4, 8)
    assert buf.tolist() == [[0x00, 0x00, 0x80, 0x3F, 129, 127, 0, 1]]


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_misaligned_buffers(bits):
    """Row strides and base addresses that are not multiples of 4 still decode (scales copied)."""
    block, m, r = 2, 6, 5  # int8: W = 12 + 6 = 18; int4: 12 + 3 = 15
    x = wire_input(r, m, block, torch.float32, seed=4)
    x[:, -2 * block :] = torch.randn(r, 2 * block)  # no zero tail here
    buf = quantize_wire(x, block, bits)
    assert buf.shape[1] % 4 != 0
    shifted = torch.empty(buf.numel() + 1, dtype=torch.uint8)[1:].view(buf.shape)  # base address + 1
    shifted.copy_(buf)
    for b in (buf, shifted, buf[1:], shifted[2:4]):
        out = dequantize_wire(b, m, block, bits, torch.empty(b.shape[0], m))
        assert torch.equal(out, torch.from_numpy(decode_wire(b, m, block, bits)[0]).float())
        assert_sum_close(dequantize_sum_wire(b, m, block, bits, torch.empty(m)), decode_wire(b, m, block, bits)[0])
    assert torch.equal(quantize_wire(x, block, bits, out=shifted), buf)  # writing scales at odd addresses


def assert_sum_close(out, rows):
    """out (fp32) vs the fp64 sum of rows [k, m]: each of the k terms is rounded at most once to fp32
    (a fused multiply-add skips it) and k - 1 fp32 additions follow, so |error| <= 2 k ulps of sum |terms|."""
    ref = torch.from_numpy(rows.sum(0))
    tol = 2 * rows.shape[0] * 2.0**-24 * torch.from_numpy(np.abs(rows).sum(0))
    assert ((out.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_sum_wire_against_fp64(bits, r, device):
    block, m = 32, 32 * 10
    x = wire_input(r, m, block, torch.float32, seed=5 + r)
    buf = quantize_wire(x.to(device), block, bits)
    rows, _ = decode_wire(buf, m, block, bits)  # exact q * scale per row
    out = dequantize_sum_wire(buf, m, block, bits, torch.empty(m, device=device))
    assert out.dtype == torch.float32
    assert_sum_close(out.cpu(), rows)
    base = torch.randn(m, generator=torch.Generator().manual_seed(9))
    acc = dequantize_sum_wire(buf, m, block, bits, base.to(device, copy=True), accumulate=True)
    assert_sum_close(acc.cpu(), np.concatenate([base.double().numpy()[None], rows]))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_and_within_one_level(bits):
    L, block, m, draws = (127 if bits == 8 else 7), 32, 64, 4096
    x = torch.randn(m, generator=torch.Generator().manual_seed(11))
    x[[0, 32]] = torch.tensor([2.5, -3.0])  # give each block a known absmax
    scale = x.view(-1, block).abs().amax(1).repeat_interleave(block) / L
    # every draw is one row: rows of one call get independent noise (it hashes the element index)
    buf = quantize_wire(x.expand(draws, m), block, bits, stochastic=True, generator=torch.Generator().manual_seed(0))
    y = dequantize_wire(buf, m, block, bits, torch.empty(draws, m)).double()
    scale = scale.double()
    assert ((y - x.double()).abs() <= scale * (1 + 1e-5)).all()  # within one level of x
    # the mean of `draws` independent draws; one draw's variance is <= scale^2 / 4 (6 sigma for 64 elements)
    assert ((y.mean(0) - x.double()).abs() <= 6 * scale / 2 / draws**0.5).all()
    frac = x.double() / scale - torch.floor(x.double() / scale)
    assert (y.std(0)[(frac > 0.05) & (frac < 0.95)] > 0).all()  # off-grid values take both levels
    again = quantize_wire(x.expand(draws, m), block, bits, stochastic=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, buf)  # reproducible from the generator


def test_wire_shape_errors():
    with pytest.raises(ValueError, match="not a multiple of block 8"):
        quantize_wire(torch.zeros(2, 12), 8, 8)
    with pytest.raises(ValueError, match="even"):
        quantize_wire(torch.zeros(2, 9), 3, 4)
    with pytest.raises(ValueError, match="bits"):
        wire_bytes(16, 8, 3)
    with pytest.raises(ValueError, match="2-D"):
        quantize_wire(torch.zeros(16), 8, 8)
    with pytest.raises(ValueError, match="wire buffer"):
        dequantize_wire(torch.zeros(2, 10, dtype=torch.uint8), 16, 8, 8, torch.empty(2, 16))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_sum_wire(torch.zeros(2, wire_bytes(16, 8, 8), dtype=torch.uint8), 16, 8, 8, torch.empty(16).half())


# ------------------------------------------------------------------ qwZ on 4 ranks

BLOCK, SHARD = 32, 256


def _shard(rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(SHARD, generator=g) * (rank + 1)).to(dtype)


def _qwz_4ranks(rank, world_size):
    g = build_groups(Topology(world_size, ranks_per_node=2), rank)
    res = {"dp": list(g.dp.ranks), "link": g.dp.link}
    for dtype in (torch.float32, torch.bfloat16):
        comm.LEDGER.reset()
        out = torch.empty(world_size * SHARD, dtype=dtype)
        all_gather_weights(out, _shard(rank, dtype), g.dp, "fwd", BLOCK).wait()  # what ZeRO-3's qwZ gathers run
        res[dtype] = (out, {k: (r.bytes, r.calls) for k, r in comm.LEDGER.records.items()})
    comm.LEDGER.reset()
    one = torch.empty(SHARD, dtype=torch.bfloat16)
    all_gather_weights(one, _shard(rank, torch.bfloat16), g.pp, "fwd", BLOCK).wait()  # size-1 group
    res["single"] = (one, dict(comm.LEDGER.records))
    return res


def test_quantized_all_gather_4ranks():
    results = run_distributed(_qwz_4ranks, 4)
    for rank, res in enumerate(results):
        assert res["dp"] == [0, 1, 2, 3] and res["link"] == "inter_node"
        for dtype in (torch.float32, torch.bfloat16):
            out, ledger = res[dtype]
            ref = torch.cat([_shard(r, dtype) for r in range(4)])  # what a plain all-gather returns
            assert out.dtype == dtype
            lim = bound(ref, BLOCK, 127)
            if dtype == torch.bfloat16:
                lim = lim + ref.float().abs() * 2.0**-8  # the output's own bf16 rounding
            assert ((out.float() - ref.float()).abs() <= lim).all()
            assert torch.equal(out, results[0][dtype][0])  # every rank holds identical weights
            # one wire buffer per rank: int8 data (1 B/elem) + fp32 scales (4 B/block); ring all-gather (n-1)/n * B_out
            assert wire_bytes(SHARD, BLOCK, 8) == SHARD + 4 * SHARD // BLOCK
            assert ledger == {("dp", "fwd", "all_gather", "inter_node"): (3 / 4 * 4 * wire_bytes(SHARD, BLOCK, 8), 1)}
        one, ledger = res["single"]
        assert torch.equal(one, _shard(rank, torch.bfloat16)) and ledger == {}
