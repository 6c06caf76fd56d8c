"""Tests for the Gated DeltaNet operator's PyTorch forms (megatron_zpp.ops.gdn): the chunked WY/UT form and its
hand-written backward against the fp64 token loop (autograd through it), fla's naive reference, and the
context-parallel identity the module docstring states."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.ops.gdn import ChunkGDNFunction, chunk_gdn
from megatron_zpp.ops.gdn_naive import naive_recurrent_gdn

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def gates(kind, shape, gen):
    """Per-head log decays: mild (near 0), strong (down to -40 per token), mixed, or reset (mild with 8% -inf
    and every head's -inf at one token)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if kind == "mild":
        return -0.05 * u
    if kind == "strong":
        return -40.0 * u**2 - 5.0
    g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    if kind == "mixed":
        return torch.where(u < 0.3, -30.0 * u, g)
    g = g.masked_fill(u < 0.08, float("-inf"))
    g[:, shape[1] // 3] = float("-inf")  # a packed document's first token
    return g


def betas(kind, shape, gen):
    """beta in (0, 1): near 0, near 1, or mixed over the whole range."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return {"low": 1e-3 * (u + 0.01), "high": 1 - 1e-3 * (u + 0.01), "mixed": u.clamp(1e-3, 1 - 1e-3)}[kind]


def case(gate="mixed", beta="mixed", B=2, T=32, H=2, K=8, V=6, dtype=torch.float32, seed=0):
    """(q, k (L2-normalised, as the layer gives), v, g, beta in dtype; h0, do, dS in fp32 or fp64), no grad."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v, g, b = r(B, T, H, V), gates(gate, (B, T, H), gen), betas(beta, (B, T, H), gen)
    state_dt = torch.float64 if dtype == torch.float64 else torch.float32
    h0, do, dS = r(B, H, K, V).to(state_dt), r(B, T, H, V).to(dtype), r(B, H, K, V).to(state_dt)
    return *(x.to(dtype) for x in (q, k, v, g, b)), h0, do, dS


def run(fn, q, k, v, g, beta, h0, do, dS, **kw):
    """o, final state and the gradients of <o, do> + <final, dS> w.r.t. q, k, v, g, beta, h0."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    grads = torch.autograd.grad((o * do).sum() + (final * dS).sum(), leaves)
    return [o.detach(), final.detach(), *grads]


def fp64_token_loop(*inputs):
    return run(naive_recurrent_gdn, *(x.double() for x in inputs))


def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref|| in fp64."""
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 32])
@pytest.mark.parametrize("gate", ["mild", "mixed", "reset"])
def test_chunk_matches_the_token_loop_fp64(chunk_size, gate):
    inputs = case(gate, dtype=torch.float64, seed=chunk_size)
    for name, a, b in zip(NAMES, run(chunk_gdn, *inputs, chunk_size=chunk_size), fp64_token_loop(*inputs)):
        assert a.dtype == torch.float64 and rel_err(a, b) <= 1e-12, (name, rel_err(a, b))


@pytest.mark.parametrize("gate", ["mild", "reset"])
def test_any_length_pads_the_last_chunk_with_identity_tokens(gate):
    """T = 100 at chunk 64 (one full chunk and 36 tokens): output, final state and every gradient equal the token
    loop's over the 100 tokens (fp64), as do T = 5 at chunk 64 (a partial chunk only) and K != V."""
    for T, K, V in ((100, 8, 6), (5, 4, 10)):
        inputs = case(gate, dtype=torch.float64, T=T, K=K, V=V, seed=T)
        got = run(chunk_gdn, *inputs, chunk_size=64)
        assert got[0].shape == (2, T, 2, V)
        for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
            assert rel_err(a, b) <= 1e-12, (name, T, rel_err(a, b))


@pytest.mark.parametrize("gate", ["mild", "strong", "mixed", "reset"])
@pytest.mark.parametrize("beta", ["low", "high", "mixed"])
def test_chunk_fp32_matches_the_fp64_token_loop(gate, beta):
    inputs = case(gate, beta, T=64, K=16, V=12, seed=1)
    got = run(chunk_gdn, *inputs, chunk_size=16)
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, gate, beta, rel_err(a, b))
    if gate == "reset":  # a hard reset: the gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


def test_reset_forgets_the_state_exactly():
    """A -inf gate at token t makes everything from t on independent of the tokens before it and of h0."""
    q, k, v, g, beta, h0, _, _ = case("mild", T=32, dtype=torch.float64)
    g[:, 16] = float("-inf")
    o, final = chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    v2, h2 = v.clone(), 3 * h0
    v2[:, :16] = torch.randn_like(v2[:, :16])
    o2, final2 = chunk_gdn(q, k, v2, g, beta, initial_state=h2, output_final_state=True, chunk_size=8)
    assert torch.equal(o[:, 16:], o2[:, 16:]) and torch.equal(final, final2)


def test_matches_fla_naive_reference():
    """fla's naive_recurrent_gated_delta_rule (fla-core 0.6.0) takes [B, T, H, D], beta before g, does not
    L2-normalise and computes in fp32: the same recurrence as ours (both on normalised k here)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive", reason="the test extra installs fla-core")
    q, k, v, g, beta, h0, _, _ = case("mixed", T=24, H=3, K=8, V=10, seed=5)
    ref_o, ref_s = naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, 0.3, h0, True)
    o, s = chunk_gdn(q, k, v, g, beta, 0.3, h0, True, chunk_size=8)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(s, ref_s) <= 1e-5
    o_loop, s_loop = naive_recurrent_gdn(q.double(), k.double(), v.double(), g.double(), beta.double(), 0.3, h0, True)
    assert rel_err(o_loop, ref_o) <= 1e-5 and rel_err(s_loop, ref_s) <= 1e-5


def test_context_parallel_identity():
    """The module docstring's identity: v' = [v, 0_K] and h0' = [0, I_K] give o' = [o_loc, scale q^T P_t] and
    final state [U, M], the affine map of the entering state: chunk_gdn(h0) == o_loc + corr h0, U + M h0;
    gradients flow through the augmented call (V + K != K) to every input."""
    q, k, v, g, beta, h0, _, _ = case("reset", T=32, K=8, V=6, dtype=torch.float64, seed=6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    h_aug = torch.cat([torch.zeros(B, H, K, V, dtype=h0.dtype), torch.eye(K, dtype=h0.dtype).expand(B, H, K, K)], -1)
    h_aug.requires_grad_()
    o_aug, s_aug = chunk_gdn(q, k, v_aug, g, beta, 0.5, h_aug, True, chunk_size=8)
    o_loc, corr, U, M = o_aug[..., :V], o_aug[..., V:], s_aug[..., :V], s_aug[..., V:]
    o, s = naive_recurrent_gdn(q, k, v, g, beta, 0.5, h0, True)
    torch.testing.assert_close(o_loc + torch.einsum("bthk,bhkv->bthv", corr, h0), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(U + M @ h0, s, rtol=1e-12, atol=1e-12)
    # the same in two calls of widths V and K (the kernels' width limit at K = V = 128)
    o_v, s_v = chunk_gdn(q, k, v, g, beta, 0.5, None, True, chunk_size=8)
    o_k, s_k = chunk_gdn(q, k, v.new_zeros(B, T, H, K), g, beta, 0.5, h_aug[..., V:], True, chunk_size=8)
    for a, b in ((o_v, o_loc), (s_v, U), (o_k, corr), (s_k, M)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (d_h_aug,) = torch.autograd.grad(o_aug.sum() + s_aug.sum(), h_aug)
    assert d_h_aug.shape == h_aug.shape and torch.isfinite(d_h_aug).all()


def test_gradcheck_tiny():
    q, k, v, g, beta, h0, _, _ = case("reset", B=1, T=8, H=1, K=3, V=2, dtype=torch.float64, seed=7)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, h0)]  # g: -inf entries have no finite differences

    def f(q, k, v, beta, h0):
        return chunk_gdn(q, k, v, g, beta, 0.7, h0, True, chunk_size=4)

    assert torch.autograd.gradcheck(f, leaves)
    g_mild = gates("mild", (1, 8, 1), torch.Generator().manual_seed(8)).requires_grad_()
    assert torch.autograd.gradcheck(lambda g: chunk_gdn(q, k, v, g, beta, 0.7, h0, True, chunk_size=4), g_mild)


def test_bf16_inputs_are_close_to_fp64():
    inputs = case("mixed", T=32, K=16, V=16, dtype=torch.bfloat16, seed=9)
    got = run(chunk_gdn, *inputs, chunk_size=16)
    dtypes = (torch.bfloat16, torch.float32, *(torch.bfloat16,) * 5, torch.float32)
    for name, a, b, dt in zip(NAMES, got, fp64_token_loop(*inputs), dtypes):
        assert a.dtype == dt and rel_err(a, b) <= 2e-2, (name, rel_err(a, b))
    o32, _ = chunk_gdn(*inputs[:5], initial_state=inputs[5], chunk_size=16, out_dtype=torch.float32)
    assert o32.dtype == torch.float32 and rel_err(o32, got[0]) <= 1e-2


def test_function_saves_only_its_inputs_and_skips_absent_cotangents():
    q, k, v, g, beta, h0, do, _ = case(T=16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = ChunkGDNFunction.apply(*leaves, None, 8)
    assert {t.data_ptr() for t in o.grad_fn.saved_tensors} == {t.data_ptr() for t in leaves}
    grads = torch.autograd.grad((o * do).sum(), leaves)  # no final-state cotangent
    ref = torch.autograd.grad((naive_recurrent_gdn(*leaves[:5], initial_state=leaves[5])[0] * do).sum(), leaves)
    for a, b in zip(grads, ref):
        assert rel_err(a, b) <= 1e-5


def test_bad_shapes_are_refused_in_one_line():
    q, k, v, g, beta, h0, _, _ = case(T=16)
    bad = [
        ((q, k[:, :8], v, g, beta), "q, k must share shape"),
        ((q, k, v[:, :, :1], g, beta), "v must be [B, T, H, V]"),
        ((q, k, v, g[..., None], beta), "g must be [B, T, H]"),
        ((q, k, v, g, beta[:, :8]), "beta must be [B, T, H]"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            chunk_gdn(*args, chunk_size=8)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gdn(q, k, v, g, beta, initial_state=h0[..., :2], chunk_size=8)
    with pytest.raises(ValueError, match="multiple of chunk_size=0"):
        chunk_gdn(q, k, v, g, beta, chunk_size=0)
