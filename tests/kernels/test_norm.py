"""RMSNorm and LayerNorm kernels (kernels/norm.py through ops/norm.py) under the Triton interpreter, against
the norms written out in fp64 here, forward and backward (x, weight and bias gradients).

Tolerances, as max|ours - fp64| / max|fp64| per tensor: fp32 1e-5 (measured about 2e-7); bf16 2e-2 (one
bf16 rounding of each output is up to 2^-9 of it: measured up to 7e-3)."""

import pytest
import torch

from megatron_zpp.kernels import norm as norm_kernels
from megatron_zpp.ops import dispatch
from megatron_zpp.ops import norm as norm_ops

EPS = 1e-5
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rms_norm_fp64(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def layer_norm_fp64(x, w, b, eps):
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps) * w + b


def rel_err(ours, exact):
    return ((ours.double() - exact).abs().max() / exact.abs().max()).item()


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)  # a mean that LayerNorm must remove
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


def check(kind, x, w, b, dy):
    """Our forward and gradients against fp64 autograd of the formulas above, on the same rounded inputs."""
    params = [w] if kind == "rms" else [w, b]
    ours_in = [t.clone().requires_grad_() for t in [x, *params]]
    exact_in = [t.double().requires_grad_() for t in [x, *params]]
    if kind == "rms":
        y = norm_ops.rms_norm(ours_in[0], ours_in[1], EPS)
        y_exact = rms_norm_fp64(*exact_in, EPS)
    else:
        y = norm_ops.layer_norm(*ours_in, EPS)
        y_exact = layer_norm_fp64(*exact_in, EPS)
    assert type(y.grad_fn).__name__ == "NormFunctionBackward", "the kernel path did not run"
    assert y.dtype == x.dtype and y.shape == x.shape
    grads = torch.autograd.grad(y, ours_in, dy)
    grads_exact = torch.autograd.grad(y_exact, exact_in, dy.double())
    errs = [rel_err(y, y_exact)] + [rel_err(g, ge) for g, ge in zip(grads, grads_exact)]
    assert all(g.dtype == t.dtype for g, t in zip(grads, ours_in))
    assert max(errs) < TOL[x.dtype], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(1, 8), (5, 33), (37, 100), (2, 7, 64)])
def test_forward_and_backward_against_fp64(shape, kind, dtype):
    check(kind, *inputs(shape, dtype))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_strided_rows(kind):
    """Rows of a wider buffer (a row stride unlike the width) and a non-contiguous cotangent."""
    x, w, b, _ = inputs((9, 48), torch.float32)
    dy = torch.randn(33, 9).t()
    check(kind, x[:, 5:38], w[:33], b[:33], dy)


@pytest.mark.parametrize("programs", [1, 3, 4, 37])
def test_weight_gradient_partials_over_row_blocks(programs):
    """37 rows split into row blocks with a short last block (1 to 37 programs): the summed per-block
    partials of dw and db equal the fp64 column sums, whatever the split."""
    x, w, b, dy = inputs((37, 33), torch.float32, seed=1)
    _, mean, rstd = norm_kernels.norm_fwd(x, w, b, EPS)
    dx, dw, db = norm_kernels.norm_bwd(dy, x, w, mean, rstd, programs=programs)
    x64 = x.double()
    xhat = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + EPS)
    assert rel_err(dw, (dy.double() * xhat).sum(0)) < 1e-5
    assert rel_err(db, dy.double().sum(0)) < 1e-5
    _, _, rstd_rms = norm_kernels.norm_fwd(x, w, None, EPS)
    _, dw_rms, db_rms = norm_kernels.norm_bwd(dy, x, w, None, rstd_rms, programs=programs)
    xhat_rms = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)
    assert db_rms is None and rel_err(dw_rms, (dy.double() * xhat_rms).sum(0)) < 1e-5


def test_fp64_and_torch_mode_take_the_reference():
    x, w, b, _ = inputs((3, 8), torch.float64)
    assert norm_ops.rms_norm(x.requires_grad_(), w, EPS).grad_fn.__class__.__name__ != "NormFunctionBackward"
    dispatch.set_kernels("torch", torch.device("cpu"))
    y = norm_ops.layer_norm(x.float(), w.float().requires_grad_(), b.float(), EPS)
    assert type(y.grad_fn).__name__ != "NormFunctionBackward"
    assert rel_err(y, layer_norm_fp64(x.float().double(), w.float().double(), b.float().double(), EPS)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(5, 33), (37, 100)])
def test_wide_rows_in_tiles_against_fp64(monkeypatch, shape, kind, dtype):
    """The paths of wide rows (forward in tiles; backward: dx per row in tiles, dw/db by column tiles over
    row blocks), reached at small widths by lowering the limits: several tiles and a ragged tail."""
    for name, value in [("MAX_ROW_BLOCK", 16), ("MAX_FUSED_BWD", 16), ("TILE_N", 16), ("DW_TILE_N", 8)]:
        monkeypatch.setattr(norm_kernels, name, value)
    check(kind, *inputs(shape, dtype, seed=2))


@pytest.mark.parametrize("programs", [1, 4, 37])
def test_wide_rows_weight_gradient_partials(monkeypatch, programs):
    monkeypatch.setattr(norm_kernels, "MAX_FUSED_BWD", 16)
    monkeypatch.setattr(norm_kernels, "DW_TILE_N", 8)
    test_weight_gradient_partials_over_row_blocks(programs)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bf16_rows_with_fp32_weights(kind):
    """--apply-layernorm-1p's scale 1 + w is formed in fp32 (model/norm.py): bf16 rows with an fp32 weight (and
    bias) take the kernel, their gradients in fp32."""
    x, w, b, dy = inputs((37, 100), torch.bfloat16)
    check(kind, x, w.float(), b.float(), dy)
