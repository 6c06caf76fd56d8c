"""The Gated DeltaNet layer against a token-by-token fp64 reference of the whole layer
(convolution with document resets, the delta-rule recurrence, norm, gate)."""

import math

import torch
import torch.nn.functional as F

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.model import ParallelContext, init_weights
from megatron_zpp.model.documents import Documents
from megatron_zpp.model.gated_deltanet import GatedDeltaNet
from megatron_zpp.model.init import RankInit, materialize
from megatron_zpp.pipeline_parallel import build_rank_chunks, stand_in_context
from megatron_zpp.tensor_parallel.layers import unshard
from tests.model import assert_matches_with_grads
from tests.old_defaults import old_model


def token_loop_gdn(layer: GatedDeltaNet, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    H, D = layer.heads, layer.head_dim
    h = x @ layer.proj_in.weight.T
    qkv, gate, a, b = h.split([3 * H * D, H * D, H, H], dim=-1)
    out = torch.zeros_like(qkv)
    kernel = layer.conv.shape[1]
    for t in range(T):  # the conv: taps over earlier tokens of the same document only
        for j in range(kernel):
            s = t - j
            if s >= 0 and bool((doc[:, s] == doc[:, t]).all()):
                out[:, t] += qkv[:, s] * layer.conv[:, kernel - 1 - j]
    q, k, v = (t.view(B, T, H, D) for t in F.silu(out).split(H * D, dim=-1))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    decay = (-layer.A_log.exp() * F.softplus(a + layer.dt_bias)).exp()
    beta = b.sigmoid()
    S = torch.zeros(B, H, D, D, dtype=x.dtype)
    eye = torch.eye(D, dtype=x.dtype)
    outs = []
    for t in range(T):
        if t > 0 and bool((doc[:, t] != doc[:, t - 1]).all()):
            S = torch.zeros_like(S)
        kt, bt = k[:, t], beta[:, t, :, None, None]
        P = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = decay[:, t, :, None, None] * (P @ S) + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * D**-0.5)
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.head_norm.view(H, D)
    return (o.reshape(B, T, H * D) * F.silu(gate)) @ layer.proj_out.weight.T


def test_gdn_layer_matches_token_loop():
    cfg = old_model(hidden_size=32, num_attention_heads=2, linear_chunk_size=8)
    layer = GatedDeltaNet(cfg, ParallelContext(), out_std=0.02)
    init_weights(layer, seed=3)
    layer = layer.double()
    with torch.no_grad():  # other values than the init's, so that every parameter matters
        layer.head_norm.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.uniform_(-1, 1)
        layer.conv.normal_(0, 0.5)
    T = 21  # not a multiple of the chunk: the padded tail
    doc = torch.tensor([[0] * 10 + [1] * 9 + [2] * 2])
    x = torch.randn(1, T, 32, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x, documents=Documents(doc_ids=doc)), token_loop_gdn(layer, x, doc)
    assert_matches_with_grads(layer, x, out, ref, (1e-9, 1e-11), (1e-8, 1e-11))


def test_gate_init_draws_megatrons_A_range_and_flas_dt():
    """A = exp(A_log) ~ U(1, 16) (megatron-core's A_init_range) and softplus(dt_bias) = dt with
    log dt ~ U(log 1e-3, log 0.1) (fla's GatedDeltaNet), over 4096 heads; seeded by name."""
    heads = 4096
    with torch.device("meta"):  # shapes only: the projections of 4096 heads are not allocated
        layer = GatedDeltaNet(old_model(hidden_size=2 * heads, num_attention_heads=heads), ParallelContext(), 0.02)

    def drawn(seed):
        init = RankInit([layer], seed, 0, 1, torch.device("cpu"))
        out = {}
        for name in ("A_log", "dt_bias"):
            out[name] = torch.empty(heads)
            init.fill(getattr(layer, name), out[name])
        return out

    got = drawn(seed=5)
    A = got["A_log"].double().exp()
    assert 1 <= A.min() < 1.05 and 15.95 < A.max() <= 16 and abs(A.mean().item() - 8.5) < 0.3  # sd of mean 0.07
    assert abs((A < 4.75).double().mean().item() - 0.25) < 0.03  # uniform: a quarter below the first quartile
    log_dt = F.softplus(got["dt_bias"].double()).log()  # the forward's softplus undoes the init's inverse
    lo, hi = math.log(1e-3), math.log(0.1)
    assert lo - 1e-5 <= log_dt.min() < lo + 0.05 and hi - 0.05 < log_dt.max() <= hi + 1e-5
    assert abs(log_dt.mean().item() - (lo + hi) / 2) < 0.1  # log-uniform (sd of the mean 0.02)
    assert abs((log_dt < lo + (hi - lo) / 4).double().mean().item() - 0.25) < 0.03
    again, other = drawn(seed=5), drawn(seed=6)
    assert all(torch.equal(got[n], again[n]) and not torch.equal(got[n], other[n]) for n in got)
    assert not torch.equal(got["A_log"], got["dt_bias"])  # each parameter has its own generator


def test_tp2_weights_are_slices_of_the_tp1_weights():
    """Every parameter of a GDN hybrid built for TP rank 0 and 1 of TP2 reassembles to the TP1 model's,
    and the per-head gate parameters are the TP1 heads' halves."""
    flags = "--mock-data --attention-type gdn --softmax-attention-every 2 --num-layers 2 --hidden-size 32"
    flags += " --num-attention-heads 4 --vocab-size 64 --make-vocab-size-divisible-by 1"

    def weights(tp, tp_rank):
        cfg = parse_args([*flags.split(), "--tensor-model-parallel-size", str(tp)])
        chunks = build_rank_chunks(cfg, 64, 0, stand_in_context(cfg, tp_rank))
        materialize(chunks, RankInit(chunks, 9, tp_rank, tp, torch.device("cpu")))
        return dict(chunks[0].named_parameters())

    full, pieces = weights(1, 0), [weights(2, r) for r in range(2)]
    assert full["layers.0.mixer.A_log"].abs().min() > 0  # the gate init is drawn, not zeros
    for name, p in full.items():
        if p.tp_split is None:  # replicated: each rank holds the whole
            assert all(torch.equal(r[name], p) for r in pieces), name
        else:
            assert torch.equal(unshard([r[name] for r in pieces], p.tp_split), p), name
    for name in ("layers.0.mixer.A_log", "layers.0.mixer.dt_bias"):
        assert torch.equal(pieces[1][name], full[name][2:]) and torch.equal(pieces[0][name], full[name][:2])
