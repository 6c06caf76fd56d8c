"""HF Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers' own class: no remote code).

Qwen3's attention (Llama's, with an RMSNorm over each query and key head: our --qk-layernorm) and a sparse MLP
in the layers config.json's `decoder_sparse_step` / `mlp_only_layers` make sparse (layer i when i is not in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the others a dense MLP of `intermediate_size`). Its
router takes the softmax over all experts, then the top-k, renormalised when `norm_topk_prob`: our softmax
router without --moe-router-pre-softmax (top-k of the logits, softmax over the k: the same numbers), or with it
when not renormalised. The experts (`moe_intermediate_size`) are written one per expert as the hub's files hold
them (formats/hf_moe.py): mlp.experts.{e}.{gate,up,down}_proj.weight, the router mlp.gate.weight [E, H].
Export writes decoder_sparse_step 1 and the dense layers as mlp_only_layers (Megatron's --moe-layer-freq
counts from layer 0, Qwen3's step from layer step - 1: a list says both)."""

from __future__ import annotations

import torch

from .base import ConversionError, special_token_ids
from .hf_moe import (
    Reads,
    attention_from_hf,
    attention_to_hf,
    config_json,
    experts_from_hf,
    experts_to_hf,
    moe_config_from,
    moe_refusals,
    taken,
    top_level,
    top_level_from,
)

NAME = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Qwen3-MoE (empty when it can)."""
    why = moe_refusals(cfg, "Qwen3-MoE")
    if cfg.model.num_experts and not cfg.model.qk_layernorm:
        why.append("it does not normalize query and key heads (--qk-layernorm); Qwen3-MoE does")
    return why


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the Qwen3MoeForCausalLM of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    out = config_json(cfg, vocab, ARCHITECTURE, NAME) | {
        "intermediate_size": m.ffn_size,
        "moe_intermediate_size": m.expert_ffn_size,
        "num_experts": m.num_experts,
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m.num_layers) if not m.is_moe_layer(i)],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    return out | special_token_ids(tokenizer)


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> Qwen3-MoE's (fused rows split, experts one per expert, [out, in])."""
    m, state = cfg.model, Reads(state)
    out = top_level(state, m)
    for i in range(m.num_layers):
        dst = f"model.layers.{i}.mlp."
        out.update(attention_to_hf(state, m, i, qk_norm=True))
        if m.is_moe_layer(i):
            out[dst + "gate.weight"] = state[f"layers.{i}.mlp.router.weight"]
            out.update(experts_to_hf(state, m, i, dst + "experts", EXPERT_NAMES))
            continue
        gate, up = state[f"layers.{i}.mlp.fc1.weight"].split([m.ffn_size, m.ffn_size], dim=0)
        out.update({dst + "gate_proj.weight": gate, dst + "up_proj.weight": up})
        out[dst + "down_proj.weight"] = state[f"layers.{i}.mlp.fc2.weight"]
    return state.finished(out)


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's names -> our single-rank names: the inverse of `to_theirs`."""
    m, hf = cfg.model, Reads(hf)
    out = top_level_from(hf, m)
    for i in range(m.num_layers):
        src = f"model.layers.{i}.mlp."
        out.update(attention_from_hf(hf, i, qk_norm=True))
        if m.is_moe_layer(i):
            out[f"layers.{i}.mlp.router.weight"] = hf[src + "gate.weight"]
            out.update(experts_from_hf(hf, m, i, src + "experts", EXPERT_NAMES))
            continue
        out[f"layers.{i}.mlp.fc1.weight"] = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]])
        out[f"layers.{i}.mlp.fc2.weight"] = hf[src + "down_proj.weight"]
    return taken(hf, out)


def sparse_layers(hf: dict) -> list[int]:
    """One 1 (sparse MLP) or 0 (dense) per layer, as transformers' Qwen3MoeDecoderLayer decides."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1 or not isinstance(dense, list):
        raise ConversionError(f"decoder_sparse_step {step!r} / mlp_only_layers {dense!r}: not a step and a list")
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    return [int(i not in dense and bool(experts) and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]


def config_from(hf: dict):
    """Our Config of the Qwen3-MoE model a HF config.json describes; refuses what we cannot hold."""
    if hf.get("model_type") != NAME:
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not {NAME}")
    pattern = sparse_layers(hf)
    if not any(pattern):
        raise ConversionError(
            "no layer is sparse (num_experts, decoder_sparse_step, mlp_only_layers): import it as Qwen3"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    cfg = moe_config_from(hf, experts, hf["moe_intermediate_size"], pattern)
    m = cfg.model
    m.qk_layernorm = True
    m.moe_router_pre_softmax = not hf.get("norm_topk_prob", False)
    m.attention_dropout = float(hf.get("attention_dropout", 0.0))
    return cfg
