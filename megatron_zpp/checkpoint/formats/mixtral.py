"""HF Mixtral (`MixtralForCausalLM`, transformers' own class: no remote code).

Llama's attention and, in every layer, a sparse MLP: a softmax over all experts, the top-k (2 in Mixtral
8x7B), always renormalised, which is our softmax router without --moe-router-pre-softmax (top-k of the logits,
softmax over the k: the same numbers). Its experts are `intermediate_size` wide, written one per expert as the
hub's files hold them (formats/hf_moe.py): block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down), the
router block_sparse_moe.gate.weight [E, H]. No sliding window is imported (none is built here)."""

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

NAME = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Mixtral (empty when it can)."""
    m = cfg.model
    why = moe_refusals(cfg, "Mixtral")
    if not m.num_experts:
        return why
    if dense := [i for i in range(m.num_layers) if not m.is_moe_layer(i)]:
        why.append(f"its layers {dense} have a dense MLP (--moe-layer-freq); every Mixtral layer is sparse")
    if m.moe_router_pre_softmax:
        why.append("it does not renormalise the top-k probabilities (--moe-router-pre-softmax); Mixtral does")
    if m.qk_layernorm:
        why.append("it normalizes query and key heads (--qk-layernorm); Mixtral does not")
    return why


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the MixtralForCausalLM of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    out = config_json(cfg, vocab, ARCHITECTURE, NAME) | {
        "intermediate_size": m.expert_ffn_size,
        "num_local_experts": m.num_experts,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
    return out | special_token_ids(tokenizer)


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> Mixtral's (fused rows split, experts one per expert, [out, in])."""
    m, state = cfg.model, Reads(state)
    out = top_level(state, m)
    for i in range(m.num_layers):
        dst = f"model.layers.{i}.block_sparse_moe."
        out.update(attention_to_hf(state, m, i, qk_norm=False))
        out[dst + "gate.weight"] = state[f"layers.{i}.mlp.router.weight"]
        out.update(experts_to_hf(state, m, i, dst + "experts", EXPERT_NAMES))
    return state.finished(out)


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Mixtral's names -> our single-rank names: the inverse of `to_theirs`."""
    m, hf = cfg.model, Reads(hf)
    out = top_level_from(hf, m)
    for i in range(m.num_layers):
        src = f"model.layers.{i}.block_sparse_moe."
        out.update(attention_from_hf(hf, i, qk_norm=False))
        out[f"layers.{i}.mlp.router.weight"] = hf[src + "gate.weight"]
        out.update(experts_from_hf(hf, m, i, src + "experts", EXPERT_NAMES))
    return taken(hf, out)


def config_from(hf: dict):
    """Our Config of the Mixtral model a HF config.json describes; refuses what we cannot hold."""
    if hf.get("model_type") != NAME:
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not {NAME}")
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    cfg = moe_config_from(hf, experts, hf["intermediate_size"], [1] * hf["num_hidden_layers"])
    cfg.model.attention_dropout = float(hf.get("attention_dropout", 0.0))
    return cfg
