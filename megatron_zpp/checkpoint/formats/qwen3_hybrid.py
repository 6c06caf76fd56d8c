"""What transformers' Qwen3-Next (qwen3_next.py) and Qwen3.5 (qwen3_5.py) share, no remote code.

Both are hybrids of Gated DeltaNet layers and output-gated softmax attention at every K-th layer
(config.json's `layer_types`: our --attention-type gdn --softmax-attention-every K), with
- zero-centred RMSNorms (Gemma's: the weight w is applied as 1 + w: our --apply-layernorm-1p; the block, final and
  query/key head norms), copied as they are; a model without the flag is written as w - 1;
- softmax attention with a per-head q/k RMSNorm (--qk-layernorm), partial RoPE (--rotary-percent: the first
  int(head_dim x fraction) channels, pairs (x[i], x[i + r/2]), frequencies over r: Qwen's partial_rotary_factor)
  and the element-wise sigmoid output gate (--attention-output-gate). Their q_proj emits q and the gate per head
  ([q_h | gate_h] for h = 0..H-1), ours q | k | v | gate: rows reordered here;
- GDN layers: q | k | v through one depthwise convolution (conv1d [C, 1, K], ours [C, K]), A_log and dt_bias per
  value head, one RMSNorm weight over a value head's channels (the plain gain g, not zero-centred: ours, which
  follows --apply-layernorm-1p, goes out as 1 + w; an import holds g as it is: --gdn-out-norm rmsnorm) times
  silu(z), out_proj.
  Qwen3-Next fuses the input projection per key head (in_proj_qkvz: [q_g | k_g | v_g | z_g] for each key head g,
  its value heads r = Hv / Hk together; in_proj_ba: [b_g | a_g]); Qwen3.5 keeps in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a apart. Ours: proj_in = q | k | v | z | a | b, each head-major;
- SwiGLU MLPs, or (Qwen3-Next, Qwen3.5-MoE) a softmax router over routed experts written one per expert
  (hf_moe.py) plus a shared expert scaled by sigmoid(shared_expert_gate(x)) (--moe-shared-expert-gate).

Multi-token prediction layers (config.json's mtp_num_hidden_layers, tensors mtp.*): we build no MTP; an import
skips them by name (as transformers' own classes do), an export writes none.
"""

from __future__ import annotations

import copy

import torch

from .base import ConversionError, decoder_config
from .hf_moe import Reads, experts_from_hf, experts_to_hf, rope_theta, top_level, top_level_from
from .remote import FULL, LINEAR, _hybrid_period

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
SKIPPED = ("mtp.",)  # HF tensors an import leaves out (the multi-token prediction head), by prefix
ZERO_CENTRED = True  # hf.py: the norms go out as w (applied as 1 + w), not folded


def family_refusals(cfg, target: str) -> list[str]:
    """Why our model is not a Qwen3-Next/Qwen3.5 hybrid `target` holds (empty when it is; experts not checked)."""
    m = cfg.model
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    softmax = "softmax" in kinds
    checks = [
        (kinds <= {"gdn", "softmax"}, f"its layers are {'/'.join(sorted(kinds))}; {target} has GDN and softmax"),
        (m.normalization == "RMSNorm", f"it uses {m.normalization}; {target} uses RMSNorm"),
        (m.activation == "swiglu", f"its MLP uses {m.activation}; {target}'s are SwiGLU"),
        (not (m.add_bias_linear or m.add_qkv_bias), f"it has linear biases; the {target} export holds none"),
        (m.position_embedding_type == "rope" or not softmax, f"its positions are {m.position_embedding_type}"),
        (not m.rotary_interleaved, f"its RoPE pairs are interleaved (--rotary-interleaved); {target}'s are halves"),
        (m.qk_layernorm or not softmax, f"it does not normalize query and key heads (--qk-layernorm); {target} does"),
        (
            m.attention_output_gate or not softmax,
            f"its attention output is not gated (--attention-output-gate); {target}'s is",
        ),
    ]
    return [why for ok, why in checks if not ok]


def moe_refusals(cfg, target: str) -> list[str]:
    """Why our experts do not fit `target`'s sparse block (softmax router, gated shared expert); empty if they do."""
    m = cfg.model
    checks = [
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
            bool(m.moe_shared_expert_intermediate_size) and m.moe_shared_expert_gate,
            f"it has no gated shared expert (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate); "
            f"{target}'s sparse block has one",
        ),
        (
            m.moe_expert_capacity_factor is None,
            f"its experts drop tokens over capacity (--moe-expert-capacity-factor); {target}'s drop none",
        ),
    ]
    return [why for ok, why in checks if not ok]


def zero_centred(state: dict, cfg) -> tuple[dict, object]:
    """(state, cfg) with the block, final and q/k norms zero-centred (as Qwen's: applied as 1 + w), and the GDN
    output norm where it follows them (gpt2.follows_1p): unchanged with --apply-layernorm-1p, else w - 1 and the
    flag set (a copy)."""
    if cfg.model.apply_layernorm_1p:
        return state, cfg
    from .gpt2 import follows_1p

    m = cfg.model
    cfg = copy.deepcopy(cfg)
    cfg.model.apply_layernorm_1p = True
    return {n: (w - 1 if follows_1p(n, m) else w) for n, w in state.items()}, cfg


class Heads:
    """A GDN layer's heads: Hk key heads of Dk channels, Hv value heads of Dv (Hv a multiple of Hk)."""

    def __init__(self, cfg):
        shape = cfg.model.mixer_of_kind("gdn")
        q, _, v, _, _, b = shape.sections
        self.hv, self.dk = b, shape.key_dim
        self.hk, self.dv = q // self.dk, v // b
        self.r = self.hv // self.hk
        self.sections = list(shape.sections)


def attention_to_hf(state: Reads, m, i: int) -> dict[str, torch.Tensor]:
    """Layer i's gated softmax attention: q and the gate interleaved per head in q_proj."""
    src, dst = f"layers.{i}.mixer.", f"model.layers.{i}.self_attn."
    H, D = m.num_attention_heads, m.head_dim
    q, k, v, gate = state[src + "qkv.weight"].split(list(m.mixer_of_kind("softmax").sections), dim=0)
    return {
        dst + "q_proj.weight": torch.stack([q.view(H, D, -1), gate.view(H, D, -1)], dim=1).reshape(2 * H * D, -1),
        dst + "k_proj.weight": k,
        dst + "v_proj.weight": v,
        dst + "o_proj.weight": state[src + "proj.weight"],
        dst + "q_norm.weight": state[src + "q_norm.weight"],
        dst + "k_norm.weight": state[src + "k_norm.weight"],
    }


def attention_from_hf(hf: Reads, m, i: int) -> dict[str, torch.Tensor]:
    """The inverse of `attention_to_hf`."""
    src, dst = f"model.layers.{i}.self_attn.", f"layers.{i}.mixer."
    H, D = m.num_attention_heads, m.head_dim
    qg = hf[src + "q_proj.weight"].view(H, 2, D, -1)
    q, gate = qg[:, 0].reshape(H * D, -1), qg[:, 1].reshape(H * D, -1)
    return {
        dst + "qkv.weight": torch.cat([q, hf[src + "k_proj.weight"], hf[src + "v_proj.weight"], gate]),
        dst + "proj.weight": hf[src + "o_proj.weight"],
        dst + "q_norm.weight": hf[src + "q_norm.weight"],
        dst + "k_norm.weight": hf[src + "k_norm.weight"],
    }


def gdn_to_hf(state: Reads, cfg, i: int, grouped: bool) -> dict[str, torch.Tensor]:
    """Layer i's GDN under Qwen's names: `grouped` (Qwen3-Next) fuses in_proj_qkvz / in_proj_ba per key head."""
    src, dst, h = f"layers.{i}.mixer.", f"model.layers.{i}.linear_attn.", Heads(cfg)
    q, k, v, z, a, b = state[src + "proj_in.weight"].split(h.sections, dim=0)
    out = {
        dst + "conv1d.weight": state[src + "conv"].unsqueeze(1),
        dst + "A_log": state[src + "A_log"],
        dst + "dt_bias": state[src + "dt_bias"],
        dst + "norm.weight": _shared_norm(gain(state[src + "head_norm"], cfg.model), h, f"layers.{i}"),
        dst + "out_proj.weight": state[src + "proj_out.weight"],
    }
    if grouped:
        by_key_head = [
            q.view(h.hk, h.dk, -1),
            k.view(h.hk, h.dk, -1),
            v.view(h.hk, -1, v.shape[1]),
            z.view(h.hk, -1, z.shape[1]),
        ]
        out[dst + "in_proj_qkvz.weight"] = torch.cat(by_key_head, dim=1).reshape(-1, q.shape[1])
        out[dst + "in_proj_ba.weight"] = torch.cat([b.view(h.hk, h.r, -1), a.view(h.hk, h.r, -1)], 1).flatten(0, 1)
        return out
    out[dst + "in_proj_qkv.weight"] = torch.cat([q, k, v])
    out |= {dst + "in_proj_z.weight": z, dst + "in_proj_b.weight": b, dst + "in_proj_a.weight": a}
    return out


def gdn_from_hf(hf: Reads, cfg, i: int, grouped: bool, norm_numel: int) -> dict[str, torch.Tensor]:
    """The inverse of `gdn_to_hf` (norm_numel: our head norm's size, [Dv] or one copy per value head)."""
    src, dst, h = f"model.layers.{i}.linear_attn.", f"layers.{i}.mixer.", Heads(cfg)
    if grouped:
        hidden = hf[src + "in_proj_qkvz.weight"].shape[1]
        qkvz = hf[src + "in_proj_qkvz.weight"].view(h.hk, -1, hidden)
        q, k, v, z = (t.reshape(-1, hidden) for t in qkvz.split([h.dk, h.dk, h.r * h.dv, h.r * h.dv], dim=1))
        b, a = (t.reshape(-1, hidden) for t in hf[src + "in_proj_ba.weight"].view(h.hk, 2, h.r, hidden).unbind(1))
    else:
        q, k, v = hf[src + "in_proj_qkv.weight"].split(h.sections[:3], dim=0)
        z, b, a = hf[src + "in_proj_z.weight"], hf[src + "in_proj_b.weight"], hf[src + "in_proj_a.weight"]
    norm = hf[src + "norm.weight"].float()  # the plain gain g, held as it is (the import's --gdn-out-norm rmsnorm)
    return {
        dst + "proj_in.weight": torch.cat([q, k, v, z, a, b]),
        dst + "conv": hf[src + "conv1d.weight"].squeeze(1),
        dst + "A_log": hf[src + "A_log"],
        dst + "dt_bias": hf[src + "dt_bias"],
        dst + "head_norm": norm.repeat(norm_numel // norm.numel()),
        dst + "proj_out.weight": hf[src + "out_proj.weight"],
    }


def gain(weight: torch.Tensor, m) -> torch.Tensor:
    """The GDN output norm's gain g from our weight: 1 + w where it is zero-centred (ModelConfig.gdn_norm), else w;
    Qwen's RMSNormGated stores g itself."""
    return weight + 1 if m.gdn_norm[1] else weight


def _shared_norm(weight: torch.Tensor, h: Heads, where: str) -> torch.Tensor:
    """Qwen's one [Dv] GDN norm weight from ours ([Dv], or one copy per value head that must all be equal)."""
    if weight.numel() == h.dv:
        return weight
    per_head = weight.view(-1, h.dv)
    if not per_head.is_meta and not bool((per_head == per_head[0]).all()):  # meta: hf.py's expected shapes
        raise ConversionError(
            f"{where}'s GDN head norm differs between heads; Qwen's holds one [{h.dv}] weight for every head"
        )
    return per_head[0]


def mlp_to_hf(state: Reads, m, i: int) -> dict[str, torch.Tensor]:
    """Layer i's MLP: a dense SwiGLU, or the router, the routed experts and the gated shared expert."""
    src, dst = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if not m.is_moe_layer(i):
        return _swiglu_to_hf(state, src, dst, m.ffn_size)
    out = {dst + "gate.weight": state[src + "router.weight"]}
    out |= experts_to_hf(state, m, i, dst + "experts", EXPERT_NAMES)
    out |= _swiglu_to_hf(state, src + "shared_expert.", dst + "shared_expert.", m.moe_shared_expert_intermediate_size)
    return out | {dst + "shared_expert_gate.weight": state[src + "shared_expert.gate.weight"]}


def mlp_from_hf(hf: Reads, m, i: int) -> dict[str, torch.Tensor]:
    """The inverse of `mlp_to_hf`."""
    src, dst = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
    if not m.is_moe_layer(i):
        return _swiglu_from_hf(hf, src, dst)
    out = {dst + "router.weight": hf[src + "gate.weight"]}
    out |= experts_from_hf(hf, m, i, src + "experts", EXPERT_NAMES)
    out |= _swiglu_from_hf(hf, src + "shared_expert.", dst + "shared_expert.")
    return out | {dst + "shared_expert.gate.weight": hf[src + "shared_expert_gate.weight"]}


def _swiglu_to_hf(state: Reads, src: str, dst: str, width: int) -> dict[str, torch.Tensor]:
    gate, up = state[src + "fc1.weight"].split([width, width], dim=0)
    return {
        dst + "gate_proj.weight": gate,
        dst + "up_proj.weight": up,
        dst + "down_proj.weight": state[src + "fc2.weight"],
    }


def _swiglu_from_hf(hf: Reads, src: str, dst: str) -> dict[str, torch.Tensor]:
    fc1 = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]])
    return {dst + "fc1.weight": fc1, dst + "fc2.weight": hf[src + "down_proj.weight"]}


def to_hf(state: dict, cfg, grouped: bool) -> dict[str, torch.Tensor]:
    """Our single-rank names -> Qwen's (zero-centred norms as they are: hf.py leaves them unfolded)."""
    state, cfg = zero_centred(state, cfg)
    m, state = cfg.model, Reads(state)
    out = top_level(state, m)
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "norm1.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "norm2.weight"]
        mixer = attention_to_hf(state, m, i) if m.layer_kind(i) == "softmax" else gdn_to_hf(state, cfg, i, grouped)
        out |= mixer | mlp_to_hf(state, m, i)
    return state.finished(out)


def from_hf(hf: dict, cfg, grouped: bool) -> dict[str, torch.Tensor]:
    """Qwen's names -> our single-rank names: the inverse of `to_hf` (the MTP tensors left out by hf.py)."""
    m, hf = cfg.model, Reads(hf)
    out = top_level_from(hf, m)
    norm_numel = _head_norm_numel(cfg)
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "norm1.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "norm2.weight"] = hf[src + "post_attention_layernorm.weight"]
        softmax = m.layer_kind(i) == "softmax"
        out |= attention_from_hf(hf, m, i) if softmax else gdn_from_hf(hf, cfg, i, grouped, norm_numel)
        out |= mlp_from_hf(hf, m, i)
    if left := sorted(set(hf) - hf.read):
        raise ConversionError(f"tensors this model does not have: {', '.join(left[:3])}")
    return {k: v.float().contiguous() for k, v in out.items()}


def _head_norm_numel(cfg) -> int:
    """Our GDN head norm's size: the layer's own (one [Dv] weight, or one per value head before it shared one)."""
    if not any(cfg.model.layer_kind(i) == "gdn" for i in range(cfg.model.num_layers)):
        return 0
    from ...config import ConfigError
    from ...validation import validate
    from ..layout import model_shapes

    try:
        built = validate(copy.deepcopy(cfg), 1, run=False)
    except ConfigError as e:
        raise ConversionError(f"config.json describes a model we cannot build: {str(e).splitlines()[0]}") from None
    first = next(i for i in range(cfg.model.num_layers) if cfg.model.layer_kind(i) == "gdn")
    return int(torch.Size(model_shapes(built, cfg.model.vocab_size)[f"layers.{first}.mixer.head_norm"]).numel())


def config_json(cfg, vocab: int, architecture: str, model_type: str) -> dict:
    """The config.json keys Qwen3-Next and Qwen3.5 write alike (the decoder's, the GDN's, the layer pattern)."""
    m, h = cfg.model, None
    if any(m.layer_kind(i) == "gdn" for i in range(m.num_layers)):
        h = Heads(cfg)
    out = {
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
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": m.rotary_base,
            "partial_rotary_factor": m.rotary_percent,
        },
        "max_position_embeddings": m.max_position_embeddings or m.seq_length,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": [FULL if m.layer_kind(i) == "softmax" else LINEAR for i in range(m.num_layers)],
        "linear_conv_kernel_dim": 4,
        "initializer_range": m.init_method_std,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    if h is not None:
        out |= {
            "linear_num_key_heads": h.hk,
            "linear_num_value_heads": h.hv,
            "linear_key_head_dim": h.dk,
            "linear_value_head_dim": h.dv,
            "linear_conv_kernel_dim": cfg.model.mixer_of_kind("gdn").conv_kernel,
        }
    return out


def config_from(hf: dict, model_type: str):
    """Our Config of a Qwen3-Next/Qwen3.5 config.json (the decoder, GDN and layer pattern; the MLPs: the caller's)."""
    if hf.get("model_type") != model_type:
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not {model_type}")
    kinds = layer_types(hf)
    period = _hybrid_period(kinds, "gdn") if set(kinds) <= {LINEAR, FULL} else None
    rope = hf.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    why = [
        w
        for w, bad in [
            (f"layer_types {kinds}: softmax attention is not at every K-th layer (K-1, 2K-1, ...)", period is None),
            (
                f"num_hidden_layers {hf['num_hidden_layers']} but {len(kinds)} layer_types",
                len(kinds) != hf["num_hidden_layers"],
            ),
            (f"hidden_act {hf.get('hidden_act')!r} is not silu", hf.get("hidden_act", "silu") != "silu"),
            ("it has attention biases", bool(hf.get("attention_bias"))),
            (
                f"linear_conv_kernel_dim {hf.get('linear_conv_kernel_dim')} is not our GDN's 4",
                hf.get("linear_conv_kernel_dim", 4) != 4,
            ),
        ]
        if bad
    ]
    if why:
        raise ConversionError("; ".join(why))
    cfg = decoder_config(hf | {"intermediate_size": hf.get("intermediate_size") or hf.get("moe_intermediate_size")})
    m = cfg.model
    assert period is not None
    m.attention_type, m.softmax_attention_every = period
    m.norm_epsilon, m.rotary_base, m.rotary_percent = hf.get("rms_norm_eps", 1e-6), rope_theta(_plain(hf)), partial
    m.untie_embeddings_and_output_weights = not hf.get("tie_word_embeddings", False)
    m.normalization, m.activation, m.position_embedding_type, m.add_bias_linear = "RMSNorm", "swiglu", "rope", False
    m.apply_layernorm_1p = True
    m.gdn_out_norm = "rmsnorm"  # Qwen's RMSNormGated holds the plain gain: taken as it is, bitwise both ways
    m.qk_layernorm = m.attention_output_gate = FULL in kinds  # theirs on every softmax layer
    m.attention_dropout = float(hf.get("attention_dropout", 0.0))
    m.init_method_std = hf.get("initializer_range", m.init_method_std)
    if m.attention_type == "gdn":
        m.linear_num_key_heads, m.linear_num_value_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        m.linear_key_head_dim, m.linear_value_head_dim = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        m.linear_conv_kernel_dim = hf.get("linear_conv_kernel_dim", 4)
        m.gdn_head_norm = "shared"  # one [Dv] weight for every head, as theirs
    return cfg


def layer_types(hf: dict) -> list:
    """config.json's layer_types, or (the hub's Qwen3-Next files, written before transformers 5) the pattern its
    full_attention_interval gives, as transformers derives it."""
    if "layer_types" in hf:
        return list(hf["layer_types"])
    every = hf.get("full_attention_interval", 4)
    return [LINEAR if (i + 1) % every else FULL for i in range(hf["num_hidden_layers"])]


def _plain(hf: dict) -> dict:
    """config.json with Qwen3.5's multimodal RoPE keys dropped: text positions are the same on its three axes
    (mrope_section), so the rotation is plain RoPE."""
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if not k.startswith("mrope")}
    return hf | {"rope_parameters": rope}


def moe_config(cfg, hf: dict, pattern: list[int]) -> None:
    """Our experts from Qwen's MoE keys (`pattern`: one 1 (sparse) or 0 (dense) per layer)."""
    m = cfg.model
    experts = hf["num_experts"]
    if not (isinstance(experts, int) and experts > 0):
        raise ConversionError(f"num_experts {experts!r} is not a positive integer")
    m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = (
        experts,
        hf["moe_intermediate_size"],
        hf["num_experts_per_tok"],
    )
    m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate = hf["shared_expert_intermediate_size"], True
    m.moe_layer_freq = "1" if all(pattern) else str(pattern)
    m.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.0))


def moe_json(cfg) -> dict:
    m = cfg.model
    return {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.expert_ffn_size,
        "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
