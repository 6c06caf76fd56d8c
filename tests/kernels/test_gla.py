"""Triton GLA chunk kernels (megatron_zpp/kernels/gla.py) under TRITON_INTERPRET=1 on CPU tensors.

Each building block of megatron_zpp/ops/gla.py with the kernels against the same block with the PyTorch
reference, and chunk_gla forward + backward against the fp64 token loop (recurrent_gla). Tolerances are
norm-wise relative errors: 1e-5 for fp32 (measured <= ~1e-6), bf16 inputs 1e-5 between the two fp32-computing
paths and 1e-2 against fp64 (bf16 rounding of o and of the gradients).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.context_parallel.gla import ContextParallelGLA
from megatron_zpp.kernels import gla as gla_kernels
from megatron_zpp.ops import dispatch
from megatron_zpp.ops.gla import (
    chunk_gla,
    chunk_gla_bwd,
    chunk_gla_fwd_output,
    chunk_gla_fwd_states,
    chunk_gla_local,
    gla_state_correction,
    recurrent_gla,
)

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dh0")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """--kernels triton (the interpreter), and a count of the kernel wrappers' calls."""
    calls = {"fwd_states": 0, "fwd_output": 0, "bwd": 0}
    for name in calls:
        original = getattr(gla_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(gla_kernels, name, counted)
    dispatch.set_kernels("triton", CPU)
    yield calls
    dispatch.set_kernels("auto", CPU)


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
    return run_chunk_gla(recurrent_gla, *(x.double() for x in (q, k, v, g, h0, do, dS)))


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
