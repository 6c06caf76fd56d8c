"""HF OLMo Hybrid (`OlmoHybridForCausalLM`, transformers' own class since 5.25: no remote code).

The model, as transformers' modeling_olmo_hybrid.py builds it:
- `layer_types`: "linear_attention" (Gated DeltaNet) and "full_attention" (softmax) layers; ours put softmax
  attention at every K-th layer (--softmax-attention-every K: K-1, 2K-1, ...), its default i % 4 == 3 is K = 4.
- softmax layers are OLMo 2/3's: no input norm, RMSNorm on the attention and MLP outputs before each residual
  add (post_attention_layernorm, post_feedforward_layernorm: our --reordered-norms softmax, norm1 and norm2), and
  q_norm / k_norm over the whole q and k projections ([heads x head dim]: our --qk-layernorm-full-width); RoPE
  (rotate_half: our pairing) or none (rope_theta null: our --position-embedding-type none).
- GDN layers are pre-norm (input_layernorm, post_attention_layernorm): separate q/k/v/g/a/b projections (our
  proj_in's sections, in that order), one depthwise conv1d over q | k | v ([channels, 1, kernel]; ours [channels,
  kernel]), SiLU, q/k L2-normalised, beta = sigmoid(b), times 2 with `linear_allow_neg_eigval` (our
  --linear-allow-neg-eigval), log a = -exp(A_log) softplus(a + dt_bias), the output RMSNorm o_norm of eps 1e-5
  (our --linear-norm-epsilon) with one [head_v_dim] weight shared by the heads, times silu(g).
- SwiGLU MLPs, no biases, a final norm, lm_head tied or not (`tie_word_embeddings`).

Names are the hub's, as transformers' save_pretrained writes them and its from_pretrained reads them (its
conversion_mapping.py renames on the way): the convolution as q_conv1d, k_conv1d, v_conv1d ([channels, 1,
kernel] each; the class fuses them into conv1d), and the norms that the class calls input_layernorm and
post_attention_layernorm as attention_layer_norm and feedforward_layer_norm (in every layer: a softmax layer's
post-attention norm is its feedforward_layer_norm, beside post_feedforward_layernorm). Where key and value
widths differ, transformers' own save_pretrained splits the fused convolution in equal thirds instead of q | k | v
(`saved_shapes`): an import reads either split, an export writes q | k | v.

A model of ours without a shared GDN output-norm weight (one per head) exports when its heads' weights are
equal (an import from OLMo Hybrid is), and is refused by name otherwise.
"""

from __future__ import annotations

import torch

from ...config.shapes import GDN_CONV_KERNEL
from .base import ConversionError, decoder_config, experts_refusal, special_token_ids
from .hf_moe import Reads, rope_theta, taken, top_level, top_level_from
from .remote import FULL, LINEAR, _hybrid_period

NAME = "olmo_hybrid"
ARCHITECTURE = "OlmoHybridForCausalLM"
OUTPUT_NORM_EPS = 1e-5  # OlmoHybridGatedDeltaNet's o_norm, whatever rms_norm_eps says
GDN_NAMES = ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")  # our proj_in's sections, in order


def unsupported(cfg) -> list[str]:
    """Why a model cannot be exported as OLMo Hybrid (empty when it can)."""
    m = cfg.model
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    rope_ok = m.position_embedding_type == "none" or (
        m.position_embedding_type == "rope" and m.rotary_percent == 1.0 and not m.rotary_interleaved
    )
    checks = [
        (
            kinds == {"gdn", "softmax"},
            f"its layers are {'/'.join(sorted(kinds))}; OLMo Hybrid mixes Gated DeltaNet and softmax attention "
            "(--attention-type gdn --softmax-attention-every K)",
        ),
        (m.normalization == "RMSNorm", f"it uses {m.normalization}; OLMo Hybrid uses RMSNorm"),
        (m.activation == "swiglu", f"its MLP uses {m.activation}; OLMo Hybrid's is SwiGLU"),
        (not (m.add_bias_linear or m.add_qkv_bias), "it has linear biases; OLMo Hybrid has none"),
        (rope_ok, "its positions are not RoPE over whole heads in halves, nor none (OLMo Hybrid's two)"),
        (
            m.reordered_norms == "softmax",
            f"--reordered-norms {m.reordered_norms}: OLMo Hybrid normalizes its attention layers' outputs and its "
            "GDN layers' inputs (--reordered-norms softmax)",
        ),
        (
            m.qk_layernorm and m.qk_layernorm_full_width,
            "OLMo Hybrid normalizes the whole q and k projections (--qk-layernorm --qk-layernorm-full-width)",
        ),
        (
            m.gdn_norm_epsilon == OUTPUT_NORM_EPS,
            f"its GDN output norm's epsilon is {m.gdn_norm_epsilon}; OLMo Hybrid's is {OUTPUT_NORM_EPS} "
            f"(--linear-norm-epsilon {OUTPUT_NORM_EPS})",
        ),
        (not m.attention_output_gate, "it gates its attention output (--attention-output-gate); OLMo Hybrid does not"),
    ]
    return [why for ok, why in checks if not ok] + experts_refusal(cfg, "OLMo Hybrid")


def _gdn(cfg):
    return cfg.model.mixer_of_kind("gdn")


def config(cfg, vocab: int, tokenizer=None) -> dict:
    """config.json of the OlmoHybridForCausalLM of `cfg` (vocab: the padded vocabulary)."""
    m, gdn = cfg.model, _gdn(cfg)
    theta = m.rotary_base if m.position_embedding_type == "rope" else None  # null: no RoPE (NoPE)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": NAME,
        "vocab_size": vocab,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,  # read by the class's attention (getattr; hidden_size / heads without it)
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": [LINEAR if m.layer_kind(i) == "gdn" else FULL for i in range(m.num_layers)],
        "linear_num_key_heads": gdn.key_heads or gdn.heads,
        "linear_num_value_heads": gdn.heads,
        "linear_key_head_dim": gdn.key_dim,
        "linear_value_head_dim": gdn.value_dim,
        "linear_conv_kernel_dim": gdn.conv_kernel,
        "linear_allow_neg_eigval": m.linear_allow_neg_eigval,
        "initializer_range": m.init_method_std,
        "bos_token_id": None,  # the class's defaults (OLMo's tokenizer ids) are not this vocabulary's
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "use_cache": True,
    }
    return out | special_token_ids(tokenizer)


def _shared_norm(norm: torch.Tensor, gdn, name: str) -> torch.Tensor:
    """Our GDN output-norm weight as OLMo Hybrid's one [head_v_dim]: itself when shared, else the first head's,
    refused by name when the heads' differ."""
    if norm.numel() == gdn.value_dim:
        return norm
    heads = norm.view(-1, gdn.value_dim)
    if norm.device.type != "meta" and not bool((heads == heads[:1]).all()):
        raise ConversionError(
            f"{name} holds one output-norm weight per GDN head, and they differ; OLMo Hybrid shares one "
            f"[{gdn.value_dim}] weight over the heads"
        )
    return heads[0]


def _our_norm_width(cfg) -> int:
    """The width of our GDN layer's output-norm weight (one shared [V], or one per head)."""
    from ...model.context import ParallelContext
    from ...model.gated_deltanet import GatedDeltaNet

    with torch.device("meta"):
        return GatedDeltaNet(cfg.model, ParallelContext(), 0.0).head_norm.numel()


def _layer_to_hf(state: Reads, cfg, i: int) -> dict[str, torch.Tensor]:
    m, src, dst = cfg.model, f"layers.{i}.", f"model.layers.{i}."
    gate, up = state[src + "mlp.fc1.weight"].split([m.ffn_size, m.ffn_size], dim=0)
    out = {dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up}
    out[dst + "mlp.down_proj.weight"] = state[src + "mlp.fc2.weight"]
    if m.layer_kind(i) == "softmax":
        q_rows, kv_rows = m.num_attention_heads * m.head_dim, m.kv_heads * m.head_dim
        q, k, v = state[src + "mixer.qkv.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
        at = dst + "self_attn."
        out |= {at + "q_proj.weight": q, at + "k_proj.weight": k, at + "v_proj.weight": v}
        out[at + "o_proj.weight"] = state[src + "mixer.proj.weight"]
        out[at + "q_norm.weight"] = state[src + "mixer.q_norm.weight"]
        out[at + "k_norm.weight"] = state[src + "mixer.k_norm.weight"]
        out[dst + "feedforward_layer_norm.weight"] = state[src + "norm1.weight"]  # after the attention
        out[dst + "post_feedforward_layernorm.weight"] = state[src + "norm2.weight"]
        return out
    gdn, at = _gdn(cfg), dst + "linear_attn."
    out |= dict(zip([at + n + ".weight" for n in GDN_NAMES], state[src + "mixer.proj_in.weight"].split(gdn.sections)))
    convs = state[src + "mixer.conv"].unsqueeze(1).split(gdn.sections[:3])  # q | k | v channels
    out |= {at + f"{n}_conv1d.weight": c for n, c in zip("qkv", convs)}
    out[at + "A_log"], out[at + "dt_bias"] = state[src + "mixer.A_log"], state[src + "mixer.dt_bias"]
    out[at + "o_norm.weight"] = _shared_norm(state[src + "mixer.head_norm"], gdn, src + "mixer.head_norm")
    out[at + "o_proj.weight"] = state[src + "mixer.proj_out.weight"]
    out[dst + "attention_layer_norm.weight"] = state[src + "norm1.weight"]
    out[dst + "feedforward_layer_norm.weight"] = state[src + "norm2.weight"]
    return out


def to_theirs(state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our single-rank names -> OlmoHybridForCausalLM's (fused rows split, the convolution [C, 1, K])."""
    state = Reads(state)
    out = top_level(state, cfg.model)
    for i in range(cfg.model.num_layers):
        out.update(_layer_to_hf(state, cfg, i))
    return state.finished(out)


def saved_shapes(expected: dict, found: dict) -> dict:
    """`expected` with each GDN layer's q/k/v_conv1d shapes as the files split them, when the three add up to the
    fused convolution's channels: transformers 5.25's save_pretrained splits its fused conv1d in equal thirds
    (reversing its load-time Concatenate by equal chunks) where the hub's files (and our export) split it
    q | k | v; both concatenate to the same fused weight, which is all from_pretrained and `from_theirs` read."""
    out = dict(expected)
    for name in [n for n in expected if n.endswith("linear_attn.q_conv1d.weight")]:
        names = [name.replace("q_conv1d", f"{p}_conv1d") for p in "qkv"]
        if not all(n in found and len(found[n]) == 3 and found[n][1:] == expected[n][1:] for n in names):
            continue  # check_tensors names what is wrong
        if sum(found[n][0] for n in names) == sum(expected[n][0] for n in names):
            out.update({n: tuple(found[n]) for n in names})
    return out


def _layer_from_hf(hf: Reads, cfg, i: int, norm_width: int) -> dict[str, torch.Tensor]:
    m, src, dst = cfg.model, f"model.layers.{i}.", f"layers.{i}."
    mlp = src + "mlp."
    out = {dst + "mlp.fc1.weight": torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])}
    out[dst + "mlp.fc2.weight"] = hf[mlp + "down_proj.weight"]
    if m.layer_kind(i) == "softmax":
        at = src + "self_attn."
        out[dst + "mixer.qkv.weight"] = torch.cat([hf[at + f"{p}_proj.weight"] for p in "qkv"])
        out[dst + "mixer.proj.weight"] = hf[at + "o_proj.weight"]
        out[dst + "mixer.q_norm.weight"], out[dst + "mixer.k_norm.weight"] = (
            hf[at + "q_norm.weight"],
            hf[at + "k_norm.weight"],
        )
        out[dst + "norm1.weight"] = hf[src + "feedforward_layer_norm.weight"]
        out[dst + "norm2.weight"] = hf[src + "post_feedforward_layernorm.weight"]
        return out
    at = src + "linear_attn."
    out[dst + "mixer.proj_in.weight"] = torch.cat([hf[at + n + ".weight"] for n in GDN_NAMES])
    out[dst + "mixer.conv"] = torch.cat([hf[at + f"{n}_conv1d.weight"] for n in "qkv"]).squeeze(1)
    out[dst + "mixer.A_log"], out[dst + "mixer.dt_bias"] = hf[at + "A_log"], hf[at + "dt_bias"]
    norm = hf[at + "o_norm.weight"]
    out[dst + "mixer.head_norm"] = norm.repeat(norm_width // norm.numel())  # one per head where ours has that
    out[dst + "mixer.proj_out.weight"] = hf[at + "o_proj.weight"]
    out[dst + "norm1.weight"] = hf[src + "attention_layer_norm.weight"]
    out[dst + "norm2.weight"] = hf[src + "feedforward_layer_norm.weight"]
    return out


def from_theirs(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """OlmoHybridForCausalLM's names -> our single-rank names: the inverse of `to_theirs`."""
    hf, width = Reads(hf), _our_norm_width(cfg)
    out = top_level_from(hf, cfg.model)
    for i in range(cfg.model.num_layers):
        out.update(_layer_from_hf(hf, cfg, i, width))
    return taken(hf, out)


def config_from(hf: dict):
    """Our Config of the OLMo Hybrid model a HF config.json describes; refuses what we cannot hold."""
    if hf.get("model_type") != NAME:
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not {NAME}")
    kinds = list(hf["layer_types"])
    period = _hybrid_period(kinds, "gdn") if set(kinds) <= {LINEAR, FULL} else None
    rope = hf.get("rope_parameters") or {}
    nope = isinstance(rope, dict) and rope.get("rope_theta", 0) is None  # rotary_emb None: no positions
    why = [
        w
        for w, bad in [
            (
                f"layer_types {kinds} is not softmax attention at every K-th layer (K-1, 2K-1, ...) among GDN layers",
                period is None or period[1] < 2,
            ),
            (
                f"num_hidden_layers {hf['num_hidden_layers']!r} but {len(kinds)} layer_types",
                len(kinds) != hf["num_hidden_layers"],
            ),
            (f"hidden_act {hf.get('hidden_act')!r} is not silu", hf.get("hidden_act", "silu") != "silu"),
            ("it has attention biases", bool(hf.get("attention_bias"))),
            (
                f"linear_conv_kernel_dim {hf.get('linear_conv_kernel_dim')} is not our GDN's {GDN_CONV_KERNEL}",
                hf.get("linear_conv_kernel_dim", GDN_CONV_KERNEL) != GDN_CONV_KERNEL,
            ),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    assert period is not None  # refused above otherwise
    cfg = decoder_config(hf)
    m = cfg.model
    m.attention_type, m.softmax_attention_every = period
    m.normalization, m.activation, m.add_bias_linear = "RMSNorm", "swiglu", False
    m.norm_epsilon = float(hf.get("rms_norm_eps", 1e-6))
    m.position_embedding_type = "none" if nope else "rope"
    if not nope:
        m.rotary_base = rope_theta(hf)
    m.qk_layernorm = m.qk_layernorm_full_width = True
    m.reordered_norms, m.linear_norm_epsilon = "softmax", OUTPUT_NORM_EPS
    m.linear_allow_neg_eigval = bool(hf.get("linear_allow_neg_eigval", True))
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    m.attention_dropout = float(hf.get("attention_dropout", 0.0))
    _linear_shape(m, hf)
    return cfg


def _linear_shape(m, hf: dict) -> None:
    """The GDN heads and head dims config.json gives, as Megatron's --linear-* flags (validation refuses what our
    layer does not build, by flag)."""
    heads, head_dim = hf["num_attention_heads"], m.head_dim  # decoder_config set --kv-channels from head_dim
    key_heads = hf.get("linear_num_key_heads") or heads
    key_dim = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / key_heads)  # the class's defaults
    m.linear_num_key_heads, m.linear_num_value_heads = key_heads, hf.get("linear_num_value_heads") or heads
    m.linear_key_head_dim, m.linear_value_head_dim = key_dim, hf.get("linear_value_head_dim") or 2 * key_dim
    if (key_heads, m.linear_num_value_heads, key_dim, m.linear_value_head_dim) == (heads, heads, head_dim, head_dim):
        m.linear_num_key_heads = m.linear_num_value_heads = m.linear_key_head_dim = m.linear_value_head_dim = None
