"""megatron-core's GPTModel (local spec) in its torch_dist checkpoints' global keys, and Megatron-LM's args.

    to_theirs(state, cfg)      # our single-rank tensors (weights, or one Adam moment of each) -> its keys
    from_theirs(tensors, cfg)  # and back
    config_from_args(args, rows) / args_from_config(cfg, ...)   # Megatron-LM's args <-> our Config

The keys and the qkv row order are described in checkpoint/mcore.py, which reads and writes the directories.
"""

from __future__ import annotations

import argparse

import torch

from ..files import CheckpointError

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


def unsupported(cfg) -> list[str]:
    """Why our model has no megatron-core GPTModel (local spec) twin (empty when it has)."""
    m = cfg.model
    kinds = {m.layer_kind(i) for i in range(m.num_layers)}
    if kinds == {"softmax"}:
        return []
    return [f"its layers are {'/'.join(sorted(kinds))}; megatron-core's GPTModel has softmax attention only"]


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


def to_theirs(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Our single-rank tensors (weights, or one Adam moment of each) -> megatron-core's global keys."""
    m = cfg.model
    out = {TOP_KEYS[k]: v for k, v in state.items() if k in TOP_KEYS}
    for suffix, key in LAYER_KEYS.items():
        per_layer = [state.get(f"layers.{i}.{suffix}") for i in range(m.num_layers)]
        if all(t is None for t in per_layer):
            continue
        if any(t is None for t in per_layer):  # a damaged checkpoint: name the tensor, not torch.stack's error
            lost = next(i for i, t in enumerate(per_layer) if t is None)
            raise CheckpointError(f"the checkpoint holds no layers.{lost}.{suffix}, which the model of its config has")
        if suffix.startswith("mixer.qkv"):
            per_layer = [qkv_to_mcore(t, m) for t in per_layer]
        out[key] = torch.stack(per_layer)
    return out


def from_theirs(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """megatron-core's global keys -> our single-rank names (the inverse of `to_theirs`)."""
    m = cfg.model
    top = {v: k for k, v in TOP_KEYS.items()}
    out = {top[k]: v for k, v in tensors.items() if k in top}
    if not m.untie_embeddings_and_output_weights:
        out.pop("output.weight", None)  # a tied copy some layouts write; the embedding is the weight
    for suffix, key in LAYER_KEYS.items():
        if key not in tensors:
            continue
        for i, t in enumerate(tensors[key].unbind(0)):
            out[f"layers.{i}.{suffix}"] = qkv_from_mcore(t, m) if suffix.startswith("mixer.qkv") else t
    return {k: v.contiguous() for k, v in out.items()}


# ---- the run's settings: Megatron-LM's args <-> our config ----------------------------------
TRAIN_FIELDS = ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "seed", "bf16", "fp16")
REFUSED_ARGS = {  # Megatron-LM args (their value when set) that no tensor of ours can hold
    "num_experts": "mixture of experts is not built here",
    "multi_latent_attention": "multi-latent attention is not built here",
    "mtp_num_layers": "multi-token prediction is not built here",
    "experimental_attention_variant": "megatron-core's gated delta net layers are not converted here",
}


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
    if not given.get("add_position_embedding", True) and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"
    pad = m.make_vocab_size_divisible_by * given.get("tensor_model_parallel_size", 1)
    if -(-m.vocab_size // pad) * pad != rows:  # not the padding of the args' vocabulary: the rows themselves
        m.vocab_size, m.make_vocab_size_divisible_by = rows, 1
    cfg.train.ckpt_format = "torch_dist"
    return cfg


def args_from_config(cfg, iteration: int, consumed: int, rows: int, with_optimizer: bool = True) -> argparse.Namespace:
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
    return argparse.Namespace(**ns)


to_mcore, from_mcore = to_theirs, from_theirs  # the names checkpoint/mcore.py and its tests use
