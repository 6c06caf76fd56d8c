"""HF GPT-2 (`GPT2LMHeadModel`) export and import: Megatron's default GPT maps onto it one to one.

A model maps when every layer is softmax attention with one key/value head per query head,
LayerNorm, the gelu MLP, learned absolute positions and biases in every linear layer. Megatron's
gelu with biases is its fused bias-gelu, the tanh approximation: HF's `gelu_new` (GPT-2's own);
with --no-bias-gelu-fusion it is the exact erf form, HF's `gelu` (ModelConfig.gelu_approximate). HF's Conv1D keeps
its weights as [in, out]: ours are transposed on the way; qkv's rows (q | k | v, each head-major)
are c_attn's columns as they are. --apply-layernorm-1p is folded in (1 + w is written), so an
import comes back as plain LayerNorm weights."""

from __future__ import annotations

import copy

import torch

from .base import ConversionError, block_refusals, experts_refusal, special_token_ids

NAME = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"

# HF's activation_function -> F.gelu's approximate
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as GPT-2 (empty when it can)."""
    m = cfg.model
    checks = [
        (all(m.layer_kind(i) == "softmax" for i in range(m.num_layers)), "GPT-2 has only softmax attention"),
        (m.normalization == "LayerNorm", f"it uses {m.normalization}; GPT-2 uses LayerNorm"),
        (m.activation == "gelu", f"its MLP uses {m.activation}; GPT-2 uses gelu"),
        (
            m.position_embedding_type == "learned_absolute",
            f"its positions are {m.position_embedding_type}; GPT-2 learns absolute ones",
        ),
        (m.add_bias_linear, "it has no linear biases; GPT-2 has them in every linear layer"),
        (m.kv_heads == m.num_attention_heads, "it uses grouped-query attention; GPT-2 has one kv head per head"),
        (
            m.head_dim * m.num_attention_heads == m.hidden_size,
            f"its heads are {m.head_dim} wide (--kv-channels); GPT-2's are hidden size / heads",
        ),
        (not m.qk_layernorm, "it normalizes query and key heads (--qk-layernorm); GPT-2 does not"),
        (not m.attention_output_gate, "it gates its attention output (--attention-output-gate); GPT-2 does not"),
    ]
    return [why for ok, why in checks if not ok] + block_refusals(cfg, "GPT-2") + experts_refusal(cfg, "GPT-2")


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the GPT2LMHeadModel of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": m.max_position_embeddings or m.seq_length,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn_size,
        "activation_function": "gelu_new" if m.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": m.norm_epsilon,
        "resid_pdrop": m.hidden_dropout,
        "embd_pdrop": m.hidden_dropout,
        "attn_pdrop": m.attention_dropout,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    } | special_token_ids(tokenizer)


def _pairs(cfg) -> list[tuple[str, str, bool]]:
    """(our name, HF name, transposed) of every tensor."""
    pairs = [
        ("embedding.weight", "transformer.wte.weight", False),
        ("position_embeddings.weight", "transformer.wpe.weight", False),
        ("final_norm.weight", "transformer.ln_f.weight", False),
        ("final_norm.bias", "transformer.ln_f.bias", False),
    ]
    if cfg.model.untie_embeddings_and_output_weights:
        pairs.append(("output.weight", "lm_head.weight", False))
    layer = [
        ("norm1", "ln_1", False),
        ("mixer.qkv", "attn.c_attn", True),
        ("mixer.proj", "attn.c_proj", True),
        ("norm2", "ln_2", False),
        ("mlp.fc1", "mlp.c_fc", True),
        ("mlp.fc2", "mlp.c_proj", True),
    ]
    for i in range(cfg.model.num_layers):
        for ours, theirs, conv1d in layer:
            pairs.append((f"layers.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", conv1d))
            pairs.append((f"layers.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias", False))
    return pairs


def _is_norm_weight(name: str) -> bool:
    """A block, final or query/key head norm's weight (not GLA's head norm, which --apply-layernorm-1p leaves
    alone; softmax attention builds its --qk-layernorm norms with the flag: model/attention.py)."""
    norms = (".norm1.weight", ".norm2.weight", ".mixer.q_norm.weight", ".mixer.k_norm.weight")
    return name.endswith(norms) or name == "final_norm.weight"


def follows_1p(name: str, m) -> bool:
    """Whether --apply-layernorm-1p zero-centres weight `name` of model `m`: a block, final or q/k norm's, and a
    GDN layer's output norm's where it follows the model's norms (--gdn-out-norm model)."""
    if _is_norm_weight(name):
        return True
    gdn_norm = name.startswith("layers.") and name.endswith(".mixer.head_norm") and m.gdn_out_norm == "model"
    return gdn_norm and m.layer_kind(int(name.split(".")[1])) == "gdn"


def fold_layernorm_1p(state: dict, cfg) -> tuple[dict, object]:
    """(state, cfg) with --apply-layernorm-1p folded in: the zero-centred norms' weights (`follows_1p`) as 1 + w
    and the flag off (a copy; HF models scale by the weight itself). Unchanged without the flag."""
    if not cfg.model.apply_layernorm_1p:
        return state, cfg
    m = cfg.model
    cfg = copy.deepcopy(cfg)
    cfg.model.apply_layernorm_1p = False
    return {n: (w + 1 if follows_1p(n, m) else w) for n, w in state.items()}, cfg


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> GPT2LMHeadModel's (Conv1D weights transposed), 1p folded in first."""
    state, cfg = fold_layernorm_1p(state, cfg)
    return {
        theirs: (state[ours].float().t() if conv1d else state[ours].float()).contiguous().clone()
        for ours, theirs, conv1d in _pairs(cfg)
    }


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's names -> ours: the inverse of `to_theirs` (plain LayerNorm weights)."""
    return {
        ours: (hf[theirs].t() if conv1d else hf[theirs]).float().contiguous() for ours, theirs, conv1d in _pairs(cfg)
    }


def config_from(hf: dict):
    """Our Config of the GPT-2 a HF config.json describes; refuses what we cannot hold."""
    from ...config import Config

    act = hf.get("activation_function", "gelu_new")
    why = [
        w
        for w, bad in [
            (f"activation_function {act!r} is not one of {sorted(HF_ACTIVATIONS)}", act not in HF_ACTIVATIONS),
            ("it scales attention by the inverse layer index", hf.get("scale_attn_by_inverse_layer_idx")),
            ("it reorders and upcasts attention", hf.get("reorder_and_upcast_attn")),
            ("it does not scale attention weights", not hf.get("scale_attn_weights", True)),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = hf["n_layer"], hf["n_embd"], hf["n_head"]
    m.ffn_hidden_size = hf.get("n_inner") or 4 * hf["n_embd"]
    m.vocab_size, m.max_position_embeddings = hf["vocab_size"], hf["n_positions"]
    m.seq_length = min(m.seq_length, m.max_position_embeddings)
    m.norm_epsilon = hf.get("layer_norm_epsilon", 1e-5)
    m.hidden_dropout = float(hf.get("resid_pdrop", 0.1))
    m.attention_dropout = float(hf.get("attn_pdrop", 0.1))
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", True)
    m.normalization, m.activation, m.attention_type = "LayerNorm", "gelu", "softmax"
    m.position_embedding_type, m.add_bias_linear, m.apply_layernorm_1p = "learned_absolute", True, False
    m.bias_gelu_fusion = HF_ACTIVATIONS[act] == "tanh"  # Megatron's fused bias-gelu is the tanh form
    return cfg


to_gpt2_state = to_theirs  # the old names (tests/test_fuzz_inputs.py)
GPT2ConversionError = ConversionError
