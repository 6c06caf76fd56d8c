"""The MoE token permutation's Triton kernels (interpreter) against an independent fp64 loop over the tokens:
the permute (a row gather) and the unpermute (each token's probability-weighted expert outputs summed), forward
and backward (through experts y = 2 tanh(x)), with dropped routes, padding rows (probability 0) and an empty
expert; and that the kernels ran."""

import pytest
import torch

from megatron_zpp.kernels import moe_permute as kernels
from megatron_zpp.moe.permute import drop_tokens, permute, unpermute


def _routing(n, e, topk, gen, capacity=None, pad=False):
    logits = torch.randn(n, e, generator=gen)
    logits[:, 1] = -1e9  # expert 1 gets no token
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    if capacity is not None:
        probs, routing_map = drop_tokens(probs, routing_map, topk, capacity, pad)
    return probs, routing_map


def _fp64_loop(x, probs, routing_map, dout):
    """Per token, per expert in index order, with experts y = 2 tanh(x): the permuted rows (expert-major, tokens
    in order), the combined output and the gradients of x and of the probabilities."""
    n, e = routing_map.shape
    rows = [(j, t) for j in range(e) for t in range(n) if routing_map[t, j]]
    x, dout = x.double(), dout.double()
    permuted = torch.stack([x[t] for _, t in rows])
    out, dx, dprobs = torch.zeros_like(x), torch.zeros_like(x), torch.zeros(n, e, dtype=torch.float64)
    for j, t in rows:
        p, y = probs[t, j].double(), 2 * torch.tanh(x[t])
        out[t] += p * y
        dx[t] += p * 2 * (1 - torch.tanh(x[t]) ** 2) * dout[t]
        dprobs[t, j] = (y * dout[t]).sum()
    return permuted, out, dx, dprobs


@pytest.mark.parametrize(
    "n,e,topk,h,dtype,capacity,pad",
    [
        (37, 6, 2, 40, torch.float32, None, False),
        (50, 8, 3, 24, torch.float32, 0.7, True),
        (29, 4, 2, 64, torch.bfloat16, 0.8, False),
    ],
)
def test_permute_kernels_equal_an_fp64_loop(count_calls, n, e, topk, h, dtype, capacity, pad):
    gen = torch.Generator().manual_seed(n * e + h)
    probs, routing_map = _routing(n, e, topk, gen, capacity, pad)
    probs.requires_grad_()
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    calls = count_calls(kernels, ["gather_rows", "slot_sum"])
    num_out = e * int(routing_map.sum(0).max()) if pad else None
    permuted, perm = permute(x, probs, routing_map, topk, num_out)
    assert perm.inv is not None  # the kernels' path
    out = unpermute(2 * torch.tanh(permuted), perm, dtype)
    dout = torch.randn(n, h, generator=gen).to(dtype)
    out.backward(dout)
    ref_perm, ref_out, ref_dx, ref_dprobs = _fp64_loop(x.detach(), probs.detach(), routing_map, dout)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, got, ref in (
        ("permuted", permuted, ref_perm),
        ("out", out, ref_out),
        ("d probs", probs.grad, ref_dprobs),
        ("dx", x.grad, ref_dx),
    ):
        err = ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert err < tol, (name, err)
    assert calls["gather_rows"] >= 2 and calls["slot_sum"] >= 2  # forward and backward of both


def test_kernels_equal_the_reference_path_bitwise_in_fp32():
    """The same sums in the same order: the kernels and the PyTorch slot buffer agree to the last bit (the
    routes' gradient of a padding row, probability 0, is dropped by both: it is 0 through any expert)."""
    from megatron_zpp.ops import dispatch

    gen = torch.Generator().manual_seed(3)
    probs, routing_map = _routing(64, 8, 2, gen)
    x, y = torch.randn(64, 32, generator=gen), torch.randn(128, 32, generator=gen)
    outs = []
    for mode in ("triton", "torch"):
        dispatch.set_kernels(mode, torch.device("cpu"))
        permuted, perm = permute(x, probs, routing_map, 2, 128)
        outs.append((permuted, unpermute(y, perm, torch.float32)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
