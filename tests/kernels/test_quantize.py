"""megatron_zpp/kernels/quantize.py under the Triton interpreter against the torch reference in
megatron_zpp/ops/quantize.py (the same public functions, --kernels torch vs --kernels triton).

Claims under test:
* quantize: the wire bytes equal the reference's bit for bit, round to nearest (ties included) and
  stochastic (the kernel computes the reference's counter hash; same generator, same seed draw);
  int8 and int4, fp32 and bf16 inputs, blocks that are not powers of two, odd block counts, strided
  [r, G, C] sources (qgZ's reorder, read in place) and ones that are copied first.
* stochastic rounding: unbiased: over 1024 independent copies of the same values the mean dequantized
  value is within 6 sigma of x, sigma = scale / (2 sqrt(1024)), and every value within one level.
* dequantize: bitwise equal (fp32, bf16, fp16 out, strided rows).
* dequantize + sum: within r * 2^-24 * sum |terms| of an fp64 sum of the dequantized rows (fp32 adds,
  one rounding each); bitwise equal to the reference where every partial sum is exact.
* the fused middle hop equals dequantize_sum_wire -> [G, rows, C] reorder -> quantize_wire done by the
  reference: bitwise where the sums are exact, and within one level otherwise.
* numel not a multiple of the block is refused in both paths (the wire has no tail: callers pad).
"""

import math

import pytest
import torch

from megatron_zpp.ops import dispatch
from megatron_zpp.ops import quantize as Q

CPU = torch.device("cpu")
LEVELS = {8: 127, 4: 7}
# (bits, block, rows, numel per row): blocks not a power of two (5, 6, 10), odd block counts
CASES = [(8, 5, 2, 35), (8, 16, 3, 48), (8, 6, 1, 30), (4, 6, 2, 42), (4, 8, 3, 24), (4, 10, 1, 50)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def restore_mode():
    yield
    dispatch.set_kernels("auto", CPU)


def torch_then_triton(fn):
    """fn() under --kernels torch, then under --kernels triton (the interpreter)."""
    dispatch.set_kernels("torch", CPU)
    ref = fn()
    dispatch.set_kernels("triton", CPU)
    return ref, fn()


def gaussian(r: int, m: int, block: int, dtype, seed: int = 0, bits: int = 8) -> torch.Tensor:
    """Block magnitudes over 4 decades; an all-zero block, a -0.0 block and a block of exact rounding
    ties (x / scale = +-(k + 0.5): scale 2^-2 exactly, absmax = L * 2^-2)."""
    g = torch.Generator().manual_seed(seed)
    nb, L = m // block, LEVELS[bits]
    x = torch.randn(r, nb, block, generator=g) * torch.logspace(-2, 2, r * nb).view(r, nb, 1)
    x[0, 0] = 0.0
    if nb > 2:
        x[-1, 1] = -0.0
        k = torch.arange(block)
        ties = ((k % L) + 0.5) * (1 - 2 * (k % 2))
        ties[-1] = L
        x[0, 2] = ties * 0.25
    return x.reshape(r, m).to(dtype)


def exact_wire(r: int, m: int, block: int, bits: int, seed: int = 0) -> torch.Tensor:
    """A wire whose every sum is exact in fp32: integer codes, power-of-two scales 2^-4..2^4."""
    g = torch.Generator().manual_seed(seed)
    L, nb = LEVELS[bits], m // block
    q = torch.randint(-L, L + 1, (r, nb, block), generator=g)
    q[..., 0] = L  # absmax = L * 2^e, so the scale is 2^e exactly
    x = q * 2.0 ** torch.randint(-4, 5, (r, nb, 1), generator=g)
    dispatch.set_kernels("torch", CPU)
    return Q.quantize_wire(x.reshape(r, m), block, bits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block,r,m", CASES)
def test_quantize_wire_bitwise(bits, block, r, m, dtype):
    x = gaussian(r, m, block, dtype, bits=bits)
    ref, ker = torch_then_triton(lambda: Q.quantize_wire(x, block, bits))
    assert torch.equal(ref, ker)
    out = torch.full_like(ref, 0xAB)  # into the given buffer
    assert Q.quantize_wire(x, block, bits, out=out) is out and torch.equal(out, ref)
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    ref, ker = torch_then_triton(lambda: Q.quantize_wire(x, block, bits, stochastic=True, generator=gen()))
    assert torch.equal(ref, ker)


@pytest.mark.parametrize("bits,block", [(8, 8), (4, 6)])
def test_strided_sources_reordered_in_place_or_copied(bits, block):
    G, R, C = 3, 2, 2 * block  # qgZ's reorder: row j of the wire = cur[:, j, :]
    cur = gaussian(1, G * R * C, block, torch.float32).view(G, R, C)
    reordered = cur.movedim(1, 0)
    assert Q._groups_layout(reordered, block) == (G * C, R * C, C)
    ref, ker = torch_then_triton(lambda: Q.quantize_wire(reordered.contiguous(), block, bits))
    assert torch.equal(ker, ref)
    cols = gaussian(1, 4 * 2 * block, block, torch.bfloat16).view(2 * block, 4).t()  # no unit stride: copied
    assert Q._groups_layout(cols, block) is None
    ref, ker = torch_then_triton(lambda: Q.quantize_wire(cols, block, bits))
    assert torch.equal(ker, ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_unbiased_within_one_level(bits):
    rows, block, m = 1024, 8, 16
    row = torch.randn(1, m) * torch.tensor([0.1] * block + [3.0] * block)
    x = row.repeat(1, rows)  # the same values 1024 times in one wire row: independent noise per element index
    dispatch.set_kernels("triton", CPU)
    wire = Q.quantize_wire(x, block, bits, stochastic=True, generator=torch.Generator().manual_seed(3))
    deq = Q.dequantize_wire(wire, rows * m, block, bits, torch.empty(1, rows * m)).double().view(rows, m)
    x = x.view(rows, m)
    scale = (row.view(-1, block).abs().amax(1, keepdim=True) / LEVELS[bits]).double().expand(-1, block).reshape(m)
    assert ((deq - x.double()).abs() < scale).all()  # within one level, every element
    sigma = scale / (2 * math.sqrt(rows))  # Bernoulli rounding: variance <= scale^2 / 4
    bias = (deq.mean(0) - row[0].double()).abs()
    assert (bias <= 6 * sigma).all(), (bias / sigma).max()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,block,r,m", CASES)
def test_dequantize_wire_bitwise(bits, block, r, m, out_dtype):
    wire = Q.quantize_wire(gaussian(r, m, block, torch.float32, seed=1), block, bits)
    padded = torch.zeros(r, wire.shape[1] + 3, dtype=torch.uint8)
    padded[:, : wire.shape[1]] = wire
    strided = padded[:, : wire.shape[1]]  # wire rows with a row stride > W
    out = lambda: torch.zeros(r, m + 5, dtype=out_dtype)[:, :m]  # noqa: E731  out rows strided too
    ref, ker = torch_then_triton(lambda: Q.dequantize_wire(strided, m, block, bits, out()))
    assert torch.equal(ref, ker)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("bits,block,r,m", CASES)
def test_dequantize_sum_against_fp64(bits, block, r, m, accumulate):
    wire = Q.quantize_wire(gaussian(r, m, block, torch.float32, seed=2), block, bits)
    start = torch.randn(m)
    out = lambda: start.clone() if accumulate else torch.empty(m)  # noqa: E731
    ref, ker = torch_then_triton(lambda: Q.dequantize_sum_wire(wire, m, block, bits, out(), accumulate))
    dispatch.set_kernels("torch", CPU)
    terms = Q.dequantize_wire(wire, m, block, bits, torch.empty(r, m)).double()
    if accumulate:
        terms = torch.cat([start.double()[None], terms])
    bound = terms.shape[0] * 2.0**-24 * terms.abs().sum(0)  # one fp32 rounding per add
    exact = terms.sum(0)
    assert ((ker.double() - exact).abs() <= bound).all() and ((ref.double() - exact).abs() <= bound).all()
    exact_rows = exact_wire(r, m, block, bits, seed=3)  # every partial sum exact: both paths bitwise
    start = torch.randint(-64, 65, (m,), generator=torch.Generator().manual_seed(4)) * 0.25
    ref, ker = torch_then_triton(lambda: Q.dequantize_sum_wire(exact_rows, m, block, bits, out(), accumulate))
    assert torch.equal(ref, ker)


def middle_hop_by_the_reference(wire, m, block, bits, rows, chunk, generator=None):
    """dequantize_sum_wire -> view [G, rows, chunk] -> row j = [:, j, :] -> quantize_wire, all torch."""
    dispatch.set_kernels("torch", CPU)
    summed = Q.dequantize_sum_wire(wire, m, block, bits, torch.empty(m))
    reordered = summed.view(-1, rows, chunk).movedim(1, 0).contiguous()
    return Q.quantize_wire(reordered.view(rows, -1), block, bits, generator is not None, generator)


# (bits, block, rows in, rows out, chunk, groups): G = 3 and 1, block not a power of two
HOPS = [(8, 8, 2, 3, 16, 3), (8, 6, 3, 2, 12, 1), (4, 8, 2, 2, 8, 3), (4, 6, 3, 3, 6, 1)]


@pytest.mark.parametrize("bits,block,r,rows,chunk,G", HOPS)
def test_fused_middle_hop(bits, block, r, rows, chunk, G):
    m = G * rows * chunk
    wire = exact_wire(r, m, block, bits, seed=4)  # exact sums: bitwise, round to nearest and stochastic
    expect = middle_hop_by_the_reference(wire, m, block, bits, rows, chunk)
    dispatch.set_kernels("triton", CPU)
    assert torch.equal(Q.dequantize_sum_quantize_wire(wire, m, block, bits, rows, chunk), expect)
    expect = middle_hop_by_the_reference(wire, m, block, bits, rows, chunk, torch.Generator().manual_seed(5))
    dispatch.set_kernels("triton", CPU)
    fused = Q.dequantize_sum_quantize_wire(wire, m, block, bits, rows, chunk, True, torch.Generator().manual_seed(5))
    assert torch.equal(fused, expect)
    # rounded sums: the kernel's fp32 sums may differ from the reference's by an ulp, so one level
    wire = Q.quantize_wire(gaussian(r, m, block, torch.float32, seed=6), block, bits)
    expect = middle_hop_by_the_reference(wire, m, block, bits, rows, chunk)
    dispatch.set_kernels("triton", CPU)
    fused = Q.dequantize_sum_quantize_wire(wire, m, block, bits, rows, chunk)
    dispatch.set_kernels("torch", CPU)
    deq_ref = Q.dequantize_wire(expect, m // rows, block, bits, torch.empty(rows, m // rows))
    deq_fused = Q.dequantize_wire(fused, m // rows, block, bits, torch.empty(rows, m // rows))
    level = deq_ref.view(rows, -1, block).abs().amax(-1, keepdim=True) / LEVELS[bits]
    assert ((deq_fused - deq_ref).view(rows, -1, block).abs() <= level * (1 + 1e-5)).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy under the interpreter
def test_non_finite_blocks_decode_to_nan_and_others_are_untouched():
    block, bits, m = 8, 4, 32
    x = gaussian(1, m, block, torch.float32)
    x[0, 3], x[0, 17] = float("nan"), float("inf")
    ref, ker = torch_then_triton(lambda: Q.quantize_wire(x, block, bits))
    scales = lambda w: w[:, : 4 * (m // block)].view(torch.float32)  # noqa: E731
    assert torch.equal(scales(ref).isnan(), torch.tensor([[True, False, True, False]]))
    assert torch.equal(scales(ker).isnan(), scales(ref).isnan())
    data = lambda w: w[:, 4 * (m // block) :].view(-1, block // 2)  # noqa: E731
    assert torch.equal(data(ker)[[1, 3]], data(ref)[[1, 3]])  # the NaN blocks' data bytes are unspecified
    deq = Q.dequantize_wire(ker, m, block, bits, torch.empty(1, m)).view(-1, block)
    assert deq[[0, 2]].isnan().all() and deq[[1, 3]].isfinite().all()


def test_tails_are_refused_and_the_backend_is_named():
    dispatch.set_kernels("triton", CPU)
    with pytest.raises(ValueError, match="not a multiple of block"):
        Q.quantize_wire(torch.randn(2, 30), 8, 8)
    assert Q.quantizer_backend(CPU).startswith("Triton")
    dispatch.set_kernels("torch", CPU)
    assert Q.quantizer_backend(CPU).startswith("eager torch")
