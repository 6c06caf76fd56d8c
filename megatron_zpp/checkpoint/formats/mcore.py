"""megatron-core's GPTModel (local spec; its Gated DeltaNet hybrids) in its torch_dist checkpoints' global keys, and
Megatron-LM's args.

    to_theirs(state, cfg)      # our single-rank tensors (weights, or one Adam moment of each) -> its keys
    from_theirs(tensors, cfg)  # and back
    config_from_args(args, rows) / args_from_config(cfg, ...)   # Megatron-LM's args <-> our Config

The keys and the qkv row order are described in checkpoint/mcore.py, which reads and writes the directories.
"""

from __future__ import annotations

import argparse

import torch

from ...config.moe import moe_layer_pattern
from ..files import CheckpointError
from . import mcore_gdn
from .base import block_refusals
from .mcore_gdn import gdn_from_mcore, gdn_to_mcore

NAME = "mcore"
# our per-layer suffix -> megatron-core's stacked key (local spec names)
LAYER_KEYS = {
    "norm1.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "norm1.bias": "decoder.layers.self_attention.linear_qkv.layer_norm_bias",
    "mixer.qkv.weight": "decoder.layers.self_attention.linear_qkv.weight",
    "mixer.qkv.bias": "decoder.layers.self_attention.linear_qkv.bias",
    "mixer.proj.weight": "decoder.layers.self_attention.linear_proj.weight",
    "mixer.proj.bias": "decoder.layers.self_attention.linear_proj.bias",
    "mixer.q_norm.weight": "decoder.layers.self_attention.q_layernorm.weight",
    "mixer.q_norm.bias": "decoder.layers.self_attention.q_layernorm.bias",
    "mixer.k_norm.weight": "decoder.layers.self_attention.k_layernorm.weight",
    "mixer.k_norm.bias": "decoder.layers.self_attention.k_layernorm.bias",
    "norm2.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    "norm2.bias": "decoder.layers.mlp.linear_fc1.layer_norm_bias",
    "mlp.fc1.weight": "decoder.layers.mlp.linear_fc1.weight",
    "mlp.fc1.bias": "decoder.layers.mlp.linear_fc1.bias",
    "mlp.fc2.weight": "decoder.layers.mlp.linear_fc2.weight",
    "mlp.fc2.bias": "decoder.layers.mlp.linear_fc2.bias",
}
TOP_KEYS = {
    "embedding.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
    "final_norm.weight": "decoder.final_layernorm.weight",
    "final_norm.bias": "decoder.final_layernorm.bias",
    "output.weight": "output_layer.weight",
}
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
LAYERS = "decoder.layers."
# an MoE layer (megatron-core's MoELayer): our per-layer suffix -> its layer suffix, beside the attention's keys
MOE_KEYS = {
    "mlp.router.weight": "mlp.router.weight",  # [E, H], as ours
    "mlp.router.expert_bias": "mlp.router.expert_bias",  # a buffer [E] (--moe-router-enable-expert-bias)
    "mlp.shared_expert.fc1.weight": "mlp.shared_experts.linear_fc1.weight",  # [gate | up] rows, as the dense fc1
    "mlp.shared_expert.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert.gate.weight": "mlp.shared_experts.gate_weight",  # [1, H]
}
# the routed experts, SequentialMLP's and TEGroupedMLP's common sharded key (their sharded_state_dict maps
# local_experts.{e}.linear_fc1.weight and linear_fc1.weight{e} alike to it): [E, 2F, H] and [E, H, F], the
# global expert index on the first dimension; ours are one tensor per expert in the x @ W orientation
EXPERTS = {"fc1": "mlp.experts.experts.linear_fc1.weight", "fc2": "mlp.experts.experts.linear_fc2.weight"}
# an MoE layer's pre-MLP norm: Transformer Engine's spec keeps its own pre_mlp_layernorm (no fused norm+linear
# in front of the router); the local spec renames it into the fc1 slot (its sharded_state_dict_keys_map)
PRE_MLP_NORM = {"transformer_engine": "pre_mlp_layernorm.", "local": "mlp.linear_fc1.layer_norm_"}
MOE_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
# a Gated DeltaNet layer: megatron-core's GatedDeltaNet (--experimental-attention-variant gated_delta_net) under
# `self_attention.`, the input norm fused into its in_proj as Transformer Engine's spec builds it (norm1 -> its
# in_proj.layer_norm_*); the mixer's tensors map as gdn_to_mcore says, but that its sharded_state_dict saves the
# fused in_proj (q | k | v | z | beta | alpha on each TP rank) and the conv1d (q | k | v) one tensor per section,
# `<key>.<section>`, each with all TP ranks' rows of it (global, TP-independent)
GDN = "self_attention."
GDN_NORM = {"norm1.weight": GDN + "in_proj.layer_norm_weight", "norm1.bias": GDN + "in_proj.layer_norm_bias"}
GDN_SECTIONS = {
    "in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "conv1d.weight": ("query", "key", "value"),
}
GDN_WHOLE = ("A_log", "dt_bias", "out_norm.weight", "out_proj.weight")
GDN_BIAS = "out_norm.bias"  # a LayerNorm output norm's (--normalization LayerNorm)
GDN_LINEARS = ("self_attention.in_proj", "self_attention.out_proj")


def unsupported(cfg) -> list[str]:
    """Why our model has no megatron-core GPTModel twin (empty when it has): softmax attention, and Gated
    DeltaNet layers as --experimental-attention-variant gated_delta_net builds them."""
    m = cfg.model
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    other = sorted(kinds - {"softmax", "gdn"})
    if other:
        return [
            f"its layers are {'/'.join(k.upper() for k in other)}; megatron-core's GPTModel has softmax attention "
            "and gated delta net layers only"
        ]
    why = block_refusals(cfg, "megatron-core's GPTModel")
    if "gdn" not in kinds:
        return why
    if m.gdn_norm != (m.normalization, m.apply_layernorm_1p):  # its out_norm follows them; ours a plain RMSNorm
        why.append(f"--gdn-out-norm rmsnorm: megatron-core's gated delta net output norm follows --normalization "
                   f"{m.normalization}" + (" and --apply-layernorm-1p" if m.apply_layernorm_1p else ""))  # fmt: skip
    if m.gdn_head_norm != "shared":
        why.append(f"--gdn-head-norm {m.gdn_head_norm}: megatron-core's gated delta net output norm is one weight "
                   "shared by the heads (--gdn-head-norm shared)")  # fmt: skip
    return why


def linear_pattern(m) -> list[int]:
    """megatron-core's per-layer pattern of our model (1: gated delta net, 0: softmax attention), as its
    get_linear_attention_pattern reads --linear-attention-freq."""
    return [int(m.layer_kind(i) == "gdn") for i in range(m.num_layers)]


def stacked(m) -> bool:
    """Whether megatron-core stacks the layers' tensors under one key along a first dimension of num_layers
    (its TransformerBlock.sharded_state_dict), or, its layers differing (--moe-layer-freq or
    --linear-attention-freq an integer above 1 or a list, whatever the list holds), keys each layer's own:
    decoder.layers.{i}.<name>."""
    if any(linear_pattern(m)):
        return False
    if not m.num_experts:
        return True
    text = str(m.moe_layer_freq).strip()
    return "[" not in text and int(text) == 1


def transformer_impl(tensors) -> str:
    """The spec that wrote megatron-core `tensors` (its MoE layers' pre-MLP norm names it; dense: either)."""
    return "transformer_engine" if any(".pre_mlp_layernorm." in k for k in tensors) else "local"


def _qkv_sizes(m) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    return m.kv_heads, m.num_attention_heads // m.kv_heads, m.head_dim


def qkv_to_mcore(w: torch.Tensor, m) -> torch.Tensor:
    """Our [q | k | v (| gate)] rows -> megatron-core's rows grouped per query group: its q heads (their output
    gates with --attention-output-gate), its k head, its v head."""
    g, per, d = _qkv_sizes(m)
    rest, gates = w.shape[1:], m.attention_output_gate
    q, k, v, gate = w.split([g * per * d, g * d, g * d, g * per * d if gates else 0])
    parts = [q.reshape(g, per * d, *rest)] + ([gate.reshape(g, per * d, *rest)] if gates else [])
    return torch.cat(parts + [k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1).reshape(w.shape)


def qkv_from_mcore(w: torch.Tensor, m) -> torch.Tensor:
    """The inverse of `qkv_to_mcore`."""
    g, per, d = _qkv_sizes(m)
    rest, gate_rows = w.shape[1:], per * d if m.attention_output_gate else 0
    q, gate, k, v = w.reshape(g, per * d + gate_rows + 2 * d, *rest).split([per * d, gate_rows, d, d], 1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, gate)])


def _layer_names(m, i: int, impl: str) -> dict[str, str]:
    """{our suffix: megatron-core's layer name} of layer i's tensors but the routed experts' and a GDN layer's
    mixer (`_gdn_to`)."""
    moe, gdn = m.is_moe_layer(i), m.layer_kind(i) == "gdn"
    names = {}
    for suffix, key in LAYER_KEYS.items():
        if moe and suffix.startswith("mlp.") or gdn and suffix.startswith(("norm1.", "mixer.")):
            continue  # no dense MLP; no softmax attention
        if moe and suffix.startswith("norm2."):
            names[suffix] = PRE_MLP_NORM[impl] + suffix[len("norm2.") :]
        else:
            names[suffix] = key[len(LAYERS) :]
    return names | (MOE_KEYS if moe else {}) | (GDN_NORM if gdn else {})


def _gdn_whole(m) -> tuple[str, ...]:
    """megatron-core's GDN tensors saved whole: with its LayerNorm out_norm's bias where it has one."""
    return GDN_WHOLE + ((GDN_BIAS,) if m.gdn_norm[0] == "LayerNorm" else ())


def _gdn_names(m) -> list[str]:
    """megatron-core's layer names of a GDN layer's mixer tensors (its sectioned ones cut)."""
    cut = [f"{GDN}{key}.{name}" for key, sections in GDN_SECTIONS.items() for name in sections]
    return cut + [GDN + name for name in _gdn_whole(m)]


def _gdn_rows(m) -> dict[str, list[int]]:
    """The rows of megatron-core's sections (GDN_SECTIONS) at full shapes: ours, its beta and alpha (one row per
    value head each) where our a and b are."""
    sections = m.mixer_of_kind("gdn").sections
    return {"in_proj.weight": list(sections), "conv1d.weight": list(sections[:3])}


def _gdn_to(state: dict, m, i: int) -> dict[str, torch.Tensor]:
    """GDN layer i's mixer of our `state` -> {megatron-core's layer name: tensor}, its fused tensors cut into the
    sections it saves; {} when the state holds none of it."""
    src = f"layers.{i}.mixer."
    ours = {k[len(src) :]: t for k, t in state.items() if k.startswith(src)}
    if not ours:
        return {}
    if lost := sorted(set(mcore_gdn.names(m)) - set(ours)):
        raise CheckpointError(f"the checkpoint holds no {src}{lost[0]}, which the model of its config has")
    out = {}
    for name, t in gdn_to_mcore(ours, m).items():
        if name in GDN_SECTIONS:
            out.update({f"{GDN}{name}.{s}": p for s, p in zip(GDN_SECTIONS[name], t.split(_gdn_rows(m)[name]))})
        else:
            out[GDN + name] = t
    return out


def _gdn_from(layer: dict[str, torch.Tensor], m, i: int) -> dict[str, torch.Tensor]:
    """The inverse of `_gdn_to` (megatron-core's layer i by its layer names); {} unless it holds all of it."""
    if not all(name in layer for name in _gdn_names(m)):
        return {}
    theirs = {name: layer[GDN + name] for name in _gdn_whole(m)}
    for name, sections in GDN_SECTIONS.items():
        theirs[name] = torch.cat([layer[f"{GDN}{name}.{s}"] for s in sections])
    return {f"layers.{i}.mixer.{k}": t for k, t in gdn_from_mcore(theirs, m).items()}


def _layer_to(state: dict, m, i: int, impl: str) -> dict[str, torch.Tensor]:
    """Layer i of our state as {megatron-core's layer name: tensor}."""
    src, out = f"layers.{i}.", {}
    for suffix, name in _layer_names(m, i, impl).items():
        if (t := state.get(src + suffix)) is not None:
            out[name] = qkv_to_mcore(t, m) if suffix.startswith("mixer.qkv") else t
    if m.layer_kind(i) == "gdn":
        out.update(_gdn_to(state, m, i))
    if not m.is_moe_layer(i):
        return out
    for w, name in EXPERTS.items():
        experts = [state.get(f"{src}mlp.experts.{w}.{e}") for e in range(m.num_experts)]
        if all(t is None for t in experts):
            continue
        if any(t is None for t in experts):  # a damaged checkpoint: name the tensor, not torch.stack's error
            lost = next(e for e, t in enumerate(experts) if t is None)
            raise CheckpointError(f"the checkpoint holds no {src}mlp.experts.{w}.{lost}, which its model has")
        out[name] = torch.stack([t.T for t in experts if t is not None])
    return out


def _layer_from(theirs: dict[str, torch.Tensor], m, i: int) -> dict[str, torch.Tensor]:
    """The inverse of `_layer_to` (either spec's pre-MLP norm name)."""
    src, out = f"layers.{i}.", {}
    names = {}
    for impl in PRE_MLP_NORM:
        names.update({name: suffix for suffix, name in _layer_names(m, i, impl).items()})
    for name, t in theirs.items():
        if name in names:
            suffix = names[name]
            out[src + suffix] = qkv_from_mcore(t, m) if suffix.startswith("mixer.qkv") else t
    if m.layer_kind(i) == "gdn":
        out.update(_gdn_from(theirs, m, i))
    for w, name in EXPERTS.items():
        if m.is_moe_layer(i) and name in theirs:
            out.update({f"{src}mlp.experts.{w}.{e}": t.T for e, t in enumerate(theirs[name].unbind(0))})
    return out


def to_theirs(state: dict[str, torch.Tensor], cfg, impl: str = "transformer_engine") -> dict[str, torch.Tensor]:
    """Our single-rank tensors (weights, or one Adam moment of each) -> megatron-core's global keys; `impl`:
    Megatron-LM's --transformer-impl the checkpoint is for (it names an MoE layer's pre-MLP norm)."""
    m = cfg.model
    out = {TOP_KEYS[k]: v for k, v in state.items() if k in TOP_KEYS}
    layers = [_layer_to(state, m, i, impl) for i in range(m.num_layers)]
    if not stacked(m):
        out.update({f"{LAYERS}{i}.{name}": t for i, layer in enumerate(layers) for name, t in layer.items()})
        return out
    for name in dict.fromkeys(n for layer in layers for n in layer):
        per_layer = [layer.get(name) for layer in layers]
        if any(t is None for t in per_layer):  # a damaged checkpoint: name the tensor, not torch.stack's error
            lost = next(i for i, t in enumerate(per_layer) if t is None)
            ours = {n: s for s, n in _layer_names(m, lost, impl).items()}.get(name, name)
            raise CheckpointError(f"the checkpoint holds no layers.{lost}.{ours}, which the model of its config has")
        out[LAYERS + name] = torch.stack(per_layer)
    return out


def from_theirs(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """megatron-core's global keys -> our single-rank names (the inverse of `to_theirs`; either layout)."""
    m = cfg.model
    top = {v: k for k, v in TOP_KEYS.items()}
    out = {top[k]: v for k, v in tensors.items() if k in top}
    if not m.untie_embeddings_and_output_weights:
        out.pop("output.weight", None)  # a tied copy some layouts write; the embedding is the weight
    layers: list[dict] = [{} for _ in range(m.num_layers)]
    for key, t in tensors.items():
        if not key.startswith(LAYERS):
            continue
        head, _, rest = key[len(LAYERS) :].partition(".")
        if head.isdigit() and int(head) < m.num_layers:  # one layer's own key
            layers[int(head)][rest] = t
        elif not head.isdigit() and t.shape[:1] == (m.num_layers,):  # stacked over the layers
            for i, ti in enumerate(t.unbind(0)):
                layers[i][key[len(LAYERS) :]] = ti
    for i, layer in enumerate(layers):
        out.update(_layer_from(layer, m, i))
    return {k: v.contiguous() for k, v in out.items()}


def model_keys(cfg) -> set[str]:
    """Every megatron-core model key a checkpoint of `cfg`'s model may hold (either spec's names)."""
    m = cfg.model
    if stacked(m):
        names = {n for i in range(m.num_layers) for impl in PRE_MLP_NORM for n in _layer_names(m, i, impl).values()}
        names |= set(EXPERTS.values()) if m.num_experts else set()
        return set(TOP_KEYS.values()) | {LAYERS + n for n in names}
    layer = set()
    for i in range(m.num_layers):
        names = {n for impl in PRE_MLP_NORM for n in _layer_names(m, i, impl).values()}
        names |= set(_gdn_names(m)) if m.layer_kind(i) == "gdn" else set()
        names |= set(EXPERTS.values()) if m.is_moe_layer(i) else set()
        layer |= {f"{LAYERS}{i}.{n}" for n in names}
    return set(TOP_KEYS.values()) | layer


def extra_state_keys(m) -> list[str]:
    """The DCP keys of the None `_extra_state` object megatron-core's local spec saves per linear (the routed
    experts' one per expert), as its ShardedObject.unique_key names them."""
    keys = []
    for i in range(m.num_layers):
        moe = m.is_moe_layer(i)
        mixer = GDN_LINEARS if m.layer_kind(i) == "gdn" else LINEARS[:2]
        linears = mixer + ((MOE_LINEARS if m.moe_shared_expert_intermediate_size else ()) if moe else LINEARS[2:])
        at, shape = (LAYERS, f"{i}_{m.num_layers}") if stacked(m) else (f"{LAYERS}{i}.", "0_1")
        keys += [f"{at}{linear}._extra_state/shard_{shape}" for linear in linears]
        if moe:
            e_at = f"{i}.{{e}}_{m.num_layers}.{m.num_experts}" if stacked(m) else f"{{e}}_{m.num_experts}"
            keys += [f"{at}{linear}._extra_state/shard_{e_at.format(e=e)}" for linear in EXPERT_LINEARS
                     for e in range(m.num_experts)]  # fmt: skip
    return keys


# ---- the run's settings: Megatron-LM's args <-> our config ----------------------------------
TRAIN_FIELDS = ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "seed", "bf16", "fp16")
REFUSED_ARGS = {  # Megatron-LM args (their value when set) that no tensor of ours can hold
    "moe_apply_probs_on_input": "the routing probabilities scale the experts' output here, not their input",
    "moe_latent_size": "latent MoE projections are not built here",
    "moe_shared_expert_glu_interleave_size": "the shared expert's fc1 rows are [gate | up] here, not interleaved",
    "moe_mlp_glu_interleave_size": "the experts' fc1 rows are [gate | up] here, not interleaved",
    "multi_latent_attention": "multi-latent attention is not built here",
    "mtp_num_layers": "multi-token prediction is not built here",
    "hybrid_layer_pattern": "Megatron's HybridModel (its Mamba/GDN/attention/MLP layers by pattern) is not converted "
    "here; its GPTModel's gated delta net hybrids are (--experimental-attention-variant gated_delta_net)",
}


def refused_args(args: argparse.Namespace) -> list[str]:
    """Megatron-LM args of a checkpoint that no model of ours holds, one reason each."""
    why = [
        f"--{k.replace('_', '-')} {getattr(args, k)}: {r}" for k, r in REFUSED_ARGS.items() if getattr(args, k, None)
    ]
    score = getattr(args, "moe_router_score_function", None) if getattr(args, "num_experts", None) else None
    if score not in (None, "softmax", "sigmoid"):
        why.append(f"--moe-router-score-function {score}: the router scores by softmax or sigmoid here")
    variant = getattr(args, "experimental_attention_variant", None)
    if variant not in (None, "gated_delta_net"):
        why.append(f"--experimental-attention-variant {variant}: only gated_delta_net is built here")
    elif variant and isinstance(freq := getattr(args, "linear_attention_freq", None), list) and _period(freq) is None:
        why.append(f"--linear-attention-freq {freq}: only a period (softmax attention on every N-th layer) is built")
    return why


def _period(pattern: list) -> int | None:
    """Our --softmax-attention-every of megatron-core's per-layer pattern (1: gated delta net, 0: softmax
    attention): 0 when it has no softmax layer; None when no period gives it."""
    if all(pattern):
        return 0
    k = list(pattern).index(0) + 1
    return k if list(pattern) == [int((i + 1) % k != 0) for i in range(len(pattern))] else None


def moe_layer_freq(freq) -> str:
    """Megatron's parsed --moe-layer-freq (an int, or the list its parser evaluated) as our flag's text."""
    return str(list(freq)) if isinstance(freq, (list, tuple)) else str(int(freq))


def _take(section, name: str, value) -> None:
    """Set our setting `name` to Megatron's `value` when the types agree (an int where we hold a float too)."""
    ours = getattr(section, name)
    if ours is None and isinstance(value, (int, float, str, bool)) or type(value) is type(ours):
        setattr(section, name, value)
    elif type(ours) is float and type(value) is int:
        setattr(section, name, float(value))


def config_from_args(args: argparse.Namespace, rows: int):
    """Our Config of the run a Megatron-LM checkpoint's `args` describe (`rows`: its embedding's padded
    vocabulary); our settings are Megatron's names, so every one the args hold is taken."""
    from ...config import Config

    cfg = Config()
    given = {k: v for k, v in vars(args).items() if v is not None}
    for section, names in ((cfg.model, [*vars(cfg.model)]), (cfg.optim, [*vars(cfg.optim)]), (cfg.train, TRAIN_FIELDS)):
        for name in names:
            if name in given:
                _take(section, name, given[name])
    m = cfg.model
    m.activation = "swiglu" if given.get("swiglu") else "squared_relu" if given.get("squared_relu") else "gelu"
    if m.num_query_groups is not None and not given.get("group_query_attention"):
        m.num_query_groups = None  # Megatron ignores it then
    if not given.get("experimental_attention_variant"):  # its GDN shapes (always in its args) are read only then
        for name in [n for n in vars(m) if n.startswith("linear_")]:
            setattr(m, name, None)
    elif given["experimental_attention_variant"] == "gated_delta_net":
        freq = given.get("linear_attention_freq")
        m.attention_type = "gdn"
        m.softmax_attention_every = (_period(freq) or 0) if isinstance(freq, list) else int(freq or 0)
    if given.get("moe_layer_freq") is not None:
        m.moe_layer_freq = moe_layer_freq(given["moe_layer_freq"])
    if not given.get("add_position_embedding", True) and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"
    pad = m.make_vocab_size_divisible_by * given.get("tensor_model_parallel_size", 1)
    if -(-m.vocab_size // pad) * pad != rows:  # not the padding of the args' vocabulary: the rows themselves
        m.vocab_size, m.make_vocab_size_divisible_by = rows, 1
    cfg.train.ckpt_format = "torch_dist"
    return cfg


def args_from_config(
    cfg, iteration: int, consumed: int, rows: int, with_optimizer: bool = True, impl: str = "transformer_engine"
) -> argparse.Namespace:
    """Megatron-LM's args of our run, as its checkpoints pickle them: our settings under their own (Megatron's)
    names, then every arg that Megatron-LM's `load_checkpoint` (`check_checkpoint_args`, RNG and optimizer
    choices) and `load_args_from_checkpoint` read, valued as Megatron-LM's parser and `validate_args` give them
    for the command line of this model (tests/checkpoint/test_mcore_megatron_lm.py holds them to that parser)."""
    ns = {k: v for section in cfg.to_dict().values() for k, v in section.items()}
    m, d = cfg.model, cfg.data
    ns.update(
        # no tokenizer flag given (mock data: we infer NullTokenizer): Megatron's parser leaves it None
        tokenizer_type=None
        if d.tokenizer_type_inferred and not (d.vocab_file or d.tokenizer_model)
        else d.tokenizer_type,
        swiglu=m.activation == "swiglu",
        squared_relu=m.activation == "squared_relu",
        # Megatron keeps this True unless --no-position-embedding, which validate_args refuses but with RoPE;
        # no positions at all are --position-embedding-type none there too
        add_position_embedding=True,
        use_rotary_position_embeddings=False,  # the deprecated flag: --position-embedding-type rope says it
        num_query_groups=m.kv_heads if m.group_query_attention else 1,  # Megatron's default when not GQA
        add_qkv_bias=m.add_bias_linear or m.add_qkv_bias,  # validate_args: --add-bias-linear implies it
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_size,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,  # a flag Megatron requires
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,  # type=int there
        apply_query_key_layer_scaling=False,
        padded_vocab_size=rows,
        iteration=iteration,
        consumed_train_samples=consumed,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        ckpt_format="torch_dist",
        use_distributed_optimizer=False,
        data_parallel_random_init=False,
        no_save_optim=None if with_optimizer else True,  # as --no-save-optim writes (load with --no-load-optim)
        no_save_rng=True,  # no RNG state is written: Megatron's load then starts its streams from the seed
        params_dtype=torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32,
    )
    text = str(m.moe_layer_freq).strip()  # as Megatron-LM's parser gives it: an int, or the list it evaluated
    ns["moe_layer_freq"] = int(text) if "[" not in text else moe_layer_pattern(text, m.num_layers)
    if m.num_experts:  # validate_args' default width; the spec whose MoE layers' pre-MLP norm key it holds
        ns.update(moe_ffn_hidden_size=m.expert_ffn_size, transformer_impl=impl)
    if any(pattern := linear_pattern(m)):
        ns.update(_gdn_args(m, pattern))
    return argparse.Namespace(**ns)


def _gdn_args(m, pattern: list[int]) -> dict:
    """Megatron-LM's gated delta net args of our GDN layers: the variant, the layer pattern (our period, or
    without one the list its parser evaluates) and the shapes."""
    g, k = m.gdn_heads, m.softmax_attention_every
    return {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": k or pattern,
        "linear_conv_kernel_dim": m.mixer_of_kind("gdn").conv_kernel,
        "linear_key_head_dim": g.key_dim,
        "linear_value_head_dim": g.value_dim,
        "linear_num_key_heads": g.key_heads,
        "linear_num_value_heads": g.value_heads,
    }


to_mcore, from_mcore = to_theirs, from_theirs  # the names checkpoint/mcore.py and its tests use
