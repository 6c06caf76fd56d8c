"""Triton GLA chunk kernels (megatron_zpp/kernels/gla.py) under TRITON_INTERPRET=1 on CPU tensors.

Each building block of megatron_zpp/ops/gla.py with the kernels against the same block with the PyTorch
reference, and chunk_gla forward + backward against the fp64 token loop (naive_recurrent_gla). Tolerances are
norm-wise relative errors: 1e-5 for fp32 (measured <= ~1e-6), bf16 inputs 1e-5 between the two fp32-computing
paths and 1e-2 against fp64 (bf16 rounding of o and of the gradients).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.context_parallel.gla import ContextParallelGLA
from megatron_zpp.kernels import chunk_common
from megatron_zpp.kernels import gla as gla_kernels
from megatron_zpp.ops import dispatch
from megatron_zpp.ops.gla import (
    chunk_gla,
    chunk_gla_bwd,
    chunk_gla_fwd_output,
    chunk_gla_fwd_states,
    chunk_gla_local,
    gla_state_correction,
)
from megatron_zpp.ops.gla_naive import naive_recurrent_gla

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dh0")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def kernels_on(count_calls):
    """A count of the kernel wrappers' calls (conftest.py switches to the Triton kernels, the interpreter)."""
    return count_calls(gla_kernels, ("fwd_states", "fwd_output", "bwd"))


def gates(kind, shape, gen):
    """mild (logsigmoid), strong (down to -40 per token) or reset (mild with 8% of entries and one token -inf)."""
    if kind == "mild":
        return F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    if kind == "strong":
        return -40.0 * torch.rand(shape, generator=gen, dtype=torch.float64) ** 2
    g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    g = g.masked_fill(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.08, float("-inf"))
    g[:, shape[1] // 3, 0] = float("-inf")  # every key of one token of head 0: a full reset
    return g


def case(kind="mild", B=1, T=48, H=2, K=12, V=20, dtype=torch.float32, seed=0):
    """(q, k, v, g in dtype; h0, do, dS in fp32), all fp64-generated, no grad."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, g = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), gates(kind, (B, T, H, K), gen)
    h0, do, dS = r(B, H, K, V), r(B, T, H, V), r(B, H, K, V)
    return *(x.to(dtype) for x in (q, k, v, g)), h0.float(), do.to(dtype), dS.float()


def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref|| in fp64 (0 when both are 0)."""
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def building_blocks(q, k, v, g, h0, do, dS, C):
    """Every building block's outputs: states, o, and the backward with both cotangents and each alone."""
    states, final = chunk_gla_fwd_states(k, v, g, h0, C)
    out = [states, final, chunk_gla_fwd_output(q, k, v, g, states, 0.3, C)]
    out += chunk_gla_bwd(q, k, v, g, h0, do, dS, 0.3, C)
    out += chunk_gla_bwd(q, k, v, g, h0, do, None, 0.3, C, states_in=states)
    out += chunk_gla_bwd(q, k, v, g, None, None, dS, 0.3, C)
    return out


@pytest.mark.parametrize(
    "kind, C, shape, dtype",
    [
        ("mild", 16, dict(B=2, T=48, K=12, V=20), torch.float32),  # odd K and V, 3 chunks of one sub-block
        ("strong", 32, dict(T=64, K=20, V=24), torch.float32),  # 2 sub-blocks per chunk
        ("mild", 64, dict(T=128, K=16, V=16), torch.float32),  # 4 sub-blocks: decays across the ones between
        ("reset", 32, dict(T=64, K=16, V=16), torch.float32),
        ("reset", 16, dict(T=32, K=20, V=16), torch.bfloat16),  # bf16 in, both paths compute in fp32
    ],
)
def test_building_blocks_match_the_reference(kernels_on, kind, C, shape, dtype):
    inputs = case(kind, dtype=dtype, **shape)
    got = building_blocks(*inputs, C)
    assert kernels_on == {"fwd_states": 3, "fwd_output": 1, "bwd": 3}  # two backward calls recompute the states
    dispatch.set_kernels("torch", CPU)
    ref = building_blocks(*inputs, C)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, i
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (i, rel_err(a, b))
    reset = torch.isneginf(inputs[3])
    for dg in (got[6], got[11], got[16]):  # the gate gradient is exactly 0 at a hard reset
        assert (dg[reset] == 0).all()


def run_chunk_gla(fn, q, k, v, g, h0, do, dS, **kw):
    """o, final state and the gradients of <o, do> + <final, dS> w.r.t. q, k, v, g, h0."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, h0)]
    o, final = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, **kw)
    grads = torch.autograd.grad((o * do).sum() + (final * dS).sum(), leaves)
    return [o.detach(), final.detach(), *grads]


def fp64_token_loop(q, k, v, g, h0, do, dS):
    return run_chunk_gla(naive_recurrent_gla, *(x.double() for x in (q, k, v, g, h0, do, dS)))


@pytest.mark.parametrize("kind", ["mild", "strong", "reset"])
def test_chunk_gla_fp32_matches_the_fp64_token_loop(kernels_on, kind):
    inputs = case(kind, B=2, T=48, K=12, V=20, seed=1)
    got = run_chunk_gla(chunk_gla, *inputs, chunk_size=16)
    assert kernels_on == {"fwd_states": 2, "fwd_output": 1, "bwd": 1}  # the backward recomputes the states
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    if kind == "reset":
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


def test_chunk_gla_bf16_matches_the_fp64_token_loop(kernels_on):
    inputs = case("mild", T=64, K=16, V=24, dtype=torch.bfloat16, seed=2)
    got = run_chunk_gla(chunk_gla, *inputs, chunk_size=32)
    assert kernels_on["bwd"] == 1
    dtypes = (torch.bfloat16, torch.float32, *(torch.bfloat16,) * 4, torch.float32)
    for name, a, b, dt in zip(NAMES, got, fp64_token_loop(*inputs), dtypes):
        assert a.dtype == dt and torch.isfinite(a.float()).all(), name
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("kind", ["mild", "reset"])
def test_bf16_dot_operands_match_the_fp64_token_loop(kernels_on, monkeypatch, kind):
    """A GPU launch on bf16 inputs feeds its dots bf16 operands (fp32 accumulation): the interpreter emulates that
    rounding (kernels/chunk_common.py round_bf16), and the result stays within bf16's tolerance of the fp64
    recurrence."""
    monkeypatch.setattr(chunk_common, "EMULATE_BF16_DOTS", True)
    inputs = case(kind, T=64, K=16, V=24, dtype=torch.bfloat16, seed=2)
    got = run_chunk_gla(chunk_gla, *inputs, chunk_size=32)
    assert kernels_on["bwd"] == 1
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert torch.isfinite(a.float()).all() and rel_err(a, b) <= 1e-2, (name, rel_err(a, b))
    if kind == "reset":
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


class _OneRankScan:
    """A stand-in for the CP state scan of one rank: its incoming state is the head, and the rank after it
    sends back dS_out, the gradient of the state this rank passes on."""

    def __init__(self, dS_out):
        self.dS_out = dS_out

    def forward(self, S_loc, log_gamma, head):
        return head.to(S_loc.dtype)

    def backward(self, dS_corr):
        return self.dS_out


def test_context_parallel_pieces_run_the_kernels(kernels_on):
    q, k, v, g, h0, do, dS = case("reset", T=32, K=12, V=20, seed=3)
    ref = fp64_token_loop(q, k, v, g, h0, do, dS)

    def local_plus_correction(q, k, v, g, initial_state, output_final_state):
        o_loc, s_loc, log_gamma = chunk_gla_local(q, k, v, g, chunk_size=16)
        return o_loc + gla_state_correction(q, g, initial_state), s_loc + log_gamma.exp()[..., None] * initial_state

    got = run_chunk_gla(local_plus_correction, q, k, v, g, h0, do, dS)
    assert kernels_on == {"fwd_states": 2, "fwd_output": 1, "bwd": 1}
    for name, a, b in zip(NAMES, got, ref):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))

    # The All-Scan's autograd Function: o = o_loc + correction, with the state gradient from the next rank.
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, h0)]
    o = ContextParallelGLA.apply(*leaves, _OneRankScan(dS), 12**-0.5, 16)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    assert kernels_on == {"fwd_states": 4, "fwd_output": 2, "bwd": 3}
    for name, a, b in zip(NAMES[:1] + NAMES[2:], [o.detach(), *grads], ref[:1] + ref[2:]):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_calls_the_kernels_do_not_take_fall_back(kernels_on):
    q, k, v, g, h0, do, dS = case(T=32, K=12, V=20)
    chunk_gla(q.double(), k.double(), v.double(), g.double(), chunk_size=16)  # fp64
    chunk_gla(q, k, v, g, chunk_size=8)  # chunk below one sub-block
    big = torch.zeros(1, 16, 1, 264)
    chunk_gla(big, big, big[..., :8], big, chunk_size=16)  # K > 256
    assert kernels_on == {"fwd_states": 0, "fwd_output": 0, "bwd": 0}
    dispatch.set_kernels("torch", CPU)
    chunk_gla_bwd(q, k, v, g, h0, do, dS, None, 16)
    assert kernels_on["bwd"] == 0
    assert "gla [" in dispatch.describe(CPU)


def test_gpu_tiles_and_strided_views_match_the_reference(kernels_on, monkeypatch):
    """The GPU launches' decomposition in the interpreter: the config table's kernels with every tile cut to 16
    (several K / V tiles with masked tails, score blocks of 16 rows or columns, one flat grid over tile, chunk
    and head), on q, k, v read in place as strided views of one projection output, g of another."""

    def small_gpu_tiles(kernel, C, K, V, bf16, device):
        cfg = gla_kernels.gpu_tiles(kernel, C, K, V, bf16)
        return {name: min(x, 16) if name.startswith(("B", "DB")) else x for name, x in cfg.items()}

    monkeypatch.setattr(gla_kernels, "_config", small_gpu_tiles)
    B, T, H, K, V, C = 2, 64, 2, 40, 24, 32
    q, k, v, g, h0, do, dS = case("strong", B=B, T=T, H=H, K=K, V=V, seed=4)
    proj = torch.zeros(B, T, H * (2 * K + V) + 3)  # a projection's output; the GLA layer views its sections
    q_view, k_view = proj[..., : H * K].view(B, T, H, K), proj[..., H * K : 2 * H * K].view(B, T, H, K)
    v_view = proj[..., 2 * H * K : 2 * H * K + H * V].view(B, T, H, V)
    for view, x in zip((q_view, k_view, v_view), (q, k, v)):
        view.copy_(x)
    g_view = torch.zeros(B, T, H, 2 * K)[..., 5 : 5 + K]  # head stride 2K, token stride 2HK
    g_view.copy_(g)
    assert not any(x.is_contiguous() for x in (q_view, k_view, v_view, g_view))
    got = building_blocks(q_view, k_view, v_view, g_view, h0, do, dS, C)
    dispatch.set_kernels("torch", CPU)
    ref = building_blocks(q, k, v, g, h0, do, dS, C)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (i, rel_err(a, b))


AOT_CHECK = """
import json, sys, torch
from megatron_zpp.kernels import gla
from megatron_zpp.testing import triton_aot as aot

arch, C, N, dt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4])
H, D = 2, 128
meta = lambda *s, dtype=dt: torch.empty(*s, device="meta", dtype=dtype)  # noqa: E731
q, k, v, g, do = (meta(1, N * C, H, D) for _ in range(5))
h0, dS = meta(1, H, D, D, dtype=torch.float32), meta(1, H, D, D, dtype=torch.float32)
with aot.recording(arch) as launches:
    states, _ = gla.fwd_states(k, v, g, h0, C)  # states [1, H, N, D, D]
    gla.fwd_output(q, k, v, g, states, 0.1, C)
    gla.bwd(q, k, v, g, h0, do, dS, 0.1, C, states_in=states)
out = []
for launch in {x.kernel: x for x in launches}.values():  # intra_scores runs twice, the same specialization
    c = aot.compile_launch(launch, arch)
    lines = c.ttir.splitlines()
    scalar = [x.split(" : ")[-1].split(" loc(")[0] for x in lines if "tt.addptr" in x and " : !tt.ptr<" in x]
    pid64 = any("tt.get_program_id" in x for x in lines) and any("arith.extsi %pid" in x for x in lines)
    out.append(dict(kernel=launch.kernel, grid=launch.grid, problems=aot.grid_problems(launch), spills=c.spills,
                    shared=c.shared, scalar_offsets=scalar, pid64=pid64))
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    "arch, C, N, dtype",
    [
        (90, 16, 65536 + 64, "bfloat16"),  # 1.05M tokens, past 65535 chunks; entering states of 2.1e9 elements
        (80, 64, 4, "float32"),  # the CUDA default chunk, fp32 (the most registers) on sm_80 (the least shared)
    ],
)
def test_launches_compile_with_64_bit_offsets_and_no_chunk_limit(tmp_path, arch, C, N, dtype):
    """The real wrappers compiled for a GPU (megatron_zpp/testing/triton_aot.py, no GPU here): every grid is one
    axis within its limit and covers every chunk, every kernel extends its program id to 64 bits and adds only
    64-bit scalar offsets to its pointers (the per-tile offsets inside a chunk stay 32-bit), none spills and
    each fits the target's shared memory."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cached cubin comes without ptxas' report
    argv = [sys.executable, "-c", AOT_CHECK, str(arch), str(C), str(N), dtype]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    launches = json.loads(run.stdout.strip().splitlines()[-1])
    assert {x["kernel"] for x in launches} == {
        "_fwd_states_kernel", "_intra_scores_kernel", "_output_kernel", "_bwd_states_kernel",
        "_score_grad_kernel", "_intra_grad_kernel", "_dv_kernel", "_dqkg_kernel",
    }  # fmt: skip
    for x in launches:
        name = x["kernel"]
        assert len(x["grid"]) == 1 and x["problems"] == [], (name, x["grid"])
        assert x["grid"][0] >= (N if "states" not in name else 2), (name, x["grid"])
        assert x["pid64"], name
        assert x["scalar_offsets"] and all(o.endswith(", i64") for o in x["scalar_offsets"]), (name, x)
        assert x["spills"] == 0 and x["shared"] <= {80: 166912, 90: 232448}[arch], (name, x["spills"], x["shared"])
