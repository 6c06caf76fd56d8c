"""The GLA layer against a token-by-token reference, with the full-rank and the GLA
paper's low-rank decay gate (fp64, one rank)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_zpp.model import ParallelContext, init_weights
from megatron_zpp.model.linear_attention import GatedLinearAttention
from tests.model import assert_matches_with_grads
from tests.old_defaults import old_model


def token_loop_gla(layer: GatedLinearAttention, x: torch.Tensor, low_rank: int) -> torch.Tensor:
    """The layer's math written out from its weights, with the recurrence
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = q_t S_t / sqrt(K) run token by token."""
    B, T, _ = x.shape
    H, D = layer.heads, layer.head_dim
    W = layer.proj_in.weight.split(H * D, dim=0)
    q, k, v, gate = (x @ w.T for w in W[:4])
    logits = x @ W[4].T if not low_rank else (x @ layer.gate_down.T) @ layer.gate_up.T + layer.gate_bias
    g = F.logsigmoid(logits) / layer.normalizer
    q, k, v, g = (t.view(B, T, H, D) for t in (q, k, v, g))
    S = torch.zeros(B, H, D, D, dtype=x.dtype)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * D**-0.5)
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.head_norm.view(H, D)
    return (o.reshape(B, T, H * D) * F.silu(gate)) @ layer.proj_out.weight.T


@pytest.mark.parametrize("low_rank", [0, 4])
def test_gla_layer_matches_token_loop(low_rank):
    cfg = old_model(hidden_size=32, num_attention_heads=2, linear_chunk_size=8, gla_gate_low_rank=low_rank)
    layer = GatedLinearAttention(cfg, ParallelContext(), out_std=0.02)
    init_weights(layer, seed=3)
    layer = layer.double()
    with torch.no_grad():  # the init leaves biases at zero and norms at one: make them matter
        layer.head_norm.uniform_(0.5, 1.5)
        if low_rank:
            layer.gate_bias.uniform_(-2, 2)
    x = torch.randn(2, 24, 32, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x), token_loop_gla(layer, x, low_rank)
    assert_matches_with_grads(layer, x, out, ref, (1e-10, 1e-12), (1e-9, 1e-12))


def test_low_rank_gate_parameters():
    cfg = old_model(hidden_size=32, num_attention_heads=2, gla_gate_low_rank=4)
    tp = type("FakeTP", (), {"rank": 0, "size": 2})()
    layer = GatedLinearAttention(cfg, ParallelContext(tp=tp), out_std=0.02)
    assert layer.proj_in.weight.shape == (4 * 32 // 2, 32)  # q, k, v, output gate; no decay-gate section
    assert layer.gate_down.shape == (4, 32) and layer.gate_down.tp_split is None
    assert layer.gate_down.tp_partial_grad  # each TP rank backpropagates its heads only
    assert layer.gate_up.shape == (16, 4) and layer.gate_up.tp_split == (0, (32,))
    full = GatedLinearAttention(old_model(hidden_size=32, num_attention_heads=2), ParallelContext(), 0.02)
    assert full.proj_in.weight.shape == (5 * 32, 32) and not hasattr(full, "gate_down")
