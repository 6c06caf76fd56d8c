"""A whole model step on the Triton kernels (interpreter) equals the torch references: a tiny hybrid GPT
(GLA and softmax layers: norms, RoPE, SwiGLU, GLA chunks, cross-entropy), loss and every gradient, fp32."""

import torch

from megatron_zpp.config import ModelConfig
from megatron_zpp.model import GPT, init_weights
from megatron_zpp.ops import dispatch
from tests.old_defaults import old_model


def loss_and_grads(mode: str, cfg: ModelConfig, tokens, labels):
    dispatch.set_kernels(mode, torch.device("cpu"))
    try:
        model = GPT(cfg, 64)
        init_weights(model, seed=3)
        loss = model(tokens, labels).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    finally:
        dispatch.set_kernels("auto", torch.device("cpu"))


def test_hybrid_gpt_step_on_triton_kernels_equals_torch():
    cfg = old_model(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=64,
        attention_type="gla", softmax_attention_every=2, linear_chunk_size=16,
    )  # fmt: skip
    data = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    tokens, labels = data[:, :-1], data[:, 1:]
    loss_t, grads_t = loss_and_grads("torch", cfg, tokens, labels)
    loss_k, grads_k = loss_and_grads("triton", cfg, tokens, labels)
    assert torch.allclose(loss_k, loss_t, rtol=1e-6, atol=0), (loss_k, loss_t)
    for name, g in grads_t.items():
        err = ((grads_k[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{name}: relative gradient difference {err:.1e}"
