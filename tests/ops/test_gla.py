"""Tests for the pure-PyTorch GLA operators (megatron_zpp.ops.gla)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.ops.gla import (
    ChunkGLABackward,
    ChunkGLAForward,
    ChunkGLAFunction,
    chunk_gla,
    chunk_gla_bwd,
    chunk_gla_fwd_output,
    chunk_gla_fwd_states,
    chunk_gla_local,
    gla_state_correction,
)
from megatron_zpp.ops.gla_naive import naive_recurrent_gla


def make_inputs(B=2, T=32, H=2, K=8, V=6, dtype=torch.float64, g_min=None, seed=0, with_state=True):
    """Random q, k, v, g (g <= 0) and initial state; g_min forces decays down to g_min."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H, K)) / 16
    if g_min is not None:  # mix of strong (down to g_min) and mild decays
        g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) ** 2
    h0 = r(B, H, K, V) if with_state else None
    q, k, v, g = (x.to(dtype).requires_grad_() for x in (q, k, v, g))
    if h0 is not None:
        h0 = h0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    return q, k, v, g, h0


def run_with_grads(fn, q, k, v, g, h0, **kw):
    """Output, final state, and grads of q, k, v, g, h0 under a fixed random cotangent."""
    leaves = [x for x in (q, k, v, g, h0) if x is not None]
    o, ht = fn(q, k, v, g, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    return o.detach(), ht.detach(), grads


def assert_close_all(a, b, rtol, atol):
    for x, y in zip(a, b):
        if isinstance(x, (tuple, list)):
            assert_close_all(x, y, rtol, atol)
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent_fp64(chunk_size, with_state):
    inp = make_inputs(T=32, with_state=with_state)
    ref = run_with_grads(naive_recurrent_gla, *inp)
    out = run_with_grads(chunk_gla, *inp, chunk_size=chunk_size)
    assert_close_all(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_strong_decay_fp64_and_finite(chunk_size):
    # g down to -50 per token over T=256: cumulative decays reach ~-1e4 within a chunk.
    inp = make_inputs(B=1, T=256, H=2, K=8, V=4, g_min=-50.0)
    ref = run_with_grads(naive_recurrent_gla, *inp)
    out = run_with_grads(chunk_gla, *inp, chunk_size=chunk_size)
    assert_close_all(out, ref, rtol=1e-10, atol=1e-10)
    for t in [out[0], out[1], *out[2]]:
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("g_value", [-50.0, -1000.0])
def test_strong_decay_fp32_finite(g_value):
    q, k, v, g, h0 = make_inputs(B=1, T=256, H=2, K=8, V=4, dtype=torch.float32)
    g = torch.full_like(g, g_value).requires_grad_()
    o, ht, grads = run_with_grads(chunk_gla, q, k, v, g, h0, chunk_size=16)
    for t in [o, ht, *grads]:
        assert torch.isfinite(t).all()


def test_fp32_matches_fp64():
    q, k, v, g, h0 = make_inputs(B=2, T=64, H=2, K=16, V=16, dtype=torch.float32)
    out32 = run_with_grads(chunk_gla, q, k, v, g, h0)
    up = [x.detach().double().requires_grad_() for x in (q, k, v, g, h0)]
    ref = run_with_grads(naive_recurrent_gla, *up)
    for a, b in zip([out32[0], out32[1], *out32[2]], [ref[0], ref[1], *ref[2]]):
        assert a.dtype == torch.float32
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < 1e-5, err


def test_gradcheck_tiny():
    q, k, v, g, h0 = make_inputs(B=1, T=8, H=1, K=3, V=2, g_min=-3.0)

    def f(q, k, v, g, h0):
        return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=4)

    assert torch.autograd.gradcheck(f, (q, k, v, g, h0))


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_local_plus_correction(chunk_size):
    q, k, v, g, h0 = make_inputs(T=32, g_min=-5.0)
    o_ref, ht_ref = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_loc, s_loc, log_gamma = chunk_gla_local(q, k, v, g, chunk_size=chunk_size)
    assert s_loc.shape == h0.shape and log_gamma.shape == h0.shape[:3]
    o = o_loc + gla_state_correction(q, g, h0)
    ht = s_loc + log_gamma.exp()[..., None] * h0
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    # Gradients of the decomposition match the fused path.
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    leaves = (q, k, v, g, h0)
    ga = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    gb = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), leaves)
    assert_close_all(ga, gb, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("P", [2, 4])
def test_sequence_split_chains_states(P):
    # Emulates sequence parallelism: each slice runs locally, states are chained serially.
    q, k, v, g, h0 = make_inputs(T=64, g_min=-2.0)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    for sl in torch.arange(64).chunk(P):
        qs, ks, vs, gs = (x[:, sl] for x in (q, k, v, g))
        o_loc, s_loc, log_gamma = chunk_gla_local(qs, ks, vs, gs, chunk_size=8)
        outs.append(o_loc + gla_state_correction(qs, gs, state))
        state = s_loc + log_gamma.exp()[..., None] * state
    torch.testing.assert_close(torch.cat(outs, dim=1), o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ht_ref, rtol=1e-10, atol=1e-10)
    # Same via chunk_gla with initial_state per slice.
    state, outs = h0, []
    for sl in torch.arange(64).chunk(P):
        o, state = chunk_gla(*(x[:, sl] for x in (q, k, v, g)), initial_state=state, output_final_state=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_ref, rtol=1e-10, atol=1e-10)


def test_bf16_runs_and_is_close():
    q, k, v, g, h0 = make_inputs(B=2, T=64, H=2, K=16, V=16, dtype=torch.bfloat16)
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    q64, k64, v64, g64, h64 = (x.detach().double() for x in (q, k, v, g, h0))
    o_ref, ht_ref = naive_recurrent_gla(q64, k64, v64, g64, initial_state=h64, output_final_state=True)
    assert ((o.double() - o_ref).abs().max() / o_ref.abs().max()) < 2e-2
    assert ((ht.double() - ht_ref).abs().max() / ht_ref.abs().max()) < 1e-4
    o.float().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, g))
    assert q.grad.dtype == torch.bfloat16


def test_defaults_and_errors():
    q, k, v, g, _ = make_inputs(T=16, with_state=False)
    o, ht = chunk_gla(q, k, v, g)
    assert ht is None and o.shape == v.shape
    o2, _ = chunk_gla(q, k, v, g, scale=q.shape[-1] ** -0.5)
    torch.testing.assert_close(o, o2)
    o3, _ = naive_recurrent_gla(q, k, v, g, scale=2.0)
    torch.testing.assert_close(chunk_gla(q, k, v, g, scale=2.0)[0], o3)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        chunk_gla(q, k, v, g, chunk_size=5)
    with pytest.raises(ValueError):
        chunk_gla(q, k, v[..., :1, :], g)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gla(q, k, v, g, initial_state=torch.zeros(2, 2, 8, 5))


# ----------------------------------------------------------------------------------------
# ChunkGLAFunction in fp32 against an fp64 token loop, across gate regimes

OUTPUT_NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "d_initial_state")


def gate_case(kind, B=1, T=192, H=2, K=8, V=8, dtype=torch.float32, seed=0):
    """q, k, v, g, h0 with gates: mild (GLA's logsigmoid / 16), strong (uniform in [-50, 0]),
    mixed (each entry -1000 or -1e-4) or reset (mild with 5% of entries -inf). Leaves of `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, h0 = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, H, K, V)
    g = {
        "mild": lambda: F.logsigmoid(r(B, T, H, K)) / 16,
        "strong": lambda: -50.0 * u(B, T, H, K),
        "mixed": lambda: torch.where(u(B, T, H, K) < 0.5, -1000.0, -1e-4),
        "reset": lambda: (F.logsigmoid(r(B, T, H, K)) / 16).masked_fill(u(B, T, H, K) < 0.05, float("-inf")),
    }[kind]()
    h0_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return *(x.to(dtype).requires_grad_() for x in (q, k, v, g)), h0.to(h0_dtype).requires_grad_()


def flat(result):
    o, ht, grads = result
    return [o, ht, *grads]


def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref||, in fp64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


@functools.cache
def fp64_reference(kind):
    """Token loop in fp64 (autograd) on the fp32 inputs of gate_case(kind), upcast."""
    inp = [x.detach().double().requires_grad_() for x in gate_case(kind)]
    return [t.detach() for t in flat(run_with_grads(naive_recurrent_gla, *inp))]


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
@pytest.mark.parametrize("kind", ["mild", "strong", "mixed", "reset"])
def test_function_fp32_matches_fp64_token_loop(kind, chunk_size):
    # T = 192: not a power of two, a multiple of every chunk size; the loss reads o and the final state.
    got = flat(run_with_grads(chunk_gla, *gate_case(kind), chunk_size=chunk_size))
    for name, a, b in zip(OUTPUT_NAMES, got, fp64_reference(kind)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_hard_reset_gate_has_zero_gradient():
    # dL/dg_t = exp(g_t) <S_{t-1}, dS_t> is exactly 0 at g_t = -inf; so is the reference's.
    q, k, v, g, h0 = gate_case("reset")
    dg = run_with_grads(chunk_gla, q, k, v, g, h0, chunk_size=16)[2][3]
    reset = torch.isneginf(g.detach())
    assert reset.any() and (dg[reset] == 0).all()
    assert (fp64_reference("reset")[5][reset] == 0).all()


def test_function_saves_only_its_inputs():
    # Activation memory: q, k, v, g and the initial state, nothing per chunk (states are recomputed).
    q, k, v, g, h0 = gate_case("mild", T=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o, ht = ChunkGLAFunction.apply(q, k, v, g, h0, 0.5, 16)
    assert sum(t.numel() * t.element_size() for t in saved) == sum(x.numel() * 4 for x in (q, k, v, g, h0))
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gla_state_correction(q, g, h0)
    assert sum(t.numel() * t.element_size() for t in saved) == sum(x.numel() * 4 for x in (q, g, h0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bwd_is_linear_in_the_cotangents(dtype):
    q, k, v, g, h0 = (x.detach() for x in gate_case("strong", T=96, dtype=dtype))
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype)
    dS = torch.randn(h0.shape, generator=gen, dtype=torch.float64).to(h0.dtype)
    states_in, final_state = chunk_gla_fwd_states(k, v, g, h0, 16)
    both = chunk_gla_bwd(q, k, v, g, h0, do, dS, None, 16)
    local = chunk_gla_bwd(q, k, v, g, h0, do, None, None, 16, states_in=states_in)
    state_only = chunk_gla_bwd(q, k, v, g, h0, None, dS, None, 16, states_in=states_in)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for name, a, b, c in zip(("dq", "dk", "dv", "dg", "dh0"), both, local, state_only):
        assert rel_err(b + c, a) <= tol, (name, rel_err(b + c, a))
    assert (state_only[0] == 0).all()  # dq: o does not depend on d_final_state
    # The building blocks compose to the Function's forward.
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert rel_err(chunk_gla_fwd_output(q, k, v, g, states_in, None, 16), o) <= tol
    assert rel_err(final_state, ht) == 0


def test_bf16_inputs_grads_close_to_fp64():
    # bf16 in, fp32 inside: o and gradients come back in bf16, within bf16 rounding of the fp64 recurrence.
    inp = gate_case("mild", T=64, dtype=torch.bfloat16)
    got = flat(run_with_grads(chunk_gla, *inp, chunk_size=16))
    ref = flat(run_with_grads(naive_recurrent_gla, *(x.detach().double().requires_grad_() for x in inp)))
    dtypes = [torch.bfloat16, torch.float32, *(x.dtype for x in inp)]
    for name, a, b, dt in zip(OUTPUT_NAMES, got, ref, dtypes):
        assert a.dtype == dt, name
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))


def test_gradcheck_state_correction_and_local():
    q, k, v, g, h0 = make_inputs(B=1, T=8, H=1, K=3, V=2, g_min=-3.0)
    assert torch.autograd.gradcheck(lambda q, g, h0: gla_state_correction(q, g, h0, 0.7), (q, g, h0))
    assert torch.autograd.gradcheck(lambda q, k, v, g: chunk_gla_local(q, k, v, g, chunk_size=4), (q, k, v, g))


@pytest.mark.parametrize("kind", ["strong", "reset"])
def test_local_plus_correction_fp32(kind):
    # The All-Scan decomposition in fp32 with strong decays or hard resets, against the fp64 token loop.
    def decomposed(q, k, v, g, initial_state, output_final_state, chunk_size):
        o_loc, s_loc, log_gamma = chunk_gla_local(q, k, v, g, chunk_size=chunk_size)
        o = o_loc + gla_state_correction(q, g, initial_state)
        return o, s_loc + log_gamma.exp()[..., None] * initial_state

    inp = gate_case(kind, T=64)
    got = flat(run_with_grads(decomposed, *inp, chunk_size=16))
    ref = flat(run_with_grads(naive_recurrent_gla, *(x.detach().double().requires_grad_() for x in inp)))
    for name, a, b in zip(OUTPUT_NAMES, got, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_matches_fla_naive_reference():
    from fla.ops.gla.naive import (
        naive_recurrent_gla as fla_naive,
    )  # a dev dependency; imported here: it takes seconds (triton)

    q, k, v, g, h0 = make_inputs(T=32)
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    # fla's naive reference uses the same [B, T, H, K] layout in recent versions.
    o_ref, ht_ref = fla_naive(q, k, v, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref.to(o.dtype), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ht_ref.to(ht.dtype), rtol=1e-5, atol=1e-5)
    # Forward and every gradient in fp32 against fla's token loop (fp32 too), mild and strong gates.
    for kind in ("mild", "strong"):
        inp = gate_case(kind, T=64, dtype=torch.float32)
        got = run_with_grads(chunk_gla, *inp, chunk_size=16)
        ref = run_with_grads(fla_naive, *inp)
        for name, a, b in zip(OUTPUT_NAMES, flat(got), flat(ref)):
            assert rel_err(a, b) <= 1e-5, (kind, name, rel_err(a, b))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kind", ["mild", "strong", "reset"])
def test_staged_blocks_chain_to_the_token_loop(kind, dtype, tol):
    # The All-Scan's order: states from a zero state, the intra-chunk output, the initial state's share
    # added afterwards; backward stage A (d_initial), B (output grads), C (with d_final_state).
    # T = 40, chunk 8: odd K, V; against chunk_gla_bwd and the fp64 token loop (norm-wise relative error).
    C, scale = 8, 0.3
    q, k, v, g, h0 = (x.detach() for x in gate_case(kind, B=2, T=40, H=2, K=5, V=7, dtype=dtype, seed=4))
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype)
    dS = torch.randn(h0.shape, generator=gen, dtype=torch.float64).to(h0.dtype)
    leaves = [x.double().requires_grad_() for x in (q, k, v, g, h0)]
    o_ref, ht_ref = naive_recurrent_gla(*leaves[:4], scale, leaves[4], True)
    ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dS.double()).sum(), leaves)
    ref_do = torch.autograd.grad((naive_recurrent_gla(*leaves[:4], scale, leaves[4])[0] * do.double()).sum(), leaves[4])

    fwd = ChunkGLAForward(q, k, v, g, scale, C)
    assert rel_err(fwd.final_state, chunk_gla_fwd_states(k, v, g, None, C)[1]) <= tol  # what the scan sends
    fwd.intra()
    o, states = fwd.finish(h0)
    assert rel_err(states, chunk_gla_fwd_states(k, v, g, h0, C)[0]) <= tol
    assert rel_err(o, o_ref) <= tol
    assert rel_err(o, chunk_gla_fwd_output(q, k, v, g, states, scale, C)) <= tol
    assert (
        rel_err(ChunkGLAForward(q, k, v, g, scale, C).finish(None)[0], chunk_gla(q, k, v, g, scale, chunk_size=C)[0])
        <= tol
    )

    stages = ChunkGLABackward(q, k, v, g, states, do, scale, C)
    assert rel_err(stages.d_initial, ref_do[0]) <= tol  # the gradient reaching h0 from do alone
    stages.output_grads()
    got = stages.finish(dS)
    fused = chunk_gla_bwd(q, k, v, g, h0, do, dS, scale, C)
    for name, a, b, c in zip(("dq", "dk", "dv", "dg", "dh0"), got, ref, fused):
        assert a.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), name
        assert torch.isfinite(a).all() and rel_err(a, b) <= tol, (name, rel_err(a, b))
        assert rel_err(a, c) <= tol, (name, rel_err(a, c))
    if kind == "reset":
        assert (got[3][torch.isneginf(g)] == 0).all()
    # No output cotangent: only the final state's share (dq = 0), as chunk_gla_bwd(do=None).
    state_only = ChunkGLABackward(q, k, v, g, states, None, scale, C).finish(dS)
    for a, b in zip(state_only, chunk_gla_bwd(q, k, v, g, h0, None, dS, scale, C)):
        assert rel_err(a, b) <= tol if b.norm() > 0 else (a == 0).all()
