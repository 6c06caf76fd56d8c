"""The peers' side of bench/zero.py: `PeerGPT`, a plain-PyTorch model of our GPT's Llama-like
configuration (pre-norm RMSNorm, RoPE rotating (x[i], x[i+d/2]), causal SDPA, SwiGLU, tied
embeddings, no biases) built from separate nn.Linear modules, loaded with OUR initialized weights
(megatron_zpp.model.init_weights of the same seed; fused qkv = [q;k;v] and fc1 = [gate;up] split),
fed the token stream of megatron_zpp.data.mock.MockGPTDataset in our sample order, trained with
AdamW of our hyperparameters (no decay on 1-D weights), our LR schedule and clipping.
bench/single_rank.py checks that it gives our loss and gradients."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_zpp.config import ModelConfig


class PeerAttention(nn.Module):
    def __init__(self, h: int, heads: int, seq: int, base: float):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        inv_freq = 1.0 / base ** (torch.arange(0, self.d, 2).float() / self.d)
        angles = torch.arange(seq).float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x):  # x [B, heads, T, d]
        T, half = x.shape[2], self.d // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:T].to(x.dtype) + rotated * self.sin[:T].to(x.dtype)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.heads, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class PeerMLP(nn.Module):
    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(h, ffn, False), nn.Linear(h, ffn, False), nn.Linear(ffn, h, False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PeerBlock(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.ln_1 = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.attn = PeerAttention(c.hidden_size, c.num_attention_heads, c.seq_length, c.rotary_base)
        self.ln_2 = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.mlp = PeerMLP(c.hidden_size, c.ffn_size)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PeerGPT(nn.Module):
    def __init__(self, c: ModelConfig, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, c.hidden_size)
        self.h = nn.ModuleList(PeerBlock(c) for _ in range(c.num_layers))
        self.ln_f = nn.RMSNorm(c.hidden_size, eps=c.norm_epsilon)
        self.lm_head = nn.Linear(c.hidden_size, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))


def to_peer_names(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our parameter names/layouts -> the peer's (fused weights split in order); for weights or grads."""
    out = {"wte.weight": sd["embedding.weight"], "ln_f.weight": sd["final_norm.weight"]}
    for i in range(num_layers):
        p = f"layers.{i}."
        q, k, v = sd[p + "mixer.qkv.weight"].chunk(3, dim=0)
        gate, up = sd[p + "mlp.fc1.weight"].chunk(2, dim=0)
        out.update(
            {
                f"h.{i}.ln_1.weight": sd[p + "norm1.weight"],
                f"h.{i}.ln_2.weight": sd[p + "norm2.weight"],
                f"h.{i}.attn.q.weight": q,
                f"h.{i}.attn.k.weight": k,
                f"h.{i}.attn.v.weight": v,
                f"h.{i}.attn.o.weight": sd[p + "mixer.proj.weight"],
                f"h.{i}.mlp.gate.weight": gate,
                f"h.{i}.mlp.up.weight": up,
                f"h.{i}.mlp.down.weight": sd[p + "mlp.fc2.weight"],
            }
        )
    return out


def parse_model_args(argv: list[str]):
    """Our Config from the same flags pretrain_gpt.py gets (ZeRO flags left out)."""
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.validation import validate

    return validate(parse_args(argv), int(os.environ.get("WORLD_SIZE", 1)))


# The one block the peers implement, as the flags every system of bench/zero.py gets (Llama-like,
# not Megatron's defaults): RoPE, no linear biases, SwiGLU, RMSNorm, no dropout, tied embeddings.
LLAMA_FLAGS = (
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--hidden-dropout 0 --attention-dropout 0"
).split()

# ModelConfig fields -> the value PeerGPT implements (ours may be configured otherwise; the peers not)
PEER_SHAPE = {
    "attention_type": "softmax",
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "apply_layernorm_1p": False,
    "untie_embeddings_and_output_weights": False,
    "group_query_attention": False,
    "kv_channels": None,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


def peer_shape_mismatch(m) -> str | None:
    """Why PeerGPT cannot be the model of ModelConfig `m` (every field that differs), or None."""
    wrong = [f"{k}={getattr(m, k)!r} (the peers: {v!r})" for k, v in PEER_SHAPE.items() if getattr(m, k) != v]
    return "the peers implement a Llama-like block only: " + ", ".join(wrong) if wrong else None


def build_peer_model(cfg):
    """PeerGPT holding exactly the weights our pretrain_gpt.py starts from; refuses (SystemExit, one
    line) a config it does not implement, and checks that every parameter of ours has its
    counterpart: the same names mapped, the same parameter count."""
    import torch

    from megatron_zpp.data.tokenizer import pad_vocab_size
    from megatron_zpp.model import GPT, count_parameters, init_weights

    m = cfg.model
    why = peer_shape_mismatch(m)
    if why:
        raise SystemExit(f"error: {why}")
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    ours = GPT(m, vocab)
    init_weights(ours, cfg.train.seed)
    peer = PeerGPT(m, vocab)
    missing, unexpected = peer.load_state_dict(to_peer_names(ours.state_dict(), m.num_layers), strict=False)
    peer_count = sum(p.numel() for p in peer.parameters())  # lm_head is wte: counted once
    if set(missing) != {"lm_head.weight"} or unexpected or peer_count != count_parameters(ours):
        raise SystemExit(
            f"error: the peer's model is not ours: {count_parameters(ours)} parameters vs the peer's {peer_count}, "
            f"missing {sorted(set(missing) - {'lm_head.weight'})}, unexpected {sorted(unexpected)}"
        )
    del ours
    return peer.to(torch.bfloat16 if cfg.train.bf16 else torch.float32), vocab


class PeerBatches:
    """This rank's micro-batches in our order (megatron_zpp.data.loader): a global batch of
    G is taken in rounds of micro x DP; in each round DP rank d takes the d-th micro-batch."""

    def __init__(self, cfg, rank: int, world: int):
        from megatron_zpp.data.mock import MockGPTDataset

        t = cfg.train
        self.data = MockGPTDataset(
            t.train_iters * t.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size, t.seed
        )
        self.mbs, self.rank, self.world, self.G = t.micro_batch_size, rank, world, t.global_batch_size
        self.num_micro = t.global_batch_size // (t.micro_batch_size * world)

    def micro_batch(self, step: int, k: int):
        import numpy as np
        import torch

        first = step * self.G + k * self.mbs * self.world + self.rank * self.mbs
        data = torch.from_numpy(np.stack([self.data[i] for i in range(first, first + self.mbs)]))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def adamw_param_groups(model, cfg) -> list[dict]:
    """Our MixedPrecisionAdamW's groups: weight decay on >= 2-D weights only."""
    params = list(model.parameters())  # a tied weight is listed once
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw_kwargs(cfg) -> dict:
    o = cfg.optim
    return {"lr": o.lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps}


def lr_at(cfg, iteration: int) -> float:
    from megatron_zpp.optim.schedules import learning_rate

    return learning_rate(cfg.optim, iteration, cfg.train.train_iters, cfg.train.global_batch_size)
