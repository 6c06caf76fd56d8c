"""The Kimi Delta Attention layer against transformers' KimiLinearDeltaAttention on the same weights (its torch
fallback, CPU) and a token-by-token fp64 reference of the whole layer (convolution with document resets, the
per-channel delta rule, norm, gate); the TP split of its parameters."""

import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import ParallelContext, init_weights
from megatron_zpp.model.documents import Documents
from megatron_zpp.model.init import RankInit, materialize
from megatron_zpp.model.kda import KimiDeltaAttention
from megatron_zpp.pipeline_parallel import build_rank_chunks, stand_in_context
from megatron_zpp.tensor_parallel.layers import unshard
from tests.model import assert_matches_with_grads
from tests.old_defaults import old_model

HIDDEN, HEADS = 32, 2


def _layer(dtype=torch.float64, chunk=8) -> KimiDeltaAttention:
    cfg = old_model(hidden_size=HIDDEN, num_attention_heads=HEADS, linear_chunk_size=chunk, norm_epsilon=1e-5)
    layer = KimiDeltaAttention(cfg, ParallelContext(), out_std=0.02)
    init_weights(layer, seed=3)
    layer = layer.to(dtype)
    with torch.no_grad():  # other values than the init's, so that every parameter matters
        layer.head_norm.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.uniform_(-1, 1)
        for p in (layer.gate_down, layer.decay_up, layer.gate_up):
            p.normal_(0, 0.3)
    return layer


def transformers_copy(layer: KimiDeltaAttention) -> KimiLinearDeltaAttention:
    """Their layer holding our weights: proj_in's q | k | v | b rows, gate_down's f_a | g_a rows."""
    D, H = layer.head_dim, layer.heads
    cfg = KimiLinearConfig(
        hidden_size=HIDDEN, linear_num_heads=H, linear_head_dim=D, num_hidden_layers=1, rms_norm_eps=layer.eps
    )
    theirs = KimiLinearDeltaAttention(cfg, 0).to(layer.conv.dtype)
    q, k, v, b = layer.proj_in.weight.split([H * D] * 3 + [H])
    f_a, g_a = layer.gate_down.split(D)
    with torch.no_grad():
        for mod, w in ((theirs.q_proj, q), (theirs.k_proj, k), (theirs.v_proj, v), (theirs.b_proj, b)):
            mod.weight.copy_(w)
        theirs.conv1d.weight.copy_(layer.conv[:, None, :])
        theirs.forget_gate.f_a_proj.weight.copy_(f_a)
        theirs.forget_gate.f_b_proj.weight.copy_(layer.decay_up)
        theirs.forget_gate.dt_bias.copy_(layer.dt_bias)
        theirs.forget_gate.A_log.copy_(layer.A_log.view(1, 1, H, 1))
        theirs.g_a_proj.weight.copy_(g_a)
        theirs.g_b_proj.weight.copy_(layer.gate_up)
        theirs.o_norm.weight.copy_(layer.head_norm)
        theirs.o_proj.weight.copy_(layer.proj_out.weight)
    return theirs


def test_kda_layer_matches_transformers_kimi_linear_delta_attention():
    """Ours in fp64 against theirs (their torch path computes in fp32): the output, the input's and every
    parameter's gradient (mapped back to ours) within 1e-5 relative (norm-wise), but the decay's A_log and
    dt_bias within 1e-4 (4.2e-5 and 9.7e-6 measured): their chunked form takes the pair decays as differences of
    fp32 cumulative sums, and those two gradients sum over every token and channel (ours in fp32 is 2e-8 and 4e-7
    from fp64 on them)."""
    torch.manual_seed(0)
    ours = _layer(torch.float32, chunk=16)
    theirs, ours = transformers_copy(ours), ours.double()
    x, do = torch.randn(2, 37, HIDDEN), torch.randn(2, 37, HIDDEN)  # 37: a multiple of neither chunk (16, 64)
    xa, xb = x.double().requires_grad_(), x.clone().requires_grad_()
    out, ref = ours(xa), theirs(xb)
    (out * do.double()).sum().backward()
    (ref * do).sum().backward()
    H = ours.heads
    f = theirs.forget_gate
    mapped = {
        "proj_in.weight": torch.cat(
            [m.weight.grad for m in (theirs.q_proj, theirs.k_proj, theirs.v_proj, theirs.b_proj)]
        ),
        "gate_down": torch.cat([f.f_a_proj.weight.grad, theirs.g_a_proj.weight.grad]),
        "decay_up": f.f_b_proj.weight.grad,
        "gate_up": theirs.g_b_proj.weight.grad,
        "conv": theirs.conv1d.weight.grad[:, 0],
        "A_log": f.A_log.grad.view(H),
        "dt_bias": f.dt_bias.grad,
        "head_norm": theirs.o_norm.weight.grad,
        "proj_out.weight": theirs.o_proj.weight.grad,
    }
    assert set(mapped) == {n for n, _ in ours.named_parameters()}
    pairs = [("output", out, ref), ("input grad", xa.grad, xb.grad)]
    for name, got, want in pairs + [(n, p.grad, mapped[n]) for n, p in ours.named_parameters()]:
        err = ((got - want.double()).norm() / want.double().norm()).item()
        assert err <= (1e-4 if name in ("A_log", "dt_bias") else 1e-5), f"{name}: relative error {err:.1e}"


def token_loop_kda(layer: KimiDeltaAttention, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    H, D = layer.heads, layer.head_dim
    qkv, b = (x @ layer.proj_in.weight.T).split([3 * H * D, H], dim=-1)
    f_a, g_a = (x @ layer.gate_down.T).split(D, dim=-1)
    out = torch.zeros_like(qkv)
    kernel = layer.conv.shape[1]
    for t in range(T):  # the conv: taps over earlier tokens of the same document only
        for j in range(kernel):
            s = t - j
            if s >= 0 and bool((doc[:, s] == doc[:, t]).all()):
                out[:, t] += qkv[:, s] * layer.conv[:, kernel - 1 - j]
    q, k, v = (t.view(B, T, H, D) for t in F.silu(out).split(H * D, dim=-1))
    q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    f = (f_a @ layer.decay_up.T + layer.dt_bias).view(B, T, H, D)
    decay = (-layer.A_log.exp()[:, None] * torch.log1p(f.exp())).exp()  # [B, T, H, D] per channel
    beta = b.sigmoid()
    S = torch.zeros(B, H, D, D, dtype=x.dtype)
    outs = []
    for t in range(T):
        if t > 0 and bool((doc[:, t] != doc[:, t - 1]).all()):
            S = torch.zeros_like(S)
        kt, bt = k[:, t], beta[:, t, :, None, None]
        P = torch.eye(D, dtype=x.dtype) - bt * kt[..., :, None] * kt[..., None, :]
        S = P @ (decay[:, t, :, :, None] * S) + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * D**-0.5)
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.head_norm
    gate = (g_a @ layer.gate_up.T).view(B, T, H, D).sigmoid()
    return (o * gate).reshape(B, T, H * D) @ layer.proj_out.weight.T


def test_kda_layer_matches_token_loop():
    layer = _layer()
    T = 21  # not a multiple of the chunk: the padded tail
    doc = torch.tensor([[0] * 10 + [1] * 9 + [2] * 2])
    x = torch.randn(1, T, HIDDEN, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x, documents=Documents(doc_ids=doc)), token_loop_kda(layer, x, doc)
    assert_matches_with_grads(layer, x, out, ref, (1e-9, 1e-11), (1e-8, 1e-11))


def test_tp2_weights_are_slices_of_the_tp1_weights():
    """Every parameter of a KDA hybrid built for TP rank 0 and 1 of TP2 reassembles to the TP1 model's: the
    head-split ones by heads (dt_bias per channel, A_log per head), the down-projections and norm replicated."""
    flags = "--mock-data --attention-type kda --softmax-attention-every 2 --num-layers 2 --hidden-size 32"
    flags += " --num-attention-heads 4 --vocab-size 64 --make-vocab-size-divisible-by 1"

    def weights(tp, tp_rank):
        cfg = parse_args([*flags.split(), "--tensor-model-parallel-size", str(tp)])
        chunks = build_rank_chunks(cfg, 64, 0, stand_in_context(cfg, tp_rank))
        materialize(chunks, RankInit(chunks, 9, tp_rank, tp, torch.device("cpu")))
        return dict(chunks[0].named_parameters())

    full, pieces = weights(1, 0), [weights(2, r) for r in range(2)]
    conv = full["layers.0.mixer.conv"]
    assert 0.4 < conv.abs().max() <= 0.5 and abs(conv.mean()) < 0.1  # U(+-1/2): nn.Conv1d's for 4 taps
    for name, p in full.items():
        if p.tp_split is None:  # replicated: each rank holds the whole
            assert all(torch.equal(r[name], p) for r in pieces), name
        else:
            assert torch.equal(unshard([r[name] for r in pieces], p.tp_split), p), name
    assert torch.equal(pieces[1]["layers.0.mixer.A_log"], full["layers.0.mixer.A_log"][2:])
    assert torch.equal(pieces[1]["layers.0.mixer.dt_bias"], full["layers.0.mixer.dt_bias"][16:])
    assert (
        pieces[0]["layers.0.mixer.gate_down"].tp_partial_grad and pieces[0]["layers.0.mixer.head_norm"].tp_partial_grad
    )
