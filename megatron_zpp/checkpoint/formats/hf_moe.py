"""What the HF mixture-of-experts formats (qwen3_moe.py, mixtral.py) share.

- The attention: Llama's q/k/v/o_proj split out of our fused qkv rows ([q | k | v], each head-major; HF's
  rotate_half pairs (x[i], x[i + d/2]) as our RoPE does), and Qwen3's per-head q_norm / k_norm.
- The routed experts as the hub's files hold them, one tensor per expert and projection, [out, in]:
  `<prefix>.{e}.<gate>.weight` [F, H], `<up>` [F, H], `<down>` [H, F]. transformers 5's save_pretrained writes
  this layout (it reverts its fused 3-D `experts.gate_up_proj` / `down_proj` on the way out) and its
  from_pretrained merges it back; ours are [H, 2F] ([gate | up] columns) and [F, H], x @ W.
- The routing both hold: a softmax router (top-k of the probabilities, renormalised or not), no expert bias, no
  groups, no scaling, no shared expert, dropless (transformers' experts drop no token): `moe_refusals`.
"""

from __future__ import annotations

import torch

from .base import ConversionError, block_refusals, decoder_config


def moe_refusals(cfg, target: str) -> list[str]:
    """Why our model's experts do not fit `target`'s (Qwen3-MoE, Mixtral) sparse block (empty when they do)."""
    m = cfg.model
    if not m.num_experts:
        return [f"it has no experts (--num-experts); {target} is a mixture of experts"]
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    checks = [
        (kinds == {"softmax"}, f"its layers are {'/'.join(sorted(kinds))}; {target} has softmax attention only"),
        (m.normalization == "RMSNorm", f"it uses {m.normalization}; {target} uses RMSNorm"),
        (m.activation == "swiglu", f"its MLP uses {m.activation}; {target}'s experts are SwiGLU"),
        (m.position_embedding_type == "rope", f"its positions are {m.position_embedding_type}; {target} uses RoPE"),
        (m.rotary_percent == 1.0 and not m.rotary_interleaved, f"{target} rotates every head channel in halves"),
        (not (m.add_bias_linear or m.add_qkv_bias), f"it has linear biases; the {target} export holds none"),
        (
            m.moe_router_score_function == "softmax",
            f"its router scores by {m.moe_router_score_function} (--moe-router-score-function); {target}'s by softmax",
        ),
        (not m.moe_router_enable_expert_bias, f"its router has an expert bias; {target}'s has none"),
        (not m.moe_router_num_groups, f"it routes within expert groups (--moe-router-num-groups); {target} does not"),
        (
            m.moe_router_topk_scaling_factor in (None, 1.0),
            f"it scales the routing weights by {m.moe_router_topk_scaling_factor}; {target} does not",
        ),
        (
            not m.moe_shared_expert_intermediate_size,
            f"it has a shared expert (--moe-shared-expert-intermediate-size); {target} has none",
        ),
        (
            m.moe_expert_capacity_factor is None,
            f"its experts drop tokens over capacity (--moe-expert-capacity-factor); {target}'s drop none",
        ),
    ]
    return [why for ok, why in checks if not ok] + block_refusals(cfg, target)


def attention_to_hf(state: dict, m, i: int, qk_norm: bool) -> dict[str, torch.Tensor]:
    """Layer i's attention and norms under HF Llama's names (Qwen3's q/k_norm too with `qk_norm`)."""
    src, dst = f"layers.{i}.", f"model.layers.{i}."
    q_rows, kv_rows = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
    q, k, v = state[src + "mixer.qkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
    out = {
        dst + "self_attn.q_proj.weight": q,
        dst + "self_attn.k_proj.weight": k,
        dst + "self_attn.v_proj.weight": v,
        dst + "self_attn.o_proj.weight": state[src + "mixer.proj.weight"],
        dst + "input_layernorm.weight": state[src + "norm1.weight"],
        dst + "post_attention_layernorm.weight": state[src + "norm2.weight"],
    }
    if qk_norm:
        out[dst + "self_attn.q_norm.weight"] = state[src + "mixer.q_norm.weight"]
        out[dst + "self_attn.k_norm.weight"] = state[src + "mixer.k_norm.weight"]
    return out


def attention_from_hf(hf: dict, i: int, qk_norm: bool) -> dict[str, torch.Tensor]:
    """The inverse of `attention_to_hf`."""
    src, dst = f"model.layers.{i}.self_attn.", f"layers.{i}."
    out = {
        dst + "mixer.qkv.weight": torch.cat([hf[src + f"{p}_proj.weight"] for p in "qkv"]),
        dst + "mixer.proj.weight": hf[src + "o_proj.weight"],
        dst + "norm1.weight": hf[f"model.layers.{i}.input_layernorm.weight"],
        dst + "norm2.weight": hf[f"model.layers.{i}.post_attention_layernorm.weight"],
    }
    if qk_norm:
        out[dst + "mixer.q_norm.weight"] = hf[src + "q_norm.weight"]
        out[dst + "mixer.k_norm.weight"] = hf[src + "k_norm.weight"]
    return out


def experts_to_hf(state: dict, m, i: int, prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """Layer i's routed experts as `<prefix>.{e}.<gate|up|down>.weight` (names: HF's three projection names)."""
    gate, up, down = names
    out = {}
    for e in range(m.num_experts):
        fc1, fc2 = state[f"layers.{i}.mlp.experts.fc1.{e}"], state[f"layers.{i}.mlp.experts.fc2.{e}"]
        g, u = fc1.T.split([m.expert_ffn_size, m.expert_ffn_size], dim=0)
        out.update(
            {f"{prefix}.{e}.{gate}.weight": g, f"{prefix}.{e}.{up}.weight": u, f"{prefix}.{e}.{down}.weight": fc2.T}
        )
    return out


def experts_from_hf(hf: dict, m, i: int, prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The inverse of `experts_to_hf`."""
    gate, up, down = names
    out = {}
    for e in range(m.num_experts):
        at = f"{prefix}.{e}."
        out[f"layers.{i}.mlp.experts.fc1.{e}"] = torch.cat([hf[at + f"{gate}.weight"], hf[at + f"{up}.weight"]]).T
        out[f"layers.{i}.mlp.experts.fc2.{e}"] = hf[at + f"{down}.weight"].T
    return out


def top_level(state: dict, m) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output.weight"]
    return out


def top_level_from(hf: dict, m) -> dict[str, torch.Tensor]:
    out = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["output.weight"] = hf["lm_head.weight"]
    return out


class Reads(dict):
    """A state dict that remembers which names were read (`unread`: the rest, which no HF name holds)."""

    def __init__(self, state: dict):
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, name: str):
        self.read.add(name)
        if name not in self:  # a damaged or partial state: named, not a KeyError's traceback
            raise ConversionError(f"the weights hold no {name}, which the model of their config has")
        return super().__getitem__(name)

    def finished(self, out: dict) -> dict[str, torch.Tensor]:
        """`out` as contiguous fp32 copies, once every tensor read found a name (refused by name otherwise)."""
        if left := sorted(set(self) - self.read):
            raise ConversionError(
                f"no HF name for {', '.join(left[:3])}" + (f" ({len(left)} in all)" if left[3:] else "")
            )
        return {k: v.float().contiguous().clone() for k, v in out.items()}


def taken(hf: dict, out: dict) -> dict[str, torch.Tensor]:
    """Our tensors `out` read from `hf` (a Reads), refused by name when `hf` holds a tensor not read."""
    if isinstance(hf, Reads) and (left := sorted(set(hf) - hf.read)):
        raise ConversionError(f"tensors this model does not have: {', '.join(left[:3])}")
    return {k: v.float().contiguous() for k, v in out.items()}


def config_json(cfg, vocab: int, architecture: str, model_type: str) -> dict:
    """The config.json keys both formats write alike (the decoder's; fp32 weights)."""
    m = cfg.model
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "num_experts_per_tok": m.moe_router_topk,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
        "output_router_logits": False,
        "attention_dropout": 0.0,
        "initializer_range": m.init_method_std,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def rope_theta(hf: dict) -> float:
    """RoPE's base from config.json (transformers 5's rope_parameters, or the older rope_theta); refuses scaling."""
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConversionError(f"rope_parameters {rope!r} is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" or hf.get("rope_scaling"):
        raise ConversionError(f"it scales RoPE (rope_type {kind!r}); plain RoPE only is imported")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def moe_config_from(hf: dict, experts, expert_width: int, pattern: list[int]):
    """Our Config of a HF MoE decoder (the keys both formats read alike): softmax attention, RMSNorm, SwiGLU,
    RoPE, no biases; `pattern`: one 1 (MoE) or 0 (dense) per layer."""
    why = [
        w
        for w, bad in [
            (f"hidden_act {hf.get('hidden_act')!r} is not silu (SwiGLU)", hf.get("hidden_act", "silu") != "silu"),
            ("it has attention biases", bool(hf.get("attention_bias"))),
            (f"num_experts {experts!r} is not a positive integer", not (isinstance(experts, int) and experts > 0)),
            (
                f"sliding_window {hf.get('sliding_window')}: attention over a window is not built here",
                hf.get("sliding_window") is not None and hf.get("use_sliding_window", True),
            ),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    cfg = decoder_config(hf)
    m = cfg.model
    m.norm_epsilon, m.rotary_base = hf.get("rms_norm_eps", 1e-6), rope_theta(hf)
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
    m.normalization, m.activation, m.attention_type = "RMSNorm", "swiglu", "softmax"
    m.position_embedding_type, m.add_bias_linear = "rope", False
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = experts, expert_width, hf["num_experts_per_tok"]
    m.moe_layer_freq = "1" if all(pattern) else str(pattern)
    m.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.0))
    return cfg
