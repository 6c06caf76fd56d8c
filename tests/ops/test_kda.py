"""Tests for the Kimi Delta Attention operator's PyTorch forms (megatron_zpp.ops.kda): the chunked WY/UT form and its
hand-written backward against the fp64 token loop (autograd through it), fla's naive_recurrent_kda (an independent
transcription of the recurrence), an explicit product of K x K matrices, and the context-parallel identity the
module docstring states."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.ops.kda import ChunkKDAFunction, chunk_kda
from megatron_zpp.ops.kda_naive import naive_kda_transition, naive_recurrent_kda

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def gates(kind, shape, gen):
    """Per-channel log decays [B, T, H, K]: mild (a near 1), strong (a near 0: down to -40 per token), mixed
    (per channel: 30% of the channels strong, the rest logsigmoid-distributed), or reset (mixed with 5% of the
    channels -inf one by one, and every channel -inf at one token: a packed document's start)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if kind == "mild":
        return -0.05 * u
    if kind == "strong":
        return -40.0 * u**2 - 5.0
    g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    g = torch.where(torch.rand(shape[-1:], generator=gen, dtype=torch.float64) < 0.3, -30.0 * u - 3.0, g)
    if kind == "mixed":
        return g
    g = g.masked_fill(u < 0.05, float("-inf"))
    g[:, shape[1] // 3] = float("-inf")
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
    v, g, b = r(B, T, H, V), gates(gate, (B, T, H, K), gen), betas(beta, (B, T, H), gen)
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
    return run(naive_recurrent_kda, *(x.double() for x in inputs))


def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref|| in fp64."""
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 32])
@pytest.mark.parametrize("gate", ["mild", "mixed", "reset"])
def test_chunk_matches_the_token_loop_fp64(chunk_size, gate):
    inputs = case(gate, dtype=torch.float64, seed=chunk_size)
    for name, a, b in zip(NAMES, run(chunk_kda, *inputs, chunk_size=chunk_size), fp64_token_loop(*inputs)):
        assert a.dtype == torch.float64 and rel_err(a, b) <= 1e-12, (name, rel_err(a, b))


@pytest.mark.parametrize("gate", ["mild", "strong", "mixed", "reset"])
@pytest.mark.parametrize("beta", ["low", "high", "mixed"])
def test_chunk_fp32_matches_the_fp64_token_loop(gate, beta):
    inputs = case(gate, beta, T=64, K=16, V=12, seed=1)
    got = run(chunk_kda, *inputs, chunk_size=16)
    for name, a, b in zip(NAMES, got, fp64_token_loop(*inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, gate, beta, rel_err(a, b))
    if gate == "reset":  # a hard reset of a channel: its gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


@pytest.mark.parametrize("gate", ["mild", "strong", "mixed", "reset"])
def test_matches_fla_naive_reference(gate):
    """fla's naive_recurrent_kda (fla-core 0.6.0, fla/ops/kda/naive.py) computes in fp32, takes fla's layout and
    does not L2-normalise: the same recurrence as ours. Outputs, final state and (autograd through fla's loop)
    every gradient within 1e-5 of our fp32 chunked op; our fp64 loop agrees with it too."""
    naive = pytest.importorskip("fla.ops.kda.naive", reason="the test extra installs fla-core")
    inputs = case(gate, T=48, H=3, K=8, V=10, seed=5)

    def fla(q, k, v, g, beta, initial_state, output_final_state):
        return naive.naive_recurrent_kda(q, k, v, g, beta, 0.3, initial_state, output_final_state)

    ref = run(fla, *inputs)
    for name, a, b in zip(NAMES, run(chunk_kda, *inputs, scale=0.3, chunk_size=16), ref):
        assert torch.isfinite(b).all() and rel_err(a, b) <= 1e-5, (name, gate, rel_err(a, b))
    loop = run(naive_recurrent_kda, *(x.double() for x in inputs), scale=0.3)
    for name, a, b in zip(NAMES, loop, ref):
        assert rel_err(a, b) <= 1e-5, (name, gate, rel_err(a, b))


def test_reset_forgets_the_state_exactly():
    """-inf on every channel at token t makes everything from t on independent of the tokens before it and of h0
    (a packed document); -inf on some channels forgets only those rows of the state."""
    q, k, v, g, beta, h0, _, _ = case("mild", T=32, dtype=torch.float64)
    g[:, 16] = float("-inf")
    o, final = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    v2, h2 = v.clone(), 3 * h0
    v2[:, :16] = torch.randn_like(v2[:, :16])
    o2, final2 = chunk_kda(q, k, v2, g, beta, initial_state=h2, output_final_state=True, chunk_size=8)
    assert torch.equal(o[:, 16:], o2[:, 16:]) and torch.equal(final, final2)
    alone, final_alone = chunk_kda(*(x[:, 16:] for x in (q, k, v, g, beta)), output_final_state=True, chunk_size=8)
    torch.testing.assert_close(o[:, 16:], alone, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(final, final_alone, rtol=1e-13, atol=1e-13)
    g = torch.zeros_like(g[:, :1])  # one token, no write (beta 0), channels 0..2 reset: only their rows forget
    g[..., :3] = float("-inf")
    _, S = chunk_kda(q[:, :1], k[:, :1], v[:, :1], g, 0 * beta[:, :1], None, h0, True, chunk_size=1)
    assert torch.equal(S[:, :, :3], torch.zeros_like(S[:, :, :3])) and torch.equal(S[:, :, 3:], h0[:, :, 3:])


def test_transition_is_the_product_of_the_token_matrices():
    """naive_kda_transition against an explicit product of (I - b k k^T) Diag(exp g) in fp64, and the final state
    of the op from h0 == U + M h0 (U the state from zero)."""
    q, k, v, g, beta, h0, _, _ = case("reset", B=1, T=12, H=2, K=5, V=3, dtype=torch.float64, seed=3)
    eye = torch.eye(5, dtype=torch.float64)
    M = eye.expand(1, 2, 5, 5)
    for t in range(12):
        kt = k[:, t]
        step = (eye - beta[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]) @ torch.diag_embed(g[:, t].exp())
        M = step @ M
    torch.testing.assert_close(naive_kda_transition(k, g, beta), M, rtol=1e-13, atol=1e-13)
    _, U = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=4)
    _, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4)
    torch.testing.assert_close(S, U + M @ h0, rtol=1e-12, atol=1e-12)


def test_context_parallel_identity():
    """The module docstring's identity: v' = [v, 0_K] and h0' = [0, I_K] give o' = [o_loc, scale q^T P_t] and
    final state [U, M]: chunk_kda(h0) == o_loc + corr h0, U + M h0 against the fp64 loop, M against the dense
    transition; gradients flow through the augmented call (V + K != K) to every input."""
    q, k, v, g, beta, h0, _, _ = case("reset", T=32, K=8, V=6, dtype=torch.float64, seed=6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    h_aug = torch.cat([torch.zeros(B, H, K, V, dtype=h0.dtype), torch.eye(K, dtype=h0.dtype).expand(B, H, K, K)], -1)
    h_aug.requires_grad_()
    o_aug, s_aug = chunk_kda(q, k, v_aug, g, beta, 0.5, h_aug, True, chunk_size=8)
    o_loc, corr, U, M = o_aug[..., :V], o_aug[..., V:], s_aug[..., :V], s_aug[..., V:]
    o, s = naive_recurrent_kda(q, k, v, g, beta, 0.5, h0, True)
    torch.testing.assert_close(o_loc + torch.einsum("bthk,bhkv->bthv", corr, h0), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(U + M @ h0, s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(M, naive_kda_transition(k, g, beta), rtol=1e-12, atol=1e-12)
    (d_h_aug,) = torch.autograd.grad(o_aug.sum() + s_aug.sum(), h_aug)
    assert d_h_aug.shape == h_aug.shape and torch.isfinite(d_h_aug).all()


def test_gradcheck_tiny():
    q, k, v, g, beta, h0, _, _ = case("reset", B=1, T=8, H=1, K=3, V=2, dtype=torch.float64, seed=7)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, h0)]  # g: -inf entries have no finite differences

    def f(q, k, v, beta, h0):
        return chunk_kda(q, k, v, g, beta, 0.7, h0, True, chunk_size=4)

    assert torch.autograd.gradcheck(f, leaves)
    g_mixed = gates("mixed", (1, 8, 1, 3), torch.Generator().manual_seed(8)).requires_grad_()
    assert torch.autograd.gradcheck(lambda g: chunk_kda(q, k, v, g, beta, 0.7, h0, True, chunk_size=4), g_mixed)


def test_bf16_inputs_are_close_to_fp64():
    inputs = case("mixed", T=32, K=16, V=16, dtype=torch.bfloat16, seed=9)
    got = run(chunk_kda, *inputs, chunk_size=16)
    dtypes = (torch.bfloat16, torch.float32, *(torch.bfloat16,) * 5, torch.float32)
    for name, a, b, dt in zip(NAMES, got, fp64_token_loop(*inputs), dtypes):
        assert a.dtype == dt and rel_err(a, b) <= 2e-2, (name, rel_err(a, b))
    o32, _ = chunk_kda(*inputs[:5], initial_state=inputs[5], chunk_size=16, out_dtype=torch.float32)
    assert o32.dtype == torch.float32 and rel_err(o32, got[0]) <= 1e-2


def test_function_saves_only_its_inputs_and_skips_absent_cotangents():
    q, k, v, g, beta, h0, do, _ = case(T=16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = ChunkKDAFunction.apply(*leaves, None, 8)
    assert {t.data_ptr() for t in o.grad_fn.saved_tensors} == {t.data_ptr() for t in leaves}
    grads = torch.autograd.grad((o * do).sum(), leaves)  # no final-state cotangent
    ref = torch.autograd.grad((naive_recurrent_kda(*leaves[:5], initial_state=leaves[5])[0] * do).sum(), leaves)
    for a, b in zip(grads, ref):
        assert rel_err(a, b) <= 1e-5


def test_bad_shapes_are_refused_in_one_line():
    q, k, v, g, beta, h0, _, _ = case(T=16)
    bad = [
        ((q, k[:, :8], v, g, beta), "q, k must share shape"),
        ((q, k, v[:, :, :1], g, beta), "v must be [B, T, H, V]"),
        ((q, k, v, g[..., 0], beta), "g must be [B, T, H, K]"),
        ((q, k, v, g, beta[:, :8]), "beta must be [B, T, H]"),
    ]
    for args, msg in bad:
        for fn in (chunk_kda, naive_recurrent_kda):
            with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
                fn(*args)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_kda(q, k, v, g, beta, initial_state=h0[..., :2], chunk_size=8)
    assert chunk_kda(q, k, v, g, beta, chunk_size=12)[0].shape == v.shape  # any T: padded (test below)


def test_any_length_equals_the_fp64_token_loop():
    """T = 20 in chunks of 8 and of 64: the op pads with identity tokens (per-channel g = 0, beta = 0, k = 0), the
    outputs, the final state and every gradient equal the loop's in fp64."""
    q, k, v, g, beta, h0, _, _ = case(T=20, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    for chunk in (8, 64):
        o, s = chunk_kda(*leaves[:5], 0.5, leaves[5], True, chunk)
        o_ref, s_ref = naive_recurrent_kda(*leaves[:5], 0.5, leaves[5], True)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad((o * o_ref.detach()).sum() + s.sum(), leaves)
        ref = torch.autograd.grad((o_ref * o_ref.detach()).sum() + s_ref.sum(), leaves)
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
