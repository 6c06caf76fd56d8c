"""The delta-rule Triton kernels under TRITON_INTERPRET=1 on CPU tensors, one harness for both families: Gated
DeltaNet (megatron_zpp/kernels/gdn.py) and Kimi Delta Attention (megatron_zpp/kernels/kda.py).

chunk_gdn / chunk_kda forward + backward on the kernels against the fp64 token loop (autograd through it) and
against the chunked PyTorch form. Tolerances are norm-wise relative errors: 1e-5 for fp32 inputs and between two
fp32-computing paths; 1e-2 for bf16 outputs against the reference's; 2e-2 against fp64 with bf16 dot operands
emulated.
"""

import pytest
import torch

from megatron_zpp.kernels import chunk_common
from megatron_zpp.kernels import gdn as gdn_kernels
from megatron_zpp.kernels import kda as kda_kernels
from megatron_zpp.ops import delta_rule, dispatch
from megatron_zpp.ops import gdn as gdn_ops
from megatron_zpp.ops import kda as kda_ops
from tests.ops.test_delta_rule import MIXERS, NAMES, case, fp64_token_loop, rel_err, run

CPU = torch.device("cpu")
KERNELS = {"gdn": gdn_kernels, "kda": kda_kernels}
OPS = {"gdn": gdn_ops.OP, "kda": kda_ops.OP}
mixers = pytest.mark.parametrize("mixer", list(MIXERS))


@pytest.fixture
def kernels_on(count_calls, mixer):
    """A count of the mixer's kernel wrappers' calls (conftest.py switches to the Triton kernels, the interpreter)."""
    return count_calls(KERNELS[mixer], ("fwd", "bwd"))


@pytest.mark.parametrize(
    "mixer, gate, beta, C, shape",
    [
        ("gdn", "mixed", "mixed", 16, dict(B=2, T=48, K=12, V=20)),  # odd K and V (padded tiles), 3 chunks
        ("gdn", "strong", "high", 32, dict(T=64, K=16, V=8)),
        ("gdn", "strong", "mixed", 16, dict(T=64, K=16, V=12)),  # a chunk's last token's terms dwarf the rest
        ("gdn", "reset", "low", 16, dict(T=32, K=20, V=16)),
        ("gdn", "mild", "mixed", 64, dict(T=64, K=16, V=16)),
        ("kda", "mixed", "mixed", 16, dict(B=1, T=48, K=12, V=20)),  # odd K and V (padded tiles), 3 chunks
        ("kda", "strong", "high", 32, dict(B=1, T=64, K=16, V=8)),  # 2 sub-blocks a chunk; undecayed last terms
        ("kda", "reset", "low", 16, dict(B=2, T=32, K=20, V=16)),  # per-channel and whole-token resets
        ("kda", "mild", "mixed", 64, dict(B=1, T=64, K=16, V=16)),  # 4 sub-blocks: pairs across the blocks between
    ],
)
def test_fp32_matches_the_fp64_token_loop(kernels_on, mixer, gate, beta, C, shape):
    inputs = case(mixer, gate, beta, seed=C, **shape)
    got = run(MIXERS[mixer].op, *inputs, chunk_size=C)
    assert kernels_on == {"fwd": 1, "bwd": 1}
    for name, a, b in zip(NAMES, got, fp64_token_loop(mixer, *inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    if gate == "reset":  # a hard reset: the gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


@mixers
def test_bf16_matches_the_chunked_reference_and_emulated_dots_the_fp64_loop(kernels_on, monkeypatch, mixer):
    """bf16 inputs (mixed gates with resets): the kernels (fp32 dots in the interpreter) against the chunked
    reference; then with a GPU launch's bf16 dot operands emulated (fp32 accumulation), within bf16's tolerance
    of the fp64 recurrence, and no gradient at a reset gate."""
    op = MIXERS[mixer].op
    inputs = case(mixer, "reset", "mixed", T=32, K=16, V=24, dtype=torch.bfloat16, seed=2)
    got = run(op, *inputs, chunk_size=16)
    monkeypatch.setattr(chunk_common, "EMULATE_BF16_DOTS", True)
    emulated = run(op, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 2, "bwd": 2}
    dispatch.set_kernels("torch", CPU)
    ref, loop = run(op, *inputs, chunk_size=16), fp64_token_loop(mixer, *inputs)
    for name, a, b, e, c in zip(NAMES, got, ref, emulated, loop):
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-2, (name, rel_err(a, b))  # bf16 rounding of outputs
        assert torch.isfinite(e.float()).all() and rel_err(e, c) <= 2e-2, (name, rel_err(e, c))
    assert (emulated[5][torch.isneginf(inputs[3])] == 0).all()


def small_gpu_tiles(mixer):
    """The mixer's _config with the GPU table's rows cut to tiles of 16 (the scans' state in two tiles of 32 rows)."""
    kernels = KERNELS[mixer]
    if mixer == "gdn":
        return lambda kernel, C, K, V, bf16, device: (
            kernels.gpu_tiles(kernel, C, K, V, bf16) | dict(BV=16, BK=32 if "states" in kernel else 16)
        )

    def kda_tiles(kernel, K, V, bf16, device, *drop):
        cfg = kernels.gpu_tiles(kernel, K, V, bf16) | dict(BV=16, BK=32 if "states" in kernel else 16, DBK=16)
        return {key: val for key, val in cfg.items() if key not in drop and (key != "DBK" or kernel == "scores")}

    return kda_tiles


@mixers
def test_gpu_tiles_strided_views_and_absent_cotangents(kernels_on, monkeypatch, mixer):
    """The GPU launches' decomposition in the interpreter: every K and V tile cut to 16 (several tiles with masked
    tails; the scans' state in two tiles), on q, k, v (and KDA's g) read in place as strided views of one
    projection output; then the backward with only the output's cotangent and with only the final state's."""
    monkeypatch.setattr(KERNELS[mixer], "_config", small_gpu_tiles(mixer))
    op, per_channel = MIXERS[mixer].op, MIXERS[mixer].per_channel
    B, T, H, K, V, C = 1, 32, 2, 40, 24, 32 if per_channel else 16
    q, k, v, g, beta, h0, do, dS = case(mixer, "reset", "mixed", B=B, T=T, H=H, K=K, V=V, seed=4)
    widths = (H * K, H * K, H * V) + ((H * K,) if per_channel else ())
    proj = torch.zeros(B, T, sum(widths) + 3)  # a projection's output; the layer views its sections
    views = [proj[..., sum(widths[:i]) : sum(widths[: i + 1])].view(B, T, H, -1) for i in range(len(widths))]
    for view, x in zip(views, (q, k, v, g)):
        view.copy_(x)
    assert not any(x.is_contiguous() for x in views)
    viewed = (*views, g)[:4]
    got = run(op, *viewed, beta, h0, do, dS, chunk_size=C)
    only_o = run(op, *viewed, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    _, final = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=C)
    only_state = torch.autograd.grad((final * dS).sum(), leaves)  # the output's cotangent is None
    assert kernels_on == {"fwd": 3, "bwd": 3}
    dispatch.set_kernels("torch", CPU)
    ref = run(op, q, k, v, g, beta, h0, do, dS, chunk_size=C)
    ref_o = run(op, q, k, v, g, beta, h0, do, torch.zeros_like(dS), chunk_size=C)
    ref_state = torch.autograd.grad((op(*leaves[:5], None, leaves[5], True, C)[1] * dS).sum(), leaves)
    for name, a, b in zip(NAMES, got + only_o, ref + ref_o):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    for name, a, b in zip(NAMES[2:], only_state, ref_state):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@mixers
def test_wide_values_run_in_column_groups(kernels_on, monkeypatch, mixer):
    """A V wider than the kernels take runs in column groups (here 16 wide: V = 24 as 16 + 8, the initial state
    split alike), on the kernels, with the results and gradients of the unsplit chunked reference."""
    monkeypatch.setattr(delta_rule, "KERNEL_V", 16)
    op = MIXERS[mixer].op
    inputs = case(mixer, "reset", "mixed", T=32, K=8, V=24, seed=5)
    got = run(op, *inputs, chunk_size=16)
    assert kernels_on == {"fwd": 2, "bwd": 2} and OPS[mixer].uses_kernels(*inputs[:5], 16)
    dispatch.set_kernels("torch", CPU)
    for name, a, b in zip(NAMES, got, run(op, *inputs, chunk_size=16)):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@mixers
def test_context_parallel_passes_on_the_kernels(kernels_on, monkeypatch, mixer):
    """The op's affine pass (the plain pass in column groups of 16, V = 24 as 16 + 8, and the transition pass as a
    forward on K zero columns from I) and its vjp (the backward at the entering state, in the same groups) on the
    kernels equal the chunked PyTorch form: (o_loc, r, U, M) and (dq, dk, dv, dg, dbeta, dh0)."""
    monkeypatch.setattr(delta_rule, "KERNEL_V", 16)
    B = 1 if MIXERS[mixer].per_channel else 2
    q, k, v, g, beta, h0, do, dS = case(mixer, "reset", "mixed", B=B, T=32, K=16, V=24, seed=6)
    op = OPS[mixer]

    def passes():
        return (*op.affine(q, k, v, g, beta, 0.3, 16), *op.vjp(q, k, v, g, beta, h0, do, dS, 0.3, 16))

    got = passes()
    assert kernels_on == {"fwd": 3, "bwd": 2}
    dispatch.set_kernels("torch", CPU)
    for i, (a, b) in enumerate(zip(got, passes())):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (i, rel_err(a, b))


@mixers
def test_calls_the_kernels_do_not_take_fall_back(kernels_on, mixer):
    op, uses = MIXERS[mixer].op, OPS[mixer].uses_kernels
    q, k, v, g, beta, *_ = case(mixer, T=32, K=8, V=8)
    op(q.double(), k.double(), v.double(), g.double(), beta.double(), chunk_size=16)  # fp64
    op(q, k, v, g, beta, chunk_size=8)  # chunk below 16
    wide = torch.zeros(1, 16, 1, 136)
    g_wide = wide if MIXERS[mixer].per_channel else g[:1, :16, :1]
    op(wide, wide, wide[..., :8], g_wide, beta[:1, :16, :1], chunk_size=16)  # K > 128
    assert kernels_on == {"fwd": 0, "bwd": 0}
    assert uses(q, k, v, g, beta, 16) and not uses(q, k, v, g, beta, 128)
    assert f"{mixer} [" in dispatch.describe(CPU)


@mixers
@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_fake_tensor_mode_runs_as_shapes(kernels_on, mixer, mode):
    """The dry run's FakeTensorMode: the kernels' custom ops run their fakes, the reference runs as shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch.set_kernels(mode, CPU)
    with FakeTensorMode():
        q, v = torch.randn(1, 64, 2, 16, requires_grad=True), torch.randn(1, 64, 2, 24, requires_grad=True)
        g = torch.zeros(1, 64, 2, *((16,) if MIXERS[mixer].per_channel else ()), requires_grad=True)
        beta = torch.rand(1, 64, 2, requires_grad=True)
        h0 = torch.randn(1, 2, 16, 24, requires_grad=True)
        o, final = MIXERS[mixer].op(q, q, v, g, beta, None, h0, True, 32)
        (o.sum() + final.sum()).backward()
    assert o.shape == v.shape and final.shape == h0.shape and final.dtype == torch.float32
    assert q.grad.shape == q.shape and g.grad.shape == g.shape and beta.grad.shape == beta.shape
    assert h0.grad.shape == h0.shape
    assert kernels_on == ({"fwd": 0, "bwd": 0})  # no launch: the custom ops' fakes (triton) or torch ops ran
