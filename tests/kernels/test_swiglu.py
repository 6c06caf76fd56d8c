"""SwiGLU kernel (kernels/swiglu.py through ops/swiglu.py) under the Triton interpreter on the fused
[gate | up] input, against silu(gate) * up written out in fp64 here, forward and backward.

Tolerances, as max|ours - fp64| / max|fp64|: fp32 1e-5 (measured about 3e-7); bf16 1e-2 (one rounding
of each output: measured up to 6e-3)."""

import pytest
import torch

from megatron_zpp.ops import dispatch
from megatron_zpp.ops import swiglu as swiglu_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def swiglu_fp64(h):
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    return gate / (1 + torch.exp(-gate)) * up


def rel_err(ours, exact):
    return ((ours.double() - exact).abs().max() / exact.abs().max()).item()


def check(h, dy):
    ours = h.detach().clone().requires_grad_()
    exact = h.detach().double().requires_grad_()
    y = swiglu_ops.swiglu(ours)
    assert type(y.grad_fn).__name__ == "SwiGLUFunctionBackward", "the kernel path did not run"
    y_exact = swiglu_fp64(exact)
    assert y.dtype == h.dtype and y.shape == y_exact.shape
    (dh,) = torch.autograd.grad(y, [ours], dy)
    (dh_exact,) = torch.autograd.grad(y_exact, [exact], dy.double())
    assert dh.dtype == h.dtype and dh.shape == h.shape
    errs = rel_err(y, y_exact), rel_err(dh, dh_exact)
    assert max(errs) < TOL[h.dtype], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (37, 100), (2, 3, 64), (2, 1100)])  # 1100: two column blocks
def test_forward_and_backward_against_fp64(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    h = (3 * torch.randn(*shape[:-1], 2 * shape[-1], generator=g)).to(dtype)  # both tails of the sigmoid
    dy = torch.randn(shape, generator=g).to(dtype)
    check(h, dy)


def test_strided_rows_and_cotangent():
    """Rows of a wider buffer, and a transposed (non-contiguous) cotangent."""
    h = torch.randn(5, 80)[:, 3:69]
    check(h, torch.randn(33, 5).t())


def test_fp64_and_torch_mode_take_the_reference():
    h = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    assert type(swiglu_ops.swiglu(h).grad_fn).__name__ != "SwiGLUFunctionBackward"
    dispatch.set_kernels("torch", torch.device("cpu"))
    y = swiglu_ops.swiglu(h.float())
    assert type(y.grad_fn).__name__ != "SwiGLUFunctionBackward"
    assert rel_err(y, swiglu_fp64(h.detach())) < 1e-5
