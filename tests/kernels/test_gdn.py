"""Triton Gated DeltaNet kernels (megatron_zpp/kernels/gdn.py) under TRITON_INTERPRET=1 on CPU tensors.

chunk_gdn forward + backward on the kernels against the fp64 token loop (naive_recurrent_gdn, autograd through
it) and against the chunked PyTorch form. Tolerances are norm-wise relative errors: 1e-5 for fp32 inputs and
for bf16 inputs between the two fp32-computing paths; 2e-2 against fp64 with bf16 dot operands emulated.
"""

import pytest
import torch

from megatron_zpp.kernels import chunk_common
from megatron_zpp.kernels import gdn as gdn_kernels
from megatron_zpp.ops import dispatch
from megatron_zpp.ops.gdn import chunk_gdn, chunk_gdn_uses_kernels
from tests.ops.test_gdn import NAMES, case, fp64_token_loop, rel_err, run

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def kernels_on(count_calls):
    """A count of the kernel wrappers' calls (conftest.py switches to the Triton kernels, the interpreter)."""
    return count_calls(gdn_kernels, ("fwd", "bwd"))


@pytest.mark.parametrize(
    "gate, beta, C, shape",
    [
        ("mixed", "mixed", 16, dict(B=2, T=48, K=12, V=20)),  # odd K and V (padded tiles), 3 chunks
        ("strong", "high", 32, dict(T=64, K=16, V=8)),
        ("strong", "mixed", 16, dict(T=64, K=16, V=12)),  # a chunk's last token's terms dwarf the decayed rest
        ("reset", "low", 16, dict(T=32, K=20, V=16)),
        ("mild", "mixed", 64, dict(T=64, K=16, V=16)),
    ],
)
def test_chunk_gdn_fp32_matches_the_fp64_token_loop(kernels_on, gate, beta, C, shape):
    inputs = case(gate, beta, seed=C, **shape)
    got = run(chunk_gdn, *inputs, chunk_size=C)
    assert kernels_on == {"fwd": 1, "bwd": 1}
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    if gate == "reset":  # a hard reset: the gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


def test_bf16_matches_the_chunked_reference(kernels_on):
    inputs = case("reset", "mixed", T=32, K=16, V=24, dtype=torch.bfloat16, seed=2)
    got = run(chunk_gdn, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 1, "bwd": 1}
    dispatch.set_kernels("torch", CPU)
    ref = run(chunk_gdn, *inputs, chunk_size=16)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-2, (name, rel_err(a, b))  # bf16 rounding of outputs


@pytest.mark.parametrize("gate", ["mixed", "reset"])
def test_bf16_dot_operands_match_the_fp64_token_loop(kernels_on, monkeypatch, gate):
    """A GPU launch on bf16 inputs feeds its dots bf16 operands (fp32 accumulation); the interpreter emulates that
    rounding, and the result stays within bf16's tolerance of the fp64 recurrence."""
    monkeypatch.setattr(chunk_common, "EMULATE_BF16_DOTS", True)
    inputs = case(gate, "mixed", T=32, K=16, V=24, dtype=torch.bfloat16, seed=3)
    got = run(chunk_gdn, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 1, "bwd": 1}
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert torch.isfinite(a.float()).all() and rel_err(a, b) <= 2e-2, (name, rel_err(a, b))
    if gate == "reset":
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


def test_gpu_tiles_strided_views_and_absent_cotangents(kernels_on, monkeypatch):
    """The GPU launches' decomposition in the interpreter: every K and V tile cut to 16 (several tiles with masked
    tails; the scans' state in two tiles), on q, k, v read in place as strided views of one projection output;
    then the backward with only the output's cotangent and with only the final state's."""

    def small_gpu_tiles(kernel, C, K, V, bf16, device):
        cfg = gdn_kernels.gpu_tiles(kernel, C, K, V, bf16)
        return cfg | dict(BV=16, BK=32 if "states" in kernel else 16)  # the scans: K = 40 in two tiles of 32 rows

    monkeypatch.setattr(gdn_kernels, "_config", small_gpu_tiles)
    B, T, H, K, V, C = 1, 32, 2, 40, 24, 16
    q, k, v, g, beta, h0, do, dS = case("reset", "mixed", B=B, T=T, H=H, K=K, V=V, seed=4)
    proj = torch.zeros(B, T, H * (2 * K + V) + 3)  # a projection's output; the layer views its sections
    views = (proj[..., : H * K], proj[..., H * K : 2 * H * K], proj[..., 2 * H * K : 2 * H * K + H * V])
    q_view, k_view, v_view = (x.view(B, T, H, -1) for x in views)
    for view, x in zip((q_view, k_view, v_view), (q, k, v)):
        view.copy_(x)
    assert not any(x.is_contiguous() for x in (q_view, k_view, v_view))
    got = run(chunk_gdn, q_view, k_view, v_view, g, beta, h0, do, dS, chunk_size=C)
    only_o = run(chunk_gdn, q_view, k_view, v_view, g, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    _, final = chunk_gdn(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=C)
    only_state = torch.autograd.grad((final * dS).sum(), leaves)  # the output's cotangent is None
    assert kernels_on == {"fwd": 3, "bwd": 3}
    dispatch.set_kernels("torch", CPU)
    ref = run(chunk_gdn, q, k, v, g, beta, h0, do, dS, chunk_size=C)
    ref_o = run(chunk_gdn, q, k, v, g, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    ref_state = torch.autograd.grad((chunk_gdn(*leaves[:5], None, leaves[5], True, C)[1] * dS).sum(), leaves)
    for name, a, b in zip(NAMES, got + only_o, ref + ref_o):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    for name, a, b in zip(NAMES[2:], only_state, ref_state):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_wide_values_run_in_column_groups(kernels_on, monkeypatch):
    """A V wider than the kernels take runs in column groups (here 16 wide: V = 24 as 16 + 8), on the kernels, with
    the results and gradients of the unsplit chunked reference."""
    from megatron_zpp.ops import gdn as gdn_ops

    monkeypatch.setattr(gdn_ops, "KERNEL_V", 16)
    inputs = case("reset", "mixed", T=32, K=8, V=24, seed=5)
    got = run(chunk_gdn, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 2, "bwd": 2} and chunk_gdn_uses_kernels(*inputs[:5], 16)
    dispatch.set_kernels("torch", CPU)
    for name, a, b in zip(NAMES, got, run(chunk_gdn, *inputs, chunk_size=16)):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_context_parallel_passes_on_the_kernels(kernels_on, monkeypatch):
    """gdn_affine (the plain pass in column groups of 16, V = 24 as 16 + 8, and the transition pass as a forward on
    K zero columns from I) and gdn_vjp (the backward at the entering state, in the same groups) on the kernels equal
    the chunked PyTorch form: (o_loc, r, U, M) and (dq, dk, dv, dg, dbeta, dh0)."""
    from megatron_zpp.ops import delta_rule
    from megatron_zpp.ops import gdn as gdn_ops

    monkeypatch.setattr(gdn_ops, "KERNEL_V", 16)
    monkeypatch.setattr(delta_rule, "KERNEL_V", 16)
    q, k, v, g, beta, h0, do, dS = case("reset", "mixed", T=32, K=16, V=24, seed=6)

    def passes():
        return (*gdn_ops.gdn_affine(q, k, v, g, beta, 0.3, 16), *gdn_ops.gdn_vjp(q, k, v, g, beta, h0, do, dS, 0.3, 16))

    got = passes()
    assert kernels_on == {"fwd": 3, "bwd": 2}
    dispatch.set_kernels("torch", CPU)
    for i, (a, b) in enumerate(zip(got, passes())):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (i, rel_err(a, b))


def test_calls_the_kernels_do_not_take_fall_back(kernels_on):
    q, k, v, g, beta, *_ = case(T=32, K=8, V=8)
    chunk_gdn(q.double(), k.double(), v.double(), g.double(), beta.double(), chunk_size=16)  # fp64
    chunk_gdn(q, k, v, g, beta, chunk_size=8)  # chunk below 16
    wide = torch.zeros(1, 16, 1, 136)
    chunk_gdn(wide, wide, wide[..., :8], g[:1, :16, :1], beta[:1, :16, :1], chunk_size=16)  # K > 128
    assert kernels_on == {"fwd": 0, "bwd": 0}
    assert chunk_gdn_uses_kernels(q, k, v, g, beta, 16) and not chunk_gdn_uses_kernels(q, k, v, g, beta, 128)
    assert "gdn [" in dispatch.describe(CPU)


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_fake_tensor_mode_runs_as_shapes(kernels_on, mode):
    """The dry run's FakeTensorMode: the kernels' custom ops run their fakes, the reference runs as shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch.set_kernels(mode, CPU)
    with FakeTensorMode():
        q, v = torch.randn(1, 64, 2, 16, requires_grad=True), torch.randn(1, 64, 2, 24, requires_grad=True)
        g, beta = torch.zeros(1, 64, 2, requires_grad=True), torch.rand(1, 64, 2, requires_grad=True)
        h0 = torch.randn(1, 2, 16, 24, requires_grad=True)
        o, final = chunk_gdn(q, q, v, g, beta, None, h0, True, 32)
        (o.sum() + final.sum()).backward()
    assert o.shape == v.shape and final.shape == h0.shape and final.dtype == torch.float32
    assert q.grad.shape == q.shape and g.grad.shape == beta.grad.shape == g.shape and h0.grad.shape == h0.shape
    assert kernels_on == ({"fwd": 0, "bwd": 0})  # no launch: the custom ops' fakes (triton) or torch ops ran
