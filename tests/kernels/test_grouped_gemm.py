"""The grouped GEMM kernel (interpreter) against a per-group fp64 loop, forward and both backward products,
with uneven groups including empty ones (first, middle, last); then its ahead-of-time compile for sm_80/90."""

import os

import pytest
import torch

from megatron_zpp.ops import grouped_gemm as ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fp64_loop(x, w, sizes, dy):
    """Y, dX, dW by one fp64 matmul per group over explicit row ranges."""
    x, w, dy = x.double(), w.double(), dy.double()
    y, dx, dw = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, m in enumerate(sizes):
        rows = slice(start, start + m)
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += m
    return y, dx, dw


@pytest.mark.parametrize(
    "sizes,K,N,dtype",
    [
        ([0, 5, 17, 0, 33, 1, 0], 40, 24, torch.float32),  # empty first, middle and last groups, ragged tiles
        ([16, 16], 32, 32, torch.float32),  # exact tiles
        ([3, 0, 40, 9], 48, 72, torch.bfloat16),
    ],
)
def test_grouped_mm_equals_fp64_loop(sizes, K, N, dtype):
    g = torch.Generator().manual_seed(sum(sizes) + K)
    M, G = sum(sizes), len(sizes)
    x = torch.randn(M, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(G, K, N, generator=g) / K**0.5).to(dtype).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(dtype)
    y = ops.grouped_mm(x, w, torch.tensor(sizes))
    y.backward(dy)
    ref_y, ref_dx, ref_dw = _fp64_loop(x.detach(), w.detach(), sizes, dy)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding (fp32 accumulation)
    for name, got, ref in (("y", y, ref_y), ("dx", x.grad, ref_dx), ("dw", w.grad, ref_dw)):
        err = ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert err < tol, (name, err)
    assert not w.grad[[i for i, m in enumerate(sizes) if m == 0]].any()  # an empty group's dW is 0, written


def test_reference_path_equals_fp64_loop():
    from megatron_zpp.ops import dispatch

    dispatch.set_kernels("torch", torch.device("cpu"))
    sizes = [2, 0, 7]
    x, w = torch.randn(9, 8, dtype=torch.float64), torch.randn(3, 8, 4, dtype=torch.float64)
    y = ops.grouped_mm(x, w, torch.tensor(sizes))
    torch.testing.assert_close(y, _fp64_loop(x, w, sizes, torch.zeros(9, 4))[0], rtol=1e-12, atol=0)


def test_misplaced_rows_fail_by_orders_of_magnitude():
    """A plausible bug, rows of one group multiplied by the next group's matrix, is far outside the tolerance."""
    sizes, K, N = [5, 11], 16, 8
    x, w = torch.randn(16, K), torch.randn(2, K, N)
    ref = _fp64_loop(x, w, sizes, torch.zeros(16, N))[0]
    good = ops.grouped_mm(x, w, torch.tensor(sizes))
    bad = ops.grouped_mm(x, w, torch.tensor([6, 10]))
    assert (good.double() - ref).abs().max() < 1e-5 * ref.abs().max() < (bad.double() - ref).abs().max() * 1e-3


def test_kernel_ops_schema_and_fake_match_the_kernel():
    """The two custom ops (torch.compile sees each as one opaque node): schema, fake and AOT dispatch."""
    from megatron_zpp.ops import dispatch

    sizes = torch.tensor([3, 0, 5])
    x, w, dy = torch.randn(8, 16), torch.randn(3, 16, 24), torch.randn(8, 24)
    offsets = ops.group_offsets(sizes)
    calls = {
        "grouped_mm_fwd": [(x, w, offsets, False), (dy, w, offsets, True)],
        "grouped_mm_wgrad": [(x, dy, offsets, torch.float32)],
    }
    for name, arg_lists in calls.items():
        for args in arg_lists:
            torch.library.opcheck(
                dispatch.KERNEL_OPS[name],
                args,
                test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
            )
