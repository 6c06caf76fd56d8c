"""HF export and import of the models Llama cannot hold (GLA, GDN, hybrids, LayerNorm, GeLU), as a
transformers remote-code model: megatron_zpp/hf_remote/ (configuration + modeling file, plain
PyTorch) copied next to model.safetensors, with config.json's auto_map naming them.

    hf = config(cfg, vocab, tokenizer)          # config.json (model_type megatron_zpp_gla, for every mixer:
                                                # the name exports have always carried, so old ones load)
    to_theirs(state, cfg)                       # our single-rank names -> the remote model's
    from_theirs(hf_state, cfg)                  # and back (bitwise: splits and concatenations)
    config_from(hf)                             # our Config of such a config.json

Names: Llama's where the layer is Llama's (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input/post_attention_layernorm); a GLA layer's mixer is `attn` with q/k/v_proj, g_proj (the output
gate), gk_proj (the decay gate, full rank) or gk_down + gk_up (low rank, with its bias), g_norm
(the per-head norm) and o_proj, as flash-linear-attention's HF GLA models name them; a GDN layer's is
`attn` with q/k/v/g/a/b_proj, q/k/v_conv (depthwise, [channels, kernel]), A_log, dt_bias, o_norm (an RMSNorm of
one plain [V] weight, or per head with gdn_head_norm per_head; ours zero-centred goes out as 1 + w; a LayerNorm
with its bias, gdn_out_norm layernorm, where ours is one), o_proj, its
heads in linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / linear_value_head_dim
(megatron-core's meaning); a KDA layer's `attn` with q/k/v/b_proj,
f_a/f_b_proj and g_a/g_b_proj (Kimi Linear's names), q/k/v_conv, A_log, dt_bias, o_norm ([head dim], shared) and
o_proj.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from ... import hf_remote
from ...config.shapes import GDN_CONV_KERNEL
from .base import ConversionError, block_refusals, decoder_config, experts_refusal, special_token_ids

NAME = "remote"
ARCHITECTURE = hf_remote.ARCHITECTURE
LINEAR, FULL = "linear_attention", "full_attention"


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported with our remote code (empty when it can): it holds no linear
    biases and no learned positions, and rotates its softmax layers' q, k with RoPE."""
    m = cfg.model
    softmax = any(m.layer_kind(i) == "softmax" for i in range(m.num_layers))
    checks = [
        (not (m.add_bias_linear or m.add_qkv_bias), "it has linear biases (--add-bias-linear or --add-qkv-bias)"),
        (m.position_embedding_type != "learned_absolute", "it learns absolute positions"),
        (m.position_embedding_type == "rope" or not softmax, "its softmax layers use no RoPE"),
        (m.rotary_percent == 1.0 or not softmax, f"its RoPE rotates {m.rotary_dim} of {m.head_dim} head channels"),
        (m.activation in ("swiglu", "gelu"), f"its MLP uses {m.activation}; the remote code holds swiglu or gelu"),
        (not m.qk_layernorm, "it normalizes query and key heads (--qk-layernorm); the remote code does not"),
        (not m.rotary_interleaved or not softmax, "its RoPE pairs are interleaved (--rotary-interleaved)"),
        (
            not m.attention_output_gate,
            "it gates its attention output (--attention-output-gate); the remote code does not",
        ),
    ]
    why = [why for ok, why in checks if not ok] + block_refusals(cfg, "the remote code")
    return why + experts_refusal(cfg, "the remote code")


def layer_types(cfg) -> list[str]:
    m = cfg.model
    return [LINEAR if m.layer_kind(i) in ("gla", "gdn", "kda") else FULL for i in range(m.num_layers)]


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the remote-code model of `cfg` (vocab: the padded vocabulary)."""
    m = cfg.model
    out = {
        "architectures": [hf_remote.ARCHITECTURE],
        "model_type": hf_remote.MODEL_TYPE,
        "auto_map": dict(hf_remote.AUTO_MAP),
        "vocab_size": vocab,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "layer_types": layer_types(cfg),
        "normalization": m.normalization,
        "norm_eps": m.norm_epsilon,
        "activation": m.activation,
        "gelu_approximate": m.gelu_approximate,
        "rope_theta": m.rotary_base,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "gla_gate_low_rank": m.gla_gate_low_rank,
        "gla_gate_normalizer": m.gla_gate_normalizer,
        # the remote config's key, unchanged; unset (the device's default) leaves the remote config's own
        **({"gla_chunk_size": m.linear_chunk_size} if m.linear_chunk_size else {}),
        "linear_attention_type": m.attention_type if m.attention_type in ("gdn", "kda") else "gla",
        "linear_conv_kernel": GDN_CONV_KERNEL,
        **(_gdn_config(m) if m.attention_type == "gdn" else {}),
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    return out | special_token_ids(tokenizer)


def _gdn_config(m) -> dict:
    g = m.gdn_heads
    return {
        "linear_num_key_heads": g.key_heads,
        "linear_num_value_heads": g.value_heads,
        "linear_key_head_dim": g.key_dim,
        "linear_value_head_dim": g.value_dim,
        "gdn_head_norm": m.gdn_head_norm,
        "gdn_out_norm": m.gdn_norm[0].lower(),  # "rmsnorm" or "layernorm" (with a bias: --gdn-out-norm model)
    }


def write_remote_code(output: str) -> None:
    """Copy the configuration and modeling files next to the weights (auto_map names them)."""
    for path in hf_remote.files():
        shutil.copyfile(path, os.path.join(output, os.path.basename(path)))


def write_tokenizer_config(output: str) -> None:
    """Name the tokenizer class of the copied sentencepiece tokenizer.model, which transformers would
    otherwise take from the model type (Llama's is; ours has none): Llama's sentencepiece tokenizer."""
    with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer"}, f, indent=2)


def _norm_pairs(ours: str, theirs: str, cfg) -> list[tuple[str, str]]:
    pairs = [(ours + ".weight", theirs + ".weight")]
    return pairs + ([(ours + ".bias", theirs + ".bias")] if cfg.model.normalization == "LayerNorm" else [])


def _plain_pairs(cfg) -> list[tuple[str, str]]:
    """(our name, remote name) of every tensor that is copied as it is."""
    m = cfg.model
    pairs = [("embedding.weight", "model.embed_tokens.weight"), *_norm_pairs("final_norm", "model.norm", cfg)]
    if m.untie_embeddings_and_output_weights:
        pairs.append(("output.weight", "lm_head.weight"))
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        pairs += _norm_pairs(src + "norm1", dst + "input_layernorm", cfg)
        pairs += _norm_pairs(src + "norm2", dst + "post_attention_layernorm", cfg)
        pairs.append((src + "mlp.fc2.weight", dst + "mlp.down_proj.weight"))
        if m.layer_kind(i) == "softmax":
            pairs.append((src + "mixer.proj.weight", dst + "self_attn.o_proj.weight"))
            continue
        pairs += [(src + "mixer.proj_out.weight", dst + "attn.o_proj.weight")]
        if m.layer_kind(i) in ("gdn", "kda"):
            pairs += [(src + "mixer.head_norm", dst + "attn.o_norm.weight")]
            if m.layer_kind(i) == "gdn" and m.gdn_norm[0] == "LayerNorm":
                pairs += [(src + "mixer.head_norm_bias", dst + "attn.o_norm.bias")]
            pairs += [(src + f"mixer.{n}", dst + f"attn.{n}") for n in ("A_log", "dt_bias")]
            if m.layer_kind(i) == "kda":  # the low-rank gates' up-projections (Kimi Linear's f_b, g_b)
                pairs += [(src + "mixer.decay_up", dst + "attn.f_b_proj.weight")]
                pairs += [(src + "mixer.gate_up", dst + "attn.g_b_proj.weight")]
            continue
        pairs += [(src + "mixer.head_norm", dst + "attn.g_norm.weight")]
        if m.gla_gate_low_rank:
            pairs += [
                (src + "mixer.gate_down", dst + "attn.gk_down.weight"),
                (src + "mixer.gate_up", dst + "attn.gk_up.weight"),
                (src + "mixer.gate_bias", dst + "attn.gk_up.bias"),
            ]
    return pairs


def _fused(cfg) -> list[tuple[str, list[str], list[int]]]:
    """(our fused name, the remote names of its row blocks, their row counts) of every fused tensor."""
    m = cfg.model
    out = []
    for i in range(m.num_layers):
        src, dst, shape = f"layers.{i}.", f"model.layers.{i}.", m.mixer(i)
        mlp = ["gate_proj", "up_proj"] if m.ffn(i).gated else ["up_proj"]
        out.append((src + "mlp.fc1.weight", [f"{dst}mlp.{n}.weight" for n in mlp], list(m.ffn(i).sections)))
        if shape.kind == "softmax":
            qkv = [f"{dst}self_attn.{n}_proj.weight" for n in "qkv"]
            out.append((src + "mixer.qkv.weight", qkv, list(shape.sections)))
        elif shape.kind in ("gdn", "kda"):  # GDN: q | k | v | output gate | a | b; KDA: q | k | v | b and its
            # gates' down-projections f_a | g_a; both: the q | k | v convolution channels
            gdn = shape.kind == "gdn"
            names = [f"{dst}attn.{n}_proj.weight" for n in (("q", "k", "v", "g", "a", "b") if gdn else "qkvb")]
            out.append((src + "mixer.proj_in.weight", names, list(shape.sections)))
            if not gdn:
                down = [f"{dst}attn.{n}_proj.weight" for n in ("f_a", "g_a")]
                out.append((src + "mixer.gate_down", down, [shape.replicated // 2] * 2))
            conv = [f"{dst}attn.{n}_conv.weight" for n in "qkv"]
            out.append((src + "mixer.conv", conv, list(shape.sections[:3])))
        else:  # q | k | v | output gate (| decay gate at full rank): the sections of proj_in
            names = ["q_proj", "k_proj", "v_proj", "g_proj"] + ([] if m.gla_gate_low_rank else ["gk_proj"])
            out.append((src + "mixer.proj_in.weight", [f"{dst}attn.{n}.weight" for n in names], list(shape.sections)))
    return out


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> the remote model's (fused rows split); every tensor must be mapped."""
    out = {theirs: state[ours] for ours, theirs in _plain_pairs(cfg)}
    used = {ours for ours, _ in _plain_pairs(cfg)}
    for ours, names, rows in _fused(cfg):
        out.update(zip(names, state[ours].split(rows, dim=0)))
        used.add(ours)
    if left := sorted(set(state) - used):
        raise ConversionError(f"no HF name for {', '.join(left)}")
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The remote model's names -> our single-rank names: the inverse of `to_theirs`."""
    try:
        out = {ours: hf[theirs] for ours, theirs in _plain_pairs(cfg)}
        used = {theirs for _, theirs in _plain_pairs(cfg)}
        for ours, names, _ in _fused(cfg):
            out[ours] = torch.cat([hf[n] for n in names])
            used.update(names)
    except KeyError as e:
        raise ConversionError(f"tensor {e} is missing") from None
    if left := sorted(set(hf) - used):
        raise ConversionError(f"tensors this model does not have: {', '.join(left)}")
    return {k: v.float().contiguous() for k, v in out.items()}


def _hybrid_period(kinds: list[str], linear: str) -> tuple[str, int] | None:
    """(--attention-type, --softmax-attention-every) giving these layer types (`linear`: the linear layers'
    kind, gla, gdn or kda), or None when none does."""
    if all(k == FULL for k in kinds):
        return "softmax", 0
    for every in [0] + list(range(2, len(kinds) + 1)):
        if all((k == FULL) == bool(every and (i + 1) % every == 0) for i, k in enumerate(kinds)):
            return linear, every
    return None


def config_from(hf: dict):
    """Our Config of the remote-code model a config.json describes; refuses what we cannot hold."""
    try:
        return _config_from_remote(hf)
    except KeyError as e:
        raise ConversionError(f"config.json has no {e}") from None


def _config_from_remote(hf: dict):
    kinds = list(hf["layer_types"])
    linear = hf.get("linear_attention_type", "gla")
    known = linear in ("gla", "gdn", "kda")
    period = _hybrid_period(kinds, linear) if set(kinds) <= {LINEAR, FULL} and known else None
    why = [
        w
        for w, bad in [
            (
                f"layer_types {kinds} (linear_attention_type {linear!r}) is not GLA, GDN or KDA with softmax attention "
                "at every K-th layer (K-1, 2K-1, ...)",
                period is None,
            ),
            (
                f"linear_conv_kernel {hf.get('linear_conv_kernel')} is not our GDN's and KDA's {GDN_CONV_KERNEL}",
                linear in ("gdn", "kda") and hf.get("linear_conv_kernel", GDN_CONV_KERNEL) != GDN_CONV_KERNEL,
            ),
            (
                f"num_hidden_layers {hf['num_hidden_layers']!r} but {len(kinds)} layer_types",
                len(kinds) != hf["num_hidden_layers"],
            ),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    cfg = decoder_config(hf)  # dropout 0: the exported model has none (Megatron's default is 0.1)
    m = cfg.model
    assert period is not None  # refused above otherwise
    m.attention_type, m.softmax_attention_every = period
    m.normalization, m.norm_epsilon, m.activation = hf["normalization"], hf["norm_eps"], hf["activation"]
    m.rotary_base = float(hf.get("rope_theta", 10000.0))
    m.position_embedding_type, m.add_bias_linear = "rope", False  # what the remote code holds (unsupported)
    m.openai_gelu = hf.get("gelu_approximate", "tanh") == "tanh"  # without biases, Megatron's tanh gelu is this one
    m.gla_gate_low_rank, m.gla_gate_normalizer = hf["gla_gate_low_rank"], float(hf["gla_gate_normalizer"])
    m.linear_chunk_size = hf.get("gla_chunk_size")
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", True)
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    if linear == "gdn":  # exports before these keys: one value head per key head of head_dim, per-head norm weights
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            setattr(m, key, hf.get(key))
        m.gdn_head_norm = hf.get("gdn_head_norm", "per_head")
        layer_norm = hf.get("gdn_out_norm", "rmsnorm") == "layernorm"  # exports before the key: an RMSNorm
        m.gdn_out_norm = "model" if layer_norm == (m.normalization == "LayerNorm") else "rmsnorm"
    return cfg


# the old names (tests/checkpoint/test_convert.py, tests/test_fuzz_inputs.py)
to_remote_state, from_remote_state, config_from_remote = to_theirs, from_theirs, config_from
RemoteConversionError = ConversionError
