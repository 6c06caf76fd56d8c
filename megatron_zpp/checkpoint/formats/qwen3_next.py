"""HF Qwen3-Next (`Qwen3NextForCausalLM`, transformers' own class: no remote code).

A hybrid of Gated DeltaNet layers and gated softmax attention at every K-th layer (formats/qwen3_hybrid.py has
what it shares with Qwen3.5), each followed by a sparse MoE block (a softmax router, routed experts one per expert
as the hub's files hold them, a shared expert scaled by a sigmoid gate) or, in the layers `mlp_only_layers` /
`decoder_sparse_step` leave dense (as Qwen3-MoE decides: formats/qwen3_moe.py), a SwiGLU MLP of
`intermediate_size`. The GDN input projection is fused per key head (in_proj_qkvz, in_proj_ba). The router
renormalises its top-k when `norm_topk_prob` (ours without --moe-router-pre-softmax), or not (with it).
A model without experts goes to Qwen3.5 (qwen3_5.py: Qwen3_5ForCausalLM, the dense family)."""

from __future__ import annotations

import torch

from . import qwen3_hybrid as qh
from .base import special_token_ids
from .qwen3_moe import sparse_layers

NAME = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
SKIPPED, ZERO_CENTRED = qh.SKIPPED, qh.ZERO_CENTRED
TARGET = "Qwen3-Next"


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Qwen3-Next (empty when it can)."""
    why = qh.family_refusals(cfg, TARGET)
    if not cfg.model.num_experts:
        return why + [f"it has no experts (--num-experts); {TARGET} is a mixture of experts (Qwen3.5 is dense)"]
    return why + qh.moe_refusals(cfg, TARGET)


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the Qwen3NextForCausalLM of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    out = qh.config_json(cfg, vocab, ARCHITECTURE, NAME) | qh.moe_json(cfg)
    out |= {
        "intermediate_size": m.ffn_size,
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m.num_layers) if not m.is_moe_layer(i)],
    }
    return out | special_token_ids(tokenizer)


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> Qwen3-Next's."""
    return qh.to_hf(state, cfg, grouped=True)


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Qwen3-Next's names -> ours: the inverse of `to_theirs`."""
    return qh.from_hf(hf, cfg, grouped=True)


def config_from(hf: dict):
    """Our Config of the Qwen3-Next model a HF config.json describes; refuses what we cannot hold."""
    cfg = qh.config_from(hf, NAME)
    pattern = sparse_layers(hf)
    if any(pattern):
        qh.moe_config(cfg, hf, pattern)
        cfg.model.moe_router_pre_softmax = not hf.get("norm_topk_prob", True)
    return cfg
