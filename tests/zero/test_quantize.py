"""megatron_zpp/zero/quantize.py: block-wise int8/int4 error bounds in one process, and
qwZ's quantized all-gather on 4 gloo ranks against a plain all-gather.

Bound under test: round-to-nearest on a grid of step scale = absmax/L leaves
|x - deq(q(x))| <= scale/2 per element, i.e. absmax/254 (int8) and absmax/14 (int4),
absmax taken over the element's own block. A few fp32 ulps of slack cover x/scale.
"""

import pytest
import torch

from megatron_zpp import comm
from megatron_zpp.topology import Topology, build_groups
from megatron_zpp.zero.gather import all_gather_weights
from megatron_zpp.zero.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
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
            # int8 data (1 B/elem) and fp32 scales (4 B/block), ring all-gather (n-1)/n * B_out
            assert ledger == {
                ("dp", "fwd", "all_gather", "inter_node"): (3 / 4 * (4 * SHARD + 4 * 4 * SHARD / BLOCK), 2)
            }
        one, ledger = res["single"]
        assert torch.equal(one, _shard(rank, torch.bfloat16)) and ledger == {}
