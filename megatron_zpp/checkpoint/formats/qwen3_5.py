"""HF Qwen3.5's text models, transformers' own classes (no remote code): `Qwen3_5ForCausalLM` (model_type
qwen3_5_text: dense SwiGLU MLPs) and `Qwen3_5MoeForCausalLM` (qwen3_5_moe_text: every layer a sparse MoE block
with a gated shared expert; its router always renormalises the top-k: ours without --moe-router-pre-softmax).

Qwen3-Next's hybrid (formats/qwen3_hybrid.py) with the GDN input projections kept apart (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) and multimodal RoPE, which on text (the same position on its three axes) is plain RoPE.
The hub's checkpoints are the image-text model (Qwen3_5ForConditionalGeneration, model_type qwen3_5 or
qwen3_5_moe): an import reads its text_config and language model (model.language_model.* as model.*) and leaves the
vision tower (model.visual.*) and the MTP layers (mtp.*) out; an export writes the text model."""

from __future__ import annotations

import torch

from . import qwen3_hybrid as qh
from .base import ConversionError, special_token_ids

NAME = "qwen3_5"
ARCHITECTURE = "Qwen3_5ForCausalLM"
MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
ARCHITECTURES = (ARCHITECTURE, MOE_ARCHITECTURE)
MODEL_TYPES = {"qwen3_5_text": ARCHITECTURE, "qwen3_5_moe_text": MOE_ARCHITECTURE}
IMAGE_TEXT = ("qwen3_5", "qwen3_5_moe")  # Qwen3_5(Moe)ForConditionalGeneration: the hub's Qwen3.5 checkpoints
SKIPPED, ZERO_CENTRED = (*qh.SKIPPED, "model.visual."), qh.ZERO_CENTRED
TARGET = "Qwen3.5"


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Qwen3.5 (empty when it can)."""
    m = cfg.model
    why = qh.family_refusals(cfg, TARGET)
    if not m.num_experts:
        return why
    if not all(m.is_moe_layer(i) for i in range(m.num_layers)):
        why.append(f"some of its layers are dense (--moe-layer-freq); every {TARGET}-MoE layer is sparse")
    if m.moe_router_pre_softmax:
        why.append(f"its router does not renormalise the top-k (--moe-router-pre-softmax); {TARGET}-MoE's does")
    return why + qh.moe_refusals(cfg, TARGET + "-MoE")


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the Qwen3.5 text model of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    if m.num_experts:
        out = qh.config_json(cfg, vocab, MOE_ARCHITECTURE, "qwen3_5_moe_text") | qh.moe_json(cfg)
    else:
        out = qh.config_json(cfg, vocab, ARCHITECTURE, "qwen3_5_text") | {"intermediate_size": m.ffn_size}
    return out | special_token_ids(tokenizer)


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> Qwen3.5's."""
    return qh.to_hf(state, cfg, grouped=False)


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Qwen3.5's names -> ours: the inverse of `to_theirs`."""
    return qh.from_hf(hf, cfg, grouped=False)


def renamed_prefixes(hf: dict) -> dict[str, str]:
    """The image-text model's language model read as the text model (hf.py: `their_entries`)."""
    return {"model.language_model.": "model."} if hf.get("model_type") in IMAGE_TEXT else {}


def config_from(hf: dict):
    """Our Config of the Qwen3.5 text model a HF config.json describes (of the image-text model's, its text_config:
    the vision tower is left out); refuses what we cannot hold."""
    if hf.get("model_type") in IMAGE_TEXT:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ConversionError(f"model_type {hf['model_type']!r} without a text_config object")
        hf = text | {k: hf[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype") if k in hf}
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConversionError(f"model_type {kind!r} is not a Qwen3.5 text model ({', '.join(MODEL_TYPES)})")
    cfg = qh.config_from(hf, kind)
    if kind == "qwen3_5_moe_text":
        qh.moe_config(cfg, hf, [1] * hf["num_hidden_layers"])
    return cfg
