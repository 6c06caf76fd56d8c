"""HF Llama (`LlamaForCausalLM`): softmax attention, RMSNorm, SwiGLU, RoPE, no biases.

q, k, v and gate, up are split out of our fused rows (qkv: [q | k | v], each head-major; fc1: [gate | up]).
RoPE needs no permutation of the q/k rows: we rotate the pairs (x[i], x[i + d/2]) as HF Llama's
rotate_half does.
"""

from __future__ import annotations

import torch

from ...progress import progress
from .base import ConversionError, block_refusals, decoder_config, experts_refusal, special_token_ids

NAME = "llama"
ARCHITECTURE = "LlamaForCausalLM"


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as Llama (empty when it can)."""
    m = cfg.model
    why = []
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    if kinds != {"softmax"}:
        why.append(
            f"its layers are {'/'.join(sorted(kinds))} (gated linear attention or a hybrid); Llama has only "
            f"softmax attention"
        )
    if m.normalization != "RMSNorm":
        why.append(f"it uses {m.normalization}; Llama uses RMSNorm")
    if m.activation != "swiglu":
        why.append(f"its MLP uses {m.activation}; Llama uses SwiGLU")
    if m.position_embedding_type != "rope":
        why.append(f"its positions are {m.position_embedding_type}; Llama uses RoPE")
    if m.add_bias_linear or m.add_qkv_bias:
        why.append("it has linear biases; the Llama export holds none")
    if m.rotary_percent != 1.0:
        why.append(f"its RoPE rotates {m.rotary_dim} of {m.head_dim} head channels; the Llama export rotates all")
    if m.qk_layernorm:  # Llama has no q_norm / k_norm: the export would drop them
        why.append("it normalizes query and key heads (--qk-layernorm); Llama does not")
    if m.attention_output_gate:
        why.append("it gates its attention output (--attention-output-gate); Llama does not")
    return why + block_refusals(cfg, "Llama") + experts_refusal(cfg, "Llama")


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the LlamaForCausalLM of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "vocab_size": vocab,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": m.init_method_std,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    return out | special_token_ids(tokenizer)


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> HF Llama names (q, k, v and gate, up split out of the fused rows)."""
    m = cfg.model
    q_rows, kv_rows, ffn = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_size
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in progress(range(m.num_layers), "HF export", unit=" layers"):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "mixer.qkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
        gate, up = state[src + "mlp.fc1.weight"].split([ffn, ffn], dim=0)
        out.update(
            {
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "mixer.proj.weight"],
                dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "mlp.fc2.weight"],
                dst + "input_layernorm.weight": state[src + "norm1.weight"],
                dst + "post_attention_layernorm.weight": state[src + "norm2.weight"],
            }
        )
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF Llama names -> our single-rank names: the inverse of `to_theirs`."""
    out = {"embedding.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if cfg.model.untie_embeddings_and_output_weights:
        out["output.weight"] = hf["lm_head.weight"]
    for i in progress(range(cfg.model.num_layers), "HF import", unit=" layers"):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out.update(
            {
                dst + "mixer.qkv.weight": torch.cat(
                    [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]
                ),
                dst + "mixer.proj.weight": hf[attn + "o_proj.weight"],
                dst + "mlp.fc1.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]),
                dst + "mlp.fc2.weight": hf[mlp + "down_proj.weight"],
                dst + "norm1.weight": hf[src + "input_layernorm.weight"],
                dst + "norm2.weight": hf[src + "post_attention_layernorm.weight"],
            }
        )
    return {k: v.float().contiguous() for k, v in out.items()}


def config_from(hf: dict):
    """Our Config of the Llama model a HF config.json describes; refuses what we cannot hold."""
    from ... import hf_remote

    why = [
        w
        for w, bad in [
            (
                f"model_type {hf.get('model_type')!r} is none of those imported: llama, gpt2, olmo_hybrid, qwen3_moe, "
                f"mixtral, {hf_remote.MODEL_TYPE} (our GLA/hybrid export)",
                hf.get("model_type") != "llama",
            ),
            (f"hidden_act {hf.get('hidden_act')!r} is not silu (SwiGLU)", hf.get("hidden_act", "silu") != "silu"),
            ("it uses rope_scaling", bool(hf.get("rope_scaling"))),
            ("it has attention or MLP biases", hf.get("attention_bias") or hf.get("mlp_bias")),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    cfg = decoder_config(hf)
    m = cfg.model
    m.attention_dropout = float(hf.get("attention_dropout", 0.0))  # Llama trains without
    m.norm_epsilon, m.rotary_base = hf.get("rms_norm_eps", 1e-6), float(hf.get("rope_theta", 10000.0))
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
    m.normalization, m.activation, m.attention_type = "RMSNorm", "swiglu", "softmax"
    m.position_embedding_type, m.add_bias_linear = "rope", False
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    return cfg


def config_from_hf(hf: dict, hf_dir: str):
    """`config_from`, its refusal naming the directory (the old name: tests/checkpoint/test_convert.py)."""
    try:
        return config_from(hf)
    except ConversionError as e:
        raise ConversionError(f"cannot import {hf_dir}: {e}") from None


# the old names (tests/test_progress.py, tests/test_fuzz_inputs.py, tests/checkpoint/test_convert.py)
to_hf_state, from_hf_state, hf_unsupported = to_theirs, from_theirs, unsupported
