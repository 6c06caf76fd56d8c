"""A megatron_zpp GLA / hybrid causal LM in plain PyTorch (transformers remote code).

Written by megatron_zpp's tools/convert_checkpoint.py --to hf next to the weights and loaded with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. It imports only torch and
transformers, and computes what megatron_zpp's single-rank GPT computes (logits within fp32 rounding):

    embed_tokens -> [x + mixer(norm(x)), x + mlp(norm(x))] x L -> norm -> lm_head (tied: embed_tokens)

The mixer of a "linear_attention" layer is gated linear attention (GLA, Yang et al. 2024) with a
per-key data-dependent decay, no positional encoding (the decay orders tokens):

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(d),   g = logsigmoid(gate logits) / normalizer

then a per-head RMSNorm, a SiLU output gate and the output projection. It runs in chunks of
`gla_chunk_size` tokens with exact pairwise decays inside a chunk (all exponents <= 0: nothing
overflows) and the fp32 state carried between chunks; a one-token step is a chunk of one. The
mixer of a "full_attention" layer is causal softmax attention with grouped-query heads and RoPE
rotating the pairs (x[i], x[i + d/2]). The MLP is SwiGLU (silu(gate) * up) or tanh-GeLU.

With linear_attention_type "gdn" a "linear_attention" layer is Gated DeltaNet (Yang et al. 2025) instead:
q, k, v through a short causal depthwise convolution and SiLU, q and k L2-normalised, then

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d)
    log a_t = -exp(A_log) softplus(x W_a + dt_bias),   b_t = sigmoid(x W_b)

token by token in fp32, then the per-head RMSNorm, SiLU output gate and output projection.

With linear_attention_type "kda" it is Kimi Delta Attention (Kimi Linear): the same convolution, q and k through
fla's l2norm (x / sqrt(sum x^2 + 1e-6)), and a per-channel decay from low-rank projections,

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,   log a_t = -exp(A_log) softplus(x W_fa W_fb + dt_bias)

then RMSNorm over each head's channels (one shared weight) times sigmoid(x W_ga W_gb), and the output projection.

Generation keeps transformers' DynamicCache (built from config.layer_types): a recurrent state per
linear layer (a GDN layer's holds its fp32 state and the convolution's last kernel-1 inputs, packed
into one [B, n] tensor), keys and values per softmax layer. Padded batches are not supported (an attention_mask
with zeros is refused): the model was trained on unpadded packed sequences.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megatron_zpp_gla import MegatronZppGLAConfig

# transformers 5 names the cache `cache` in model outputs; 4.x named it `past_key_values`
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class MegatronZppRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class MegatronZppLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class MegatronZppHeadRMSNorm(nn.Module):
    """RMSNorm over each head's d channels of a [B, T, H, d] tensor, one weight per channel of every head (heads = 1:
    one [d] weight every head shares); with `layer_norm`, a LayerNorm with a bias of the weight's shape."""

    def __init__(self, heads: int, head_dim: int, eps: float, layer_norm: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(heads * head_dim)) if layer_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return F.rms_norm(x.float(), (self.head_dim,), eps=self.eps) * self.weight.float().view(self.heads, -1)
        x = F.layer_norm(x.float(), (self.head_dim,), eps=self.eps)
        return x * self.weight.float().view(self.heads, -1) + self.bias.float().view(self.heads, -1)


def build_norm(config: MegatronZppGLAConfig) -> nn.Module:
    norm = MegatronZppRMSNorm if config.normalization == "RMSNorm" else MegatronZppLayerNorm
    return norm(config.hidden_size, config.norm_eps)


def rope_tables(head_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] (fp32) of integer positions [B, T]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d] rotated by the tables [B, T, d] (pairs (x[i], x[i + d/2]))."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotated * sin


def gla_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor | None, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLA over [B, T, H, d] fp32 inputs from `state` [B, H, d, d] (None: zeros), chunk by chunk.

    Inside a chunk, with b = cumsum(g) from its start and S the state entering it:
        o_i = (sum_{j<=i} (q_i * k_j * exp(b_i - b_j)) v_j + (q_i * exp(b_i)) S) / sqrt(d)
        S_out = exp(b_last) S + sum_j (k_j * exp(b_last - b_j))^T v_j
    Returns (o [B, T, H, d], the final state)."""
    B, T, H, K = q.shape
    scale = K**-0.5
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))  # [B, H, T, d]
    S = q.new_zeros(B, H, K, v.shape[-1]) if state is None else state.float()
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outs = []
    for start in range(0, T, chunk):
        qc, kc, vc, gc = (t[:, :, start : start + chunk] for t in (q, k, v, g))
        c = qc.shape[2]
        b = gc.cumsum(dim=2)
        decay = (b[:, :, :, None, :] - b[:, :, None, :, :]).masked_fill(~causal[:c, :c, None], float("-inf")).exp()
        scores = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, decay)
        outs.append((scores @ vc + (qc * b.exp()) @ S) * scale)
        last = b[:, :, -1:]
        S = last.transpose(2, 3).exp() * S + (kc * (last - b).exp()).transpose(2, 3) @ vc
    return torch.cat(outs, dim=2).transpose(1, 2), S


def _recurrent_cache_layer(cache, layer_idx: int):
    """The cache's layer `layer_idx`, checked to hold a recurrent state (transformers' linear-attention layer)."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if not (hasattr(layer, "recurrent_states") and hasattr(cache, "update_recurrent_state")):
        raise ValueError(
            f"GLA/GDN layer {layer_idx} needs a cache built from the model's layer types: "
            "DynamicCache(config=model.config) (transformers >= 5), or use_cache=False"
        )
    return layer


class MegatronZppGatedLinearAttention(nn.Module):
    def __init__(self, config: MegatronZppGLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.heads, self.head_dim = layer_idx, config.num_attention_heads, config.head_dim
        self.chunk, self.normalizer, self.low_rank = (
            config.gla_chunk_size,
            config.gla_gate_normalizer,
            config.gla_gate_low_rank,
        )
        width, hidden = self.heads * self.head_dim, config.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.g_proj = nn.Linear(hidden, width, bias=False)  # the SiLU output gate
        if self.low_rank:  # the decay gate's logits: x W_down W_up + b
            self.gk_down = nn.Linear(hidden, self.low_rank, bias=False)
            self.gk_up = nn.Linear(self.low_rank, width, bias=True)
        else:
            self.gk_proj = nn.Linear(hidden, width, bias=False)
        self.g_norm = MegatronZppHeadRMSNorm(self.heads, self.head_dim, config.norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v, gate = (
            p(x).view(B, T, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj, self.g_proj)
        )
        logits = self.gk_up(self.gk_down(x)) if self.low_rank else self.gk_proj(x)
        g = F.logsigmoid(logits.float()).view(B, T, self.heads, self.head_dim) / self.normalizer
        layer = _recurrent_cache_layer(cache, self.layer_idx) if cache is not None else None
        state = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
        o, state = gla_chunked(q.float(), k.float(), v.float(), g, state, self.chunk)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        o = self.g_norm(o).to(x.dtype) * F.silu(gate)
        return self.o_proj(o.reshape(B, T, -1))


class MegatronZppCausalConv(nn.Module):
    """A depthwise causal convolution's weight [channels, kernel]: the last column multiplies the current token."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, kernel))


def _conv_from_cache(mixer: nn.Module, qkv: torch.Tensor, cache, state_shape: tuple[int, ...]):
    """A delta-rule mixer's (GDN's, KDA's) entering state [B, *state_shape] fp32 and its short convolution's
    SiLU output over qkv [B, T, C]: the cache holds the state and the convolution's last kernel-1 inputs, packed
    (zeros without a cache or before its first update). Returns (state, silu(conv), the inputs with those before)."""
    (B, T, C), lead = qkv.shape, mixer.kernel - 1
    layer = _recurrent_cache_layer(cache, mixer.layer_idx) if cache is not None else None
    packed = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
    size = math.prod(state_shape)
    if packed is None:
        state, history = qkv.new_zeros(B, *state_shape, dtype=torch.float32), qkv.new_zeros(B, lead, C)
    else:
        state = packed[:, :size].view(B, *state_shape).clone()
        history = packed[:, size:].view(B, lead, -1).to(qkv.dtype)
    ext = torch.cat([history, qkv], dim=1)  # the kernel-1 inputs before these tokens, then theirs
    weight = torch.cat([mixer.q_conv.weight, mixer.k_conv.weight, mixer.v_conv.weight])  # [channels, kernel]
    conv = sum(ext[:, j : j + T] * weight[:, j] for j in range(mixer.kernel))
    return state, F.silu(conv), ext


def _save_to_cache(mixer: nn.Module, cache, state: torch.Tensor, ext: torch.Tensor) -> None:
    """The state and the convolution's last kernel-1 inputs, packed into the cache (as _conv_from_cache reads)."""
    if cache is None:
        return
    B, lead = state.shape[0], mixer.kernel - 1
    tail = ext[:, -lead:].float().reshape(B, -1) if lead else ext.new_zeros(B, 0, dtype=torch.float32)
    cache.update_recurrent_state(torch.cat([state.reshape(B, -1), tail], dim=1), mixer.layer_idx)


def _delta_rule(q, k, v, g, beta, state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token from state [B, H, K, V]: (o [B, T, H, V], the last state). g [B, T, H]
    (a decay per head: GDN) or [B, T, H, K] (per channel: KDA) applies first, then S - b k (k^T S) + b k v^T: a
    -inf gate resets exactly."""
    outs = []
    for t in range(q.shape[1]):
        a = g[:, t].exp()
        state = (a[..., None] if a.dim() == 3 else a[..., None, None]) * state
        kt = k[:, t]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, state))
        state = state + kt[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state) * scale)
    return torch.stack(outs, dim=1), state


class MegatronZppGatedDeltaNet(nn.Module):
    """Gated DeltaNet with megatron-core's / Qwen3-Next's heads: Hk query/key heads of K channels, H value heads of V
    (value head j reads key head j // (H / Hk)); q, k L2-normalised as fla's l2norm (eps 1e-6 on the sum of
    squares); the output RMSNorm's weight one [V] for every head (or one per head's channel: gdn_head_norm), a
    LayerNorm with a bias with gdn_out_norm layernorm (megatron-core's out_norm under --normalization LayerNorm)."""

    def __init__(self, config: MegatronZppGLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.kernel, self.eps = layer_idx, config.linear_conv_kernel, config.norm_eps
        self.key_heads, self.heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        qk, width, hidden, heads = (
            self.key_heads * self.key_dim,
            self.heads * self.head_dim,
            config.hidden_size,
            self.heads,
        )
        self.q_proj, self.k_proj = nn.Linear(hidden, qk, bias=False), nn.Linear(hidden, qk, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.g_proj = nn.Linear(hidden, width, bias=False)  # the SiLU output gate
        self.a_proj, self.b_proj = nn.Linear(hidden, heads, bias=False), nn.Linear(hidden, heads, bias=False)
        self.q_conv, self.k_conv = MegatronZppCausalConv(qk, self.kernel), MegatronZppCausalConv(qk, self.kernel)
        self.v_conv = MegatronZppCausalConv(width, self.kernel)
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(heads)), nn.Parameter(torch.zeros(heads))
        shared = config.gdn_head_norm == "shared"
        layer_norm = getattr(config, "gdn_out_norm", "rmsnorm") == "layernorm"
        self.o_norm = MegatronZppHeadRMSNorm(1 if shared else self.heads, self.head_dim, config.norm_eps, layer_norm)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        Hk, H, K, V = self.key_heads, self.heads, self.key_dim, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        state, conv, ext = _conv_from_cache(self, qkv, cache, (H, K, V))
        q, k, v = conv.float().split([Hk * K, Hk * K, H * V], dim=-1)
        q, k = (t.view(B, T, Hk, K) for t in (q, k))
        q, k = (t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
        q, k, v = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2), v.view(B, T, H, V)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = self.b_proj(x).float().sigmoid()
        o, state = _delta_rule(q, k, v, g, beta, state, K**-0.5)
        _save_to_cache(self, cache, state, ext)
        o = self.o_norm(o) * F.silu(self.g_proj(x).float()).view(B, T, H, V)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))


class MegatronZppKimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi Linear's KimiLinearDeltaAttention, its parameter names): GDN with a per-channel
    decay from a low-rank projection (f_a, f_b), a per-channel dt_bias, a low-rank sigmoid output gate (g_a, g_b)
    and one [d] norm weight shared by the heads."""

    def __init__(self, config: MegatronZppGLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.heads, self.head_dim = layer_idx, config.num_attention_heads, config.head_dim
        self.kernel, self.eps = config.linear_conv_kernel, config.norm_eps
        width, hidden, heads, d = self.heads * self.head_dim, config.hidden_size, self.heads, self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.f_a_proj, self.f_b_proj = nn.Linear(hidden, d, bias=False), nn.Linear(d, width, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(hidden, d, bias=False), nn.Linear(d, width, bias=False)
        self.q_conv, self.k_conv, self.v_conv = (MegatronZppCausalConv(width, self.kernel) for _ in range(3))
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(heads)), nn.Parameter(torch.zeros(width))
        self.o_norm = MegatronZppRMSNorm(d, config.norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        state, conv, ext = _conv_from_cache(self, qkv, cache, (H, D, D))
        q, k, v = (t.view(B, T, H, D).float() for t in conv.split(H * D, dim=-1))
        q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(f.view(B, T, H, D))  # [B, T, H, D]: per channel
        beta = self.b_proj(x).float().sigmoid()
        o, state = _delta_rule(q, k, v, g, beta, state, D**-0.5)
        _save_to_cache(self, cache, state, ext)
        gate = self.g_b_proj(self.g_a_proj(x)).float().sigmoid().view(B, T, H, D)
        o = self.o_norm(o).float() * gate
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))


class MegatronZppAttention(nn.Module):
    def __init__(self, config: MegatronZppGLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.heads, self.head_dim), *rope).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim), *rope).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads  # query head i reads key/value head i // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        L = k.shape[2]  # the new tokens are the last T of the L keys
        mask = torch.arange(L, device=x.device)[None, :] <= torch.arange(L - T, L, device=x.device)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MegatronZppMLP(nn.Module):
    def __init__(self, config: MegatronZppGLAConfig):
        super().__init__()
        self.swiglu, self.gelu_approximate = config.activation == "swiglu", config.gelu_approximate
        hidden, ffn = config.hidden_size, config.intermediate_size
        if self.swiglu:
            self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.gelu_approximate))


class MegatronZppDecoderLayer(nn.Module):
    def __init__(self, config: MegatronZppGLAConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        self.input_layernorm = build_norm(config)
        if self.kind == "linear_attention":
            kinds = {"gdn": MegatronZppGatedDeltaNet, "kda": MegatronZppKimiDeltaAttention}
            self.attn = kinds.get(config.linear_attention_type, MegatronZppGatedLinearAttention)(config, layer_idx)
        else:
            self.self_attn = MegatronZppAttention(config, layer_idx)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = MegatronZppMLP(config)

    def forward(self, x: torch.Tensor, rope, cache=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.attn(h, cache) if self.kind == "linear_attention" else self.self_attn(h, rope, cache))
        return x + self.mlp(self.post_attention_layernorm(x))


class MegatronZppGLAPreTrainedModel(PreTrainedModel):
    config_class = MegatronZppGLAConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegatronZppDecoderLayer"]
    supports_gradient_checkpointing = False


class MegatronZppGLAModel(MegatronZppGLAPreTrainedModel):
    def __init__(self, config: MegatronZppGLAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MegatronZppDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported (the attention_mask has zeros): pass unpadded sequences")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = None
        if "full_attention" in self.config.layer_types:  # GLA layers use no positions
            if position_ids is None:
                # a softmax layer's KV cache counts the tokens seen; a GLA layer's recurrent state does not
                first_softmax = self.config.layer_types.index("full_attention")
                past = cache.get_seq_length(first_softmax) if cache is not None else 0
                position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None]
            rope = rope_tables(self.config.head_dim, position_ids.expand(x.shape[0], -1), self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, rope, cache if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{CACHE_FIELD: cache if use_cache else None})


class MegatronZppGLAForCausalLM(MegatronZppGLAPreTrainedModel, GenerationMixin):
    def __init__(self, config: MegatronZppGLAConfig):
        super().__init__(config)
        self.model = MegatronZppGLAModel(config)
        if not config.tie_word_embeddings:  # tied: the logits read the embedding rows
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return getattr(self, "lm_head", None)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(h, weight)
        loss = None
        if labels is not None:  # next-token loss: position t predicts labels[t + 1]
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})


__all__ = ["MegatronZppGLAForCausalLM", "MegatronZppGLAModel", "MegatronZppGLAPreTrainedModel"]
