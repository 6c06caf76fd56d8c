"""The Gated DeltaNet layer against a token-by-token fp64 reference of the whole layer
(convolution with document resets, the delta-rule recurrence, norm, gate)."""

import torch
import torch.nn.functional as F

from megatron_zpp.model import ParallelContext, init_weights
from megatron_zpp.model.documents import Documents
from megatron_zpp.model.gated_deltanet import GatedDeltaNet
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
    cfg = old_model(hidden_size=32, num_attention_heads=2, gla_chunk_size=8)
    layer = GatedDeltaNet(cfg, ParallelContext(), out_std=0.02)
    init_weights(layer, seed=3)
    layer = layer.double()
    with torch.no_grad():  # the init leaves these at zero/one: make them matter
        layer.head_norm.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.uniform_(-1, 1)
        layer.conv.normal_(0, 0.5)
    T = 21  # not a multiple of the chunk: the padded tail
    doc = torch.tensor([[0] * 10 + [1] * 9 + [2] * 2])
    x = torch.randn(1, T, 32, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x, documents=Documents(doc_ids=doc)), token_loop_gdn(layer, x, doc)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)
