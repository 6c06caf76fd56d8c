"""The delta-rule ops' PyTorch forms, one harness for both families (ops/delta_rule.py's DeltaRuleOp): Gated
DeltaNet (megatron_zpp.ops.gdn, a decay per head) and Kimi Delta Attention (megatron_zpp.ops.kda, a decay per key
channel). The chunked WY/UT form and its hand-written backward against the fp64 token loop (autograd through it),
fla's naive references (independent transcriptions of each recurrence), an explicit product of K x K matrices,
and the context-parallel identity ops/delta_rule.py states. tests/kernels/test_delta_rule.py reuses `MIXERS`,
`case` and `run` for the Triton kernels."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.ops.gdn import ChunkGDNFunction, chunk_gdn
from megatron_zpp.ops.gdn_naive import naive_recurrent_gdn
from megatron_zpp.ops.kda import ChunkKDAFunction, chunk_kda
from megatron_zpp.ops.kda_naive import naive_kda_transition, naive_recurrent_kda

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@dataclass(frozen=True)
class Mixer:
    op: Callable  # chunk_<family>
    loop: Callable  # the fp64 token loop
    function: type  # the autograd Function
    per_channel: bool  # g [B, T, H, K] (KDA) or [B, T, H] (GDN)
    fla: tuple[str, Callable]  # fla's naive module and a call of its loop in our argument order
    g_shape: str  # the shape the refusal names


MIXERS = {
    "gdn": Mixer(
        chunk_gdn,
        naive_recurrent_gdn,
        ChunkGDNFunction,
        False,
        (
            "fla.ops.gated_delta_rule.naive",
            lambda m, q, k, v, g, b, *rest: m.naive_recurrent_gated_delta_rule(
                q,
                k,
                v,
                b,
                g,
                *rest,  # beta before g
            ),
        ),
        "[B, T, H]",
    ),
    "kda": Mixer(
        chunk_kda,
        naive_recurrent_kda,
        ChunkKDAFunction,
        True,
        ("fla.ops.kda.naive", lambda m, *a: m.naive_recurrent_kda(*a)),
        "[B, T, H, K]",
    ),
}
mixers = pytest.mark.parametrize("mixer", list(MIXERS))


def gates(kind, shape, gen):
    """Log decays, per head [B, T, H] or per channel [B, T, H, K]: mild (a near 1), strong (a near 0: down to -40 per
    token), mixed, or reset (mixed with some -inf entries and every one -inf at one token: a packed document's
    start). Per channel, mixed makes 30% of the channels strong (one rate per channel side by side in a head)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if kind == "mild":
        return -0.05 * u
    if kind == "strong":
        return -40.0 * u**2 - 5.0
    g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    per_channel = len(shape) == 4
    if per_channel:
        g = torch.where(torch.rand(shape[-1:], generator=gen, dtype=torch.float64) < 0.3, -30.0 * u - 3.0, g)
    if kind == "mixed":
        return g if per_channel else torch.where(u < 0.3, -30.0 * u, g)
    g = g.masked_fill(u < (0.05 if per_channel else 0.08), float("-inf"))
    g[:, shape[1] // 3] = float("-inf")  # a packed document's first token
    return g


def betas(kind, shape, gen):
    """beta in (0, 1): near 0, near 1, or mixed over the whole range."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return {"low": 1e-3 * (u + 0.01), "high": 1 - 1e-3 * (u + 0.01), "mixed": u.clamp(1e-3, 1 - 1e-3)}[kind]


def case(mixer, gate="mixed", beta="mixed", B=2, T=32, H=2, K=8, V=6, dtype=torch.float32, seed=0):
    """(q, k (L2-normalised, as the layer gives), v, g, beta in dtype; h0, do, dS in fp32 or fp64), no grad."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g_shape = (B, T, H, K) if MIXERS[mixer].per_channel else (B, T, H)
    v, g, b = r(B, T, H, V), gates(gate, g_shape, gen), betas(beta, (B, T, H), gen)
    state_dt = torch.float64 if dtype == torch.float64 else torch.float32
    h0, do, dS = r(B, H, K, V).to(state_dt), r(B, T, H, V).to(dtype), r(B, H, K, V).to(state_dt)
    return *(x.to(dtype) for x in (q, k, v, g, b)), h0, do, dS


def run(fn, q, k, v, g, beta, h0, do, dS, **kw):
    """o, final state and the gradients of <o, do> + <final, dS> w.r.t. q, k, v, g, beta, h0."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    grads = torch.autograd.grad((o * do).sum() + (final * dS).sum(), leaves)
    return [o.detach(), final.detach(), *grads]


def fp64_token_loop(mixer, *inputs):
    return run(MIXERS[mixer].loop, *(x.double() for x in inputs))


def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref|| in fp64."""
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@mixers
@pytest.mark.parametrize("chunk_size", [1, 4, 12, 16, 32])  # 12: KDA pads a chunk to a power of two inside
@pytest.mark.parametrize("gate", ["mild", "mixed", "reset"])
def test_chunk_matches_the_token_loop_fp64(mixer, chunk_size, gate):
    inputs = case(mixer, gate, dtype=torch.float64, seed=chunk_size)
    got = run(MIXERS[mixer].op, *inputs, chunk_size=chunk_size)
    for name, a, b in zip(NAMES, got, fp64_token_loop(mixer, *inputs)):
        assert a.dtype == torch.float64 and rel_err(a, b) <= 1e-12, (name, rel_err(a, b))


@mixers
@pytest.mark.parametrize("gate", ["mild", "reset"])
def test_any_length_pads_the_last_chunk_with_identity_tokens(mixer, gate):
    """T = 100 at chunk 64 (one full chunk and 36 tokens): output, final state and every gradient equal the token
    loop's over the 100 tokens (fp64), as do T = 5 at chunk 64 (a partial chunk only) and K != V."""
    for T, K, V in ((100, 8, 6), (5, 4, 10)):
        inputs = case(mixer, gate, dtype=torch.float64, T=T, K=K, V=V, seed=T)
        got = run(MIXERS[mixer].op, *inputs, chunk_size=64)
        assert got[0].shape == (2, T, 2, V)
        for name, a, b in zip(NAMES, got, fp64_token_loop(mixer, *inputs)):
            assert rel_err(a, b) <= 1e-12, (name, T, rel_err(a, b))


@mixers
@pytest.mark.parametrize("gate", ["mild", "strong", "mixed", "reset"])
@pytest.mark.parametrize("beta", ["low", "high", "mixed"])
def test_chunk_fp32_matches_the_fp64_token_loop(mixer, gate, beta):
    inputs = case(mixer, gate, beta, T=64, K=16, V=12, seed=1)
    got = run(MIXERS[mixer].op, *inputs, chunk_size=16)
    for name, a, b in zip(NAMES, got, fp64_token_loop(mixer, *inputs)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-5, (name, gate, beta, rel_err(a, b))
    if gate == "reset":  # a hard reset: the gate's gradient is exactly 0 there
        assert (got[5][torch.isneginf(inputs[3])] == 0).all()


@mixers
@pytest.mark.parametrize("gate", ["mild", "strong", "mixed", "reset"])
def test_matches_fla_naive_reference(mixer, gate):
    """fla's naive loops (fla-core 0.6.0: naive_recurrent_gated_delta_rule, beta before g; naive_recurrent_kda)
    compute in fp32, take fla's layout and do not L2-normalise: the same recurrences as ours. Outputs, final state
    and (autograd through fla's loop) every gradient within 1e-5 of our fp32 chunked op; our fp64 loop agrees too."""
    module, call = MIXERS[mixer].fla
    naive = pytest.importorskip(module, reason="the test extra installs fla-core")
    inputs = case(mixer, gate, T=48, H=3, K=8, V=10, seed=5)

    def fla(q, k, v, g, beta, initial_state, output_final_state):
        return call(naive, q, k, v, g, beta, 0.3, initial_state, output_final_state)

    ref = run(fla, *inputs)
    for name, a, b in zip(NAMES, run(MIXERS[mixer].op, *inputs, scale=0.3, chunk_size=16), ref):
        assert torch.isfinite(b).all() and rel_err(a, b) <= 1e-5, (name, gate, rel_err(a, b))
    loop = run(MIXERS[mixer].loop, *(x.double() for x in inputs), scale=0.3)
    for name, a, b in zip(NAMES, loop, ref):
        assert rel_err(a, b) <= 1e-5, (name, gate, rel_err(a, b))


@mixers
def test_reset_forgets_the_state_exactly(mixer):
    """A -inf gate (every channel's, for KDA) at token t makes everything from t on independent of the tokens
    before it and of h0 (a packed document); KDA's -inf on some channels forgets only those rows of the state."""
    op = MIXERS[mixer].op
    q, k, v, g, beta, h0, _, _ = case(mixer, "mild", T=32, dtype=torch.float64)
    g[:, 16] = float("-inf")
    o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8)
    v2, h2 = v.clone(), 3 * h0
    v2[:, :16] = torch.randn_like(v2[:, :16])
    o2, final2 = op(q, k, v2, g, beta, initial_state=h2, output_final_state=True, chunk_size=8)
    assert torch.equal(o[:, 16:], o2[:, 16:]) and torch.equal(final, final2)
    alone, final_alone = op(*(x[:, 16:] for x in (q, k, v, g, beta)), output_final_state=True, chunk_size=8)
    torch.testing.assert_close(o[:, 16:], alone, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(final, final_alone, rtol=1e-13, atol=1e-13)
    if MIXERS[mixer].per_channel:  # one token, no write (beta 0), channels 0..2 reset: only their rows forget
        g = torch.zeros_like(g[:, :1])
        g[..., :3] = float("-inf")
        _, S = op(q[:, :1], k[:, :1], v[:, :1], g, 0 * beta[:, :1], None, h0, True, chunk_size=1)
        assert torch.equal(S[:, :, :3], torch.zeros_like(S[:, :, :3])) and torch.equal(S[:, :, 3:], h0[:, :, 3:])


def explicit_transition(k, g, beta):
    """The product of the tokens' K x K matrices (I - b k k^T) Diag(exp g) in fp64 (GDN's scalar decay on every
    channel): M [B, H, K, K], the map of the entering state."""
    B, T, H, K = k.shape
    g = g if g.dim() == 4 else g[..., None].expand(B, T, H, K)
    eye = torch.eye(K, dtype=torch.float64)
    M = eye.expand(B, H, K, K)
    for t in range(T):
        kt = k[:, t]
        step = (eye - beta[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]) @ torch.diag_embed(g[:, t].exp())
        M = step @ M
    return M


@mixers
def test_transition_is_the_product_of_the_token_matrices(mixer):
    """The op's final state from h0 == U + M h0 (U the state from zero, M the explicit product); KDA's
    naive_kda_transition equals that product too."""
    op = MIXERS[mixer].op
    q, k, v, g, beta, h0, _, _ = case(mixer, "reset", B=1, T=12, H=2, K=5, V=3, dtype=torch.float64, seed=3)
    M = explicit_transition(k, g, beta)
    if mixer == "kda":
        torch.testing.assert_close(naive_kda_transition(k, g, beta), M, rtol=1e-13, atol=1e-13)
    _, U = op(q, k, v, g, beta, output_final_state=True, chunk_size=4)
    _, S = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4)
    torch.testing.assert_close(S, U + M @ h0, rtol=1e-12, atol=1e-12)


@mixers
def test_context_parallel_identity(mixer):
    """ops/delta_rule.py's identity: v' = [v, 0_K] and h0' = [0, I_K] give o' = [o_loc, scale q^T P_t] and final
    state [U, M], the affine map of the entering state: op(h0) == o_loc + corr h0, U + M h0 against the fp64 loop,
    M against the explicit product; the same in two calls of widths V and K (the kernels' width limit at
    K = V = 128); gradients flow through the augmented call (V + K != K) to every input."""
    op, loop = MIXERS[mixer].op, MIXERS[mixer].loop
    q, k, v, g, beta, h0, _, _ = case(mixer, "reset", T=32, K=8, V=6, dtype=torch.float64, seed=6)
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    h_aug = torch.cat([torch.zeros(B, H, K, V, dtype=h0.dtype), torch.eye(K, dtype=h0.dtype).expand(B, H, K, K)], -1)
    h_aug.requires_grad_()
    o_aug, s_aug = op(q, k, v_aug, g, beta, 0.5, h_aug, True, chunk_size=8)
    o_loc, corr, U, M = o_aug[..., :V], o_aug[..., V:], s_aug[..., :V], s_aug[..., V:]
    o, s = loop(q, k, v, g, beta, 0.5, h0, True)
    torch.testing.assert_close(o_loc + torch.einsum("bthk,bhkv->bthv", corr, h0), o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(U + M @ h0, s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(M, explicit_transition(k, g, beta), rtol=1e-12, atol=1e-12)
    o_v, s_v = op(q, k, v, g, beta, 0.5, None, True, chunk_size=8)
    o_k, s_k = op(q, k, v.new_zeros(B, T, H, K), g, beta, 0.5, h_aug[..., V:], True, chunk_size=8)
    for a, b in ((o_v, o_loc), (s_v, U), (o_k, corr), (s_k, M)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (d_h_aug,) = torch.autograd.grad(o_aug.sum() + s_aug.sum(), h_aug)
    assert d_h_aug.shape == h_aug.shape and torch.isfinite(d_h_aug).all()


@mixers
def test_gradcheck_tiny(mixer):
    op = MIXERS[mixer].op
    q, k, v, g, beta, h0, _, _ = case(mixer, "reset", B=1, T=8, H=1, K=3, V=2, dtype=torch.float64, seed=7)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, h0)]  # g: -inf entries have no finite differences

    def f(q, k, v, beta, h0):
        return op(q, k, v, g, beta, 0.7, h0, True, chunk_size=4)

    assert torch.autograd.gradcheck(f, leaves)
    # a finite g: GDN's mild, KDA's mixed (strong and weak channels side by side)
    shape, kind = ((1, 8, 1, 3), "mixed") if MIXERS[mixer].per_channel else ((1, 8, 1), "mild")
    g_finite = gates(kind, shape, torch.Generator().manual_seed(8)).requires_grad_()
    assert torch.autograd.gradcheck(lambda g: op(q, k, v, g, beta, 0.7, h0, True, chunk_size=4), g_finite)


@mixers
def test_bf16_inputs_are_close_to_fp64(mixer):
    op = MIXERS[mixer].op
    inputs = case(mixer, "mixed", T=32, K=16, V=16, dtype=torch.bfloat16, seed=9)
    got = run(op, *inputs, chunk_size=16)
    dtypes = (torch.bfloat16, torch.float32, *(torch.bfloat16,) * 5, torch.float32)
    for name, a, b, dt in zip(NAMES, got, fp64_token_loop(mixer, *inputs), dtypes):
        assert a.dtype == dt and rel_err(a, b) <= 2e-2, (name, rel_err(a, b))
    o32, _ = op(*inputs[:5], initial_state=inputs[5], chunk_size=16, out_dtype=torch.float32)
    assert o32.dtype == torch.float32 and rel_err(o32, got[0]) <= 1e-2


@mixers
def test_function_saves_only_its_inputs_and_skips_absent_cotangents(mixer):
    q, k, v, g, beta, h0, do, _ = case(mixer, T=16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = MIXERS[mixer].function.apply(*leaves, None, 8)
    assert {t.data_ptr() for t in o.grad_fn.saved_tensors} == {t.data_ptr() for t in leaves}
    grads = torch.autograd.grad((o * do).sum(), leaves)  # no final-state cotangent
    ref = torch.autograd.grad((MIXERS[mixer].loop(*leaves[:5], initial_state=leaves[5])[0] * do).sum(), leaves)
    for a, b in zip(grads, ref):
        assert rel_err(a, b) <= 1e-5


@mixers
def test_bad_shapes_are_refused_in_one_line(mixer):
    m = MIXERS[mixer]
    q, k, v, g, beta, h0, _, _ = case(mixer, T=16)
    bad = [
        ((q, k[:, :8], v, g, beta), "q, k must share shape"),
        ((q, k, v[:, :, :1], g, beta), "v must be [B, T, H, V]"),
        ((q, k, v, g[..., 0] if m.per_channel else g[..., None], beta), f"g must be {m.g_shape}"),
        ((q, k, v, g, beta[:, :8]), "beta must be [B, T, H]"),
    ]
    for args, msg in bad:
        for fn in (m.op, m.loop):
            with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
                fn(*args)
    with pytest.raises(ValueError, match="initial_state must be"):
        m.op(q, k, v, g, beta, initial_state=h0[..., :2], chunk_size=8)
    with pytest.raises(ValueError, match="multiple of chunk_size=0"):
        m.op(q, k, v, g, beta, chunk_size=0)
    assert m.op(q, k, v, g, beta, chunk_size=12)[0].shape == v.shape  # any T: padded (test above)
