"""Triton Kimi Delta Attention kernels (megatron_zpp/kernels/kda.py) under TRITON_INTERPRET=1 on CPU tensors.

chunk_kda forward + backward on the kernels against the fp64 token loop (naive_recurrent_kda, autograd through
it) and against the chunked PyTorch form. Tolerances are norm-wise relative errors: 1e-5 for fp32 inputs and
between two fp32-computing paths; 2e-2 against fp64 with bf16 dot operands emulated.
"""

import pytest
import torch

from megatron_zpp.kernels import chunk_common
from megatron_zpp.kernels import kda as kda_kernels
from megatron_zpp.ops import dispatch
from megatron_zpp.ops.kda import chunk_kda, chunk_kda_uses_kernels
from tests.ops.test_kda import NAMES, case, fp64_token_loop, rel_err, run

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def kernels_on(count_calls):
    """A count of the kernel wrappers' calls (conftest.py switches to the Triton kernels, the interpreter)."""
    return count_calls(kda_kernels, ("fwd", "bwd"))


@pytest.mark.parametrize(
    "gate, beta, C, shape",
    [
        ("mixed", "mixed", 16, dict(B=1, T=48, K=12, V=20)),  # odd K and V (padded tiles), 3 chunks
        ("strong", "high", 32, dict(B=1, T=64, K=16, V=8)),  # 2 sub-blocks a chunk; undecayed last-token terms
        ("reset", "low", 16, dict(B=2, T=32, K=20, V=16)),  # per-channel and whole-token resets
        ("mild", "mixed", 64, dict(B=1, T=64, K=16, V=16)),  # 4 sub-blocks: pairs across the blocks between
    ],
)
def test_chunk_kda_fp32_matches_the_fp64_token_loop(kernels_on, gate, beta, C, shape):
    inputs = case(gate, beta, seed=C, **shape)
    got = run(chunk_kda, *inputs, chunk_size=C)
    assert kernels_on == {"fwd": 1, "bwd": 1}
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    if gate == "reset":  # a hard reset: the gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


def test_bf16_matches_the_chunked_reference_and_emulated_dots_the_fp64_loop(kernels_on, monkeypatch):
    """bf16 inputs: the kernels (fp32 dots in the interpreter) against the chunked reference; then with a GPU
    launch's bf16 dot operands emulated, within bf16's tolerance of the fp64 recurrence."""
    inputs = case("reset", "mixed", T=32, K=16, V=24, dtype=torch.bfloat16, seed=2)
    got = run(chunk_kda, *inputs, chunk_size=16)
    monkeypatch.setattr(chunk_common, "EMULATE_BF16_DOTS", True)
    emulated = run(chunk_kda, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 2, "bwd": 2}
    dispatch.set_kernels("torch", CPU)
    for name, a, b, c in zip(NAMES, got, run(chunk_kda, *inputs, chunk_size=16), fp64_token_loop(*inputs)):
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-2, (name, rel_err(a, b))  # bf16 rounding of outputs
        assert rel_err(emulated[NAMES.index(name)], c) <= 2e-2, (name, rel_err(emulated[NAMES.index(name)], c))
    assert (emulated[5][torch.isneginf(inputs[3])] == 0).all()


def test_gpu_tiles_strided_views_and_absent_cotangents(kernels_on, monkeypatch):
    """The GPU launches' decomposition in the interpreter: every K and V tile cut to 16 (several tiles with masked
    tails; the scans' state in two tiles), on q, k, v, g read in place as strided views of one projection output;
    then the backward with only the output's cotangent and with only the final state's."""

    def small_gpu_tiles(kernel, K, V, bf16, device, *drop):
        cfg = kda_kernels.gpu_tiles(kernel, K, V, bf16) | dict(BV=16, BK=32 if "states" in kernel else 16, DBK=16)
        return {key: val for key, val in cfg.items() if key not in drop and (key != "DBK" or kernel == "scores")}

    monkeypatch.setattr(kda_kernels, "_config", small_gpu_tiles)
    B, T, H, K, V, C = 1, 32, 2, 40, 24, 32
    q, k, v, g, beta, h0, do, dS = case("reset", "mixed", B=B, T=T, H=H, K=K, V=V, seed=4)
    proj = torch.zeros(B, T, H * (3 * K + V) + 3)  # a projection's output; the layer views its sections
    widths = (H * K, H * K, H * V, H * K)
    views = [proj[..., sum(widths[:i]) : sum(widths[: i + 1])].view(B, T, H, -1) for i in range(4)]
    for view, x in zip(views, (q, k, v, g)):
        view.copy_(x)
    assert not any(x.is_contiguous() for x in views)
    got = run(chunk_kda, *views, beta, h0, do, dS, chunk_size=C)
    only_o = run(chunk_kda, *views, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    _, final = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=C)
    only_state = torch.autograd.grad((final * dS).sum(), leaves)  # the output's cotangent is None
    assert kernels_on == {"fwd": 3, "bwd": 3}
    dispatch.set_kernels("torch", CPU)
    ref = run(chunk_kda, q, k, v, g, beta, h0, do, dS, chunk_size=C)
    ref_o = run(chunk_kda, q, k, v, g, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    ref_state = torch.autograd.grad((chunk_kda(*leaves[:5], None, leaves[5], True, C)[1] * dS).sum(), leaves)
    for name, a, b in zip(NAMES, got + only_o, ref + ref_o):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    for name, a, b in zip(NAMES[2:], only_state, ref_state):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_wide_values_run_in_column_groups_and_the_cp_identity_holds(kernels_on, monkeypatch):
    """A V wider than the kernels take runs in column groups (here 16 wide): the CP call on [v, 0_K] from
    [0, I_K] (V + K = 8 + 16 = 24 as 16 + 8) gives o_loc + corr h0 and U + M h0 equal to the fp64 loop from h0."""
    from megatron_zpp.ops import kda as kda_ops
    from megatron_zpp.ops.kda_naive import naive_recurrent_kda

    monkeypatch.setattr(kda_ops, "KERNEL_V", 16)
    q, k, v, g, beta, h0, _, _ = case("reset", "mixed", B=1, T=32, K=16, V=8, seed=5)
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    h_aug = torch.cat([torch.zeros(B, H, K, V), torch.eye(K).expand(B, H, K, K)], -1).requires_grad_()
    o_aug, s_aug = chunk_kda(q, k, v_aug, g, beta, 0.5, h_aug, True, chunk_size=16)
    (o_aug.sum() + s_aug.sum()).backward()
    assert kernels_on == {"fwd": 2, "bwd": 2} and chunk_kda_uses_kernels(q, k, v_aug, g, beta, 16)
    o, s = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), 0.5, h0.double(), True)
    o_got = o_aug[..., :V] + torch.einsum("bthk,bhkv->bthv", o_aug[..., V:], h0)
    assert rel_err(o_got, o) <= 1e-5 and rel_err(s_aug[..., :V] + s_aug[..., V:] @ h0, s) <= 1e-5
    assert torch.isfinite(h_aug.grad).all()


def test_context_parallel_passes_on_the_kernels(kernels_on, monkeypatch):
    """kda_affine (the plain pass in column groups of 16, V = 24 as 16 + 8, and the transition pass as a forward on
    K zero columns from I) and kda_vjp (the backward at the entering state, in the same groups) on the kernels equal
    the chunked PyTorch form: (o_loc, r, U, M) and (dq, dk, dv, dg, dbeta, dh0)."""
    from megatron_zpp.ops import delta_rule
    from megatron_zpp.ops import kda as kda_ops

    monkeypatch.setattr(kda_ops, "KERNEL_V", 16)
    monkeypatch.setattr(delta_rule, "KERNEL_V", 16)
    q, k, v, g, beta, h0, do, dS = case("reset", "mixed", B=1, T=32, K=16, V=24, seed=6)

    def passes():
        return (*kda_ops.kda_affine(q, k, v, g, beta, 0.3, 16), *kda_ops.kda_vjp(q, k, v, g, beta, h0, do, dS, 0.3, 16))

    got = passes()
    assert kernels_on == {"fwd": 3, "bwd": 2}
    dispatch.set_kernels("torch", CPU)
    for i, (a, b) in enumerate(zip(got, passes())):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (i, rel_err(a, b))


def test_calls_the_kernels_do_not_take_fall_back(kernels_on):
    q, k, v, g, beta, *_ = case(T=32, K=8, V=8)
    chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double(), chunk_size=16)  # fp64
    chunk_kda(q, k, v, g, beta, chunk_size=8)  # chunk below 16
    wide = torch.zeros(1, 16, 1, 136)
    chunk_kda(wide, wide, wide[..., :8], wide, beta[:1, :16, :1], chunk_size=16)  # K > 128
    assert kernels_on == {"fwd": 0, "bwd": 0}
    assert chunk_kda_uses_kernels(q, k, v, g, beta, 16) and not chunk_kda_uses_kernels(q, k, v, g, beta, 128)
    assert "kda [" in dispatch.describe(CPU)


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_fake_tensor_mode_runs_as_shapes(kernels_on, mode):
    """The dry run's FakeTensorMode: the kernels' custom ops run their fakes, the reference runs as shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch.set_kernels(mode, CPU)
    with FakeTensorMode():
        q, v = torch.randn(1, 64, 2, 16, requires_grad=True), torch.randn(1, 64, 2, 24, requires_grad=True)
        g, beta = torch.zeros(1, 64, 2, 16, requires_grad=True), torch.rand(1, 64, 2, requires_grad=True)
        h0 = torch.randn(1, 2, 16, 24, requires_grad=True)
        o, final = chunk_kda(q, q, v, g, beta, None, h0, True, 32)
        (o.sum() + final.sum()).backward()
    assert o.shape == v.shape and final.shape == h0.shape and final.dtype == torch.float32
    assert q.grad.shape == g.grad.shape == q.shape and beta.grad.shape == beta.shape and h0.grad.shape == h0.shape
    assert kernels_on == ({"fwd": 0, "bwd": 0})  # no launch: the custom ops' fakes (triton) or torch ops ran
