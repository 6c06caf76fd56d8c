"""Megatron's GPT defaults, which this project takes: learned absolute positions, linear biases, --add-qkv-bias,
--apply-layernorm-1p, --position-embedding-type none and dropout on the embedding output, each
against a reference written out here (fp64, one loop over the layers)."""

import math

import pytest
import torch

from megatron_zpp.config import ModelConfig
from megatron_zpp.model import GPT, describe_block, init_weights
from megatron_zpp.model.documents import Documents

VOCAB, SEQ = 64, 12


def megatron_gpt(**kw) -> ModelConfig:
    """Megatron's defaults: LayerNorm, gelu, learned absolute positions, biases (dropout off here)."""
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=SEQ, max_position_embeddings=20)
    return ModelConfig(**{**base, "hidden_dropout": 0.0, "attention_dropout": 0.0, **kw})


def build(cfg: ModelConfig, seed: int = 0, perturb: bool = True) -> GPT:
    """fp64; `perturb`: every parameter moved off its init (biases and 1p weights start at 0)."""
    model = GPT(cfg, VOCAB)
    init_weights(model, seed)
    model = model.double()
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def reference_logits(cfg: ModelConfig, w: dict, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """GPT-2 as Megatron builds it, from the formulas (fp64; our norms compute in fp32, hence the
    tolerance): x = E[t] + P[pos]; per layer
    x += proj(attn(LN1(x))) and x += fc2(gelu(fc1(LN2(x)))); logits = LN_f(x) E^T."""
    H, n = cfg.hidden_size, cfg.num_attention_heads
    d = H // n
    one = 1.0 if cfg.apply_layernorm_1p else 0.0

    def norm(x, prefix):
        g = w[prefix + ".weight"] + one
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.norm_epsilon) * g + w[prefix + ".bias"]

    def linear(x, prefix):
        y = x @ w[prefix + ".weight"].T
        return y + w[prefix + ".bias"] if prefix + ".bias" in w else y

    x = w["embedding.weight"][tokens]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + w["position_embeddings.weight"][positions]
    B, T = tokens.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        q, k, v = linear(norm(x, p + "norm1"), p + "mixer.qkv").split(H, dim=-1)
        q, k, v = (t.view(B, T, n, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H)
        x = x + linear(o, p + "mixer.proj")
        h = linear(norm(x, p + "norm2"), p + "mlp.fc1")
        if cfg.add_bias_linear:  # Megatron's fused bias-gelu (tanh); without biases its F.gelu (erf)
            h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        else:
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        x = x + linear(h, p + "mlp.fc2")
    return norm(x, "final_norm") @ w["embedding.weight"].T


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(apply_layernorm_1p=True), dict(add_bias_linear=False, add_qkv_bias=True)],
    ids=["defaults", "layernorm_1p", "qkv_bias_only"],
)
def test_forward_matches_reference(kw):
    cfg = megatron_gpt(**kw)
    model = build(cfg)
    w = {n: p.detach() for n, p in model.named_parameters()}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    expect = reference_logits(cfg, w, tokens, torch.arange(SEQ))
    torch.testing.assert_close(model(tokens=tokens), expect, rtol=1e-5, atol=1e-6)
    # packed documents with --reset-position-ids: the positions restart at each document
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    expect = reference_logits(cfg, w, tokens, positions)
    torch.testing.assert_close(model(tokens=tokens, documents=Documents(positions)), expect, rtol=1e-5, atol=1e-6)


def test_which_parameters_exist_and_their_init():
    names = lambda cfg: {n for n, _ in GPT(cfg, VOCAB).named_parameters()}  # noqa: E731
    linear = ["mixer.qkv", "mixer.proj", "mlp.fc1", "mlp.fc2"]
    full = names(megatron_gpt())
    assert "position_embeddings.weight" in full and "output.bias" not in full
    assert all(f"layers.{i}.{m}.bias" in full for i in range(2) for m in linear)
    qkv_only = names(megatron_gpt(add_bias_linear=False, add_qkv_bias=True))
    assert {n for n in qkv_only if n.endswith(".bias") and ".norm" not in n and "final" not in n} == {
        "layers.0.mixer.qkv.bias",
        "layers.1.mixer.qkv.bias",
    }
    bare = names(megatron_gpt(add_bias_linear=False, position_embedding_type="none"))
    assert not any("position" in n or ("mixer" in n or "mlp" in n) and n.endswith(".bias") for n in bare)

    model = build(megatron_gpt(apply_layernorm_1p=True, max_position_embeddings=400, hidden_size=64), perturb=False)
    p = dict(model.named_parameters())
    assert p["position_embeddings.weight"].shape == (400, 64)
    assert abs(p["position_embeddings.weight"].std().item() - 0.02) < 0.001  # Megatron: normal(init std)
    assert torch.all(p["layers.0.mixer.qkv.bias"] == 0) and torch.all(p["layers.1.mlp.fc2.bias"] == 0)
    assert torch.all(p["layers.0.norm1.weight"] == 0) and torch.all(p["final_norm.weight"] == 0)  # applied as 1 + 0
    # the start-up log names the block, so a Megatron script's model is visible at run time
    assert describe_block(megatron_gpt()) == "LayerNorm, gelu, learned absolute positions, linear biases"
    assert describe_block(megatron_gpt(position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=True)) == (
        "LayerNorm, gelu, RoPE, qkv bias only"
    )


def test_layernorm_1p_rmsnorm_is_one_plus_w():
    """--apply-layernorm-1p with RMSNorm (Megatron's Llama-3 scripts pass both): scale by 1 + w."""
    kw = dict(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=32, position_embedding_type="rope")
    one_plus, plain = build(megatron_gpt(apply_layernorm_1p=True, **kw)), build(megatron_gpt(**kw))
    with torch.no_grad():
        for (name, a), (_, b) in zip(one_plus.named_parameters(), plain.named_parameters()):
            b.copy_(a + 1 if "norm" in name else a)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(one_plus(tokens=tokens), plain(tokens=tokens), rtol=1e-6, atol=1e-7)


def test_none_has_no_positions():
    """none: no position information at all, so a run of one repeated token gives the same output at
    every position (the attention averages identical values); learned positions make them differ."""
    tokens = torch.full((1, SEQ), 7)
    for kind, same in [("none", True), ("learned_absolute", False)]:
        logits = build(megatron_gpt(position_embedding_type=kind))(tokens=tokens)[0]
        assert torch.allclose(logits, logits[:1].expand_as(logits)) == same, kind


def test_hidden_dropout_on_embedding_output():
    """Megatron applies --hidden-dropout to the embedding output (before the first layer)."""
    model = build(megatron_gpt(hidden_dropout=0.5), perturb=False)
    seen = []
    model.layers["0"].norm1.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    model.eval()(tokens=tokens)
    model.train()(tokens=tokens)
    clean, dropped = seen
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])


@pytest.mark.parametrize(
    "bias, fusion, openai, tanh",
    [(True, True, False, True), (True, False, False, False), (False, True, False, False), (False, True, True, True)],
)
def test_gelu_form_follows_megatrons_flags(bias, fusion, openai, tanh):
    """Megatron's MLP: with biases and --bias-gelu-fusion (its defaults) the fused bias-gelu, the tanh
    form; --no-bias-gelu-fusion or no biases (arguments.py turns the fusion off then) plain F.gelu,
    exact erf; --openai-gelu the tanh form always."""
    from megatron_zpp.model.context import ParallelContext
    from megatron_zpp.model.mlp import MLP

    cfg = megatron_gpt(add_bias_linear=bias, bias_gelu_fusion=fusion, openai_gelu=openai)
    mlp = MLP(cfg, ParallelContext(), 0.02).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    h = x @ mlp.fc1.weight.T + (mlp.fc1.bias if bias else 0)
    erf = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    tanh_form = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    want = (tanh_form if tanh else erf) @ mlp.fc2.weight.T + (mlp.fc2.bias if bias else 0)
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(tanh_form, erf, atol=1e-6)  # the two forms differ at these inputs


def test_squared_relu_mlp_is_relu_squared():
    from megatron_zpp.model.context import ParallelContext
    from megatron_zpp.model.mlp import MLP

    cfg = megatron_gpt(activation="squared_relu")
    mlp = MLP(cfg, ParallelContext(), 0.02).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    h = x @ mlp.fc1.weight.T + mlp.fc1.bias
    want = torch.where(h > 0, h * h, torch.zeros_like(h)) @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_partial_rope_rotates_the_first_channels_of_each_head():
    """--rotary-percent 0.5, as Megatron: each q/k head's first d/2 channels rotate as pairs (i, i + d/4)
    at frequencies base^(-2i / (d/2)); the other half passes; then causal softmax attention (fp64 here).
    Rotating the whole head instead moves the output by 1.7 here."""
    from megatron_zpp.model.attention import SelfAttention
    from megatron_zpp.model.context import ParallelContext
    from megatron_zpp.model.rope import rope_tables

    cfg = megatron_gpt(position_embedding_type="rope", rotary_percent=0.5, num_attention_heads=2, hidden_size=16)
    attn = SelfAttention(cfg, ParallelContext(), 0.02).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(5))
    B, T, H, d, r = 2, 6, 2, 8, 4
    x = torch.randn(B, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    out = attn(x, rope_tables(cfg.rotary_dim, torch.arange(T), cfg.rotary_base))
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k, v = (t.reshape(B, T, H, d) for t in qkv.split(H * d, dim=-1))
    angle = torch.arange(T, dtype=torch.float64)[:, None] * cfg.rotary_base ** (-torch.arange(0, r, 2) / r)

    def rotate(t):  # pairs (i, i + r/2) of the first r channels
        a, b, rest = t[..., : r // 2], t[..., r // 2 : r], t[..., r:]
        c, s = angle.cos()[None, :, None], angle.sin()[None, :, None]
        return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, H * d)
    # the cos/sin tables are fp32 (as in training): round-off of fp32, not of fp64
    torch.testing.assert_close(out, o @ attn.proj.weight.T + attn.proj.bias, rtol=1e-5, atol=1e-6)
