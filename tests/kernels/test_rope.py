"""RoPE kernel (kernels/rope.py through ops/rope.py) under the Triton interpreter, against the rotation
written out in fp64 here from the positions (CP slice offsets included), forward and backward; q and k
of different head counts (GQA) rotated in place in the QKV projection's buffer; and a transformer
Block with --kernels triton (norm, RoPE, SwiGLU kernels) against --kernels torch.

Tolerances, as max|ours - fp64| / max|fp64|: fp32 1e-5 (the fp32 tables carry about 1e-6: measured
about 1e-6); bf16 1e-2 (one rounding of each output: measured up to 5e-3). Block: 1e-5 in fp32."""

import pytest
import torch

from megatron_zpp.model import ParallelContext
from megatron_zpp.model.gpt import Block
from megatron_zpp.model.rope import rope_tables
from megatron_zpp.ops import dispatch
from megatron_zpp.ops import rope as rope_ops
from tests.old_defaults import old_model

BASE = 10000.0
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rotate_fp64(x, positions, sign=1.0):
    """x [B, T, H, D] in fp64: pairs (x[i], x[i + D/2]) rotated by sign * position * BASE^(-2i/D)."""
    d = x.shape[-1]
    inv_freq = BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    theta = sign * positions.double()[:, None] * inv_freq[None, :]
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rel_err(ours, exact):
    return ((ours.double() - exact).abs().max() / exact.abs().max()).item()


def assert_kernel_ran(t):
    assert type(t.grad_fn).__name__.startswith("RopeFunction"), f"the kernel path did not run: {t.grad_fn}"


# (batch, tokens, query heads, kv heads, head dim, position offset: a CP rank's slice start)
CASES = [(1, 1, 1, 1, 8, 0), (2, 5, 4, 2, 34, 5), (1, 13, 3, 1, 100, 26), (2, 3, 2, 2, 64, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,hq,hk,d,offset", CASES)
def test_qk_in_place_in_the_qkv_buffer(B, T, hq, hk, d, offset, dtype):
    """The model's call: q and k heads as one slice of the fused [q | k | v] projection output, rotated
    in place; the gradient reaching the projection is rotated back by -theta for q and k, untouched for v."""
    g = torch.Generator().manual_seed(d + T)
    width = (hq + 2 * hk) * d
    base = torch.randn(B, T, width, generator=g).to(dtype).requires_grad_()
    qkv = base * 1  # a non-leaf, like the projection's output
    positions = torch.arange(offset, offset + T)
    cos, sin = rope_tables(d, positions, BASE)
    q, k = rope_ops.apply_rope_qk(qkv[..., : (hq + hk) * d].view(B, T, hq + hk, d), cos, sin, q_heads=hq)
    v = qkv[..., (hq + hk) * d :].view(B, T, hk, d)
    assert q.shape == (B, T, hq, d) and k.shape == (B, T, hk, d) and q.dtype == dtype
    # in place (the kernel ran: the reference makes new tensors): q and k are views of qkv's rotated heads
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert torch.equal(qkv[..., : hq * d].detach(), q.detach().reshape(B, T, -1))

    heads64 = base.detach().double()[..., : (hq + hk) * d].view(B, T, hq + hk, d)
    exact = rotate_fp64(heads64, positions)
    assert rel_err(q, exact[:, :, :hq]) < TOL[dtype]
    assert rel_err(k, exact[:, :, hq:]) < TOL[dtype]

    dq, dk, dv = (torch.randn(t.shape, generator=g).to(dtype) for t in (q, k, v))
    (grad,) = torch.autograd.grad([q, k, v], [base], [dq, dk, dv])
    grad_heads = rotate_fp64(torch.cat([dq, dk], dim=2).double(), positions, sign=-1.0)
    assert rel_err(grad[..., : (hq + hk) * d], grad_heads.reshape(B, T, -1)) < TOL[dtype]
    assert torch.equal(grad[..., (hq + hk) * d :], dv.reshape(B, T, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_of_place_on_strided_heads(dtype):
    """apply_rope into a new tensor, from heads with a padded head stride; the input is left as it was."""
    g = torch.Generator().manual_seed(0)
    B, T, H, d, offset = 2, 7, 3, 10, 14
    x = torch.randn(B, T, H, d + 6, generator=g).to(dtype)[..., :d].requires_grad_()
    before = x.detach().clone()
    positions = torch.arange(offset, offset + T)
    y = rope_ops.apply_rope(x, *rope_tables(d, positions, BASE))
    assert_kernel_ran(y)
    assert torch.equal(x.detach(), before)
    assert rel_err(y, rotate_fp64(x.detach().double(), positions)) < TOL[dtype]
    dy = torch.randn(B, T, H, d, generator=g).to(dtype)
    (dx,) = torch.autograd.grad(y, [x], dy)
    assert rel_err(dx, rotate_fp64(dy.double(), positions, sign=-1.0)) < TOL[dtype]


def test_torch_mode_takes_the_reference():
    dispatch.set_kernels("torch", torch.device("cpu"))
    positions = torch.arange(4, 9)
    x = torch.randn(1, 5, 2, 8, requires_grad=True)
    y = rope_ops.apply_rope(x, *rope_tables(8, positions, BASE))
    assert not type(y.grad_fn).__name__.startswith("RopeFunction")
    assert rel_err(y, rotate_fp64(x.detach().double(), positions)) < 1e-5


BLOCKS = {
    "rmsnorm_swiglu_gqa": dict(num_query_groups=2),
    "layernorm_gelu": dict(normalization="LayerNorm", activation="gelu"),
}


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_with_triton_kernels_equals_torch(kind):
    """One transformer Block, forward and backward (input and every parameter), --kernels triton vs torch."""
    cfg = old_model(num_layers=1, hidden_size=48, num_attention_heads=4, seq_length=8, **BLOCKS[kind])
    torch.manual_seed(0)
    block = Block(cfg, 0, ParallelContext())
    for p in block.parameters():
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.2)
    x = torch.randn(2, 8, 48, requires_grad=True)
    dy = torch.randn(2, 8, 48)
    rope = rope_tables(cfg.head_dim, torch.arange(8, 16), cfg.rotary_base)  # a second CP slice's positions

    def run(mode):
        dispatch.set_kernels(mode, torch.device("cpu"))
        y = block(x, rope)
        return [y, *torch.autograd.grad(y, [x, *block.parameters()], dy)]

    triton_out, torch_out = run("triton"), run("torch")
    for ours, ref in zip(triton_out, torch_out):
        assert rel_err(ours, ref.double()) < 1e-5


def test_per_sample_positions_of_packed_documents():
    """--reset-position-ids: tables [B, T, D] (each sample its own restarting positions), kernel and
    reference against the fp64 rotation of each sample, forward and backward, fp32."""
    B, T, H, d = 2, 12, 3, 16
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1], list(range(5, 17))])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, H, d, generator=g)
    dy = torch.randn(B, T, H, d, generator=g)
    cos, sin = rope_tables(d, positions, BASE)
    assert cos.shape == (B, T, d)
    for kernels in ("triton", "torch"):
        dispatch.set_kernels(kernels, torch.device("cpu"))
        leaf = x.clone().requires_grad_()
        y = rope_ops.apply_rope(leaf, cos, sin)
        if kernels == "triton":
            assert_kernel_ran(y)
        (grad,) = torch.autograd.grad(y, leaf, dy)
        for b in range(B):
            exact = rotate_fp64(x[b : b + 1].double(), positions[b])
            assert rel_err(y[b : b + 1], exact) < TOL[torch.float32], kernels
            assert rel_err(grad[b : b + 1], rotate_fp64(dy[b : b + 1].double(), positions[b], -1.0)) < 1e-5
