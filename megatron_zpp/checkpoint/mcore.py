"""Megatron-core torch_dist checkpoints (Megatron-LM's `--ckpt-format torch_dist`) to ours and back.

What megatron-core 0.19 writes, read off its own `dist_checkpointing.save` (tests/checkpoint/test_mcore.py):
`iter_NNNNNNN/` holds DCP's `.metadata` and `__<rank>_0.distcp` files and `metadata.json`
({"sharded_backend": "torch_dist", ...}); the common (non-tensor) state is a pickled object under the DCP
key `common_state/shard_0_1` (older versions wrote it to `common.pt`, also read here): `args` (the run's
argparse Namespace), `iteration`, `checkpoint_version`, `opt_param_scheduler` (its `num_steps` counts
samples) and the optimizer's `param_groups` and `state.common_step`. The root's
`latest_checkpointed_iteration.txt` names the iteration. Tensors are global (any TP/PP writes the same
keys; DCP reshards):

* `embedding.word_embeddings.weight`, `embedding.position_embeddings.weight`, `output_layer.weight`
  (untied only), `decoder.final_layernorm.{weight,bias}`;
* the layers stacked along a first dimension of num_layers, keys without the layer number:
  `decoder.layers.self_attention.linear_qkv.{weight,bias,layer_norm_weight,layer_norm_bias}` (the
  local spec files input_layernorm there, as Transformer Engine's fused norm+linear does),
  `...linear_proj.{weight,bias}`, `decoder.layers.mlp.linear_fc1.{weight,bias,layer_norm_weight,
  layer_norm_bias}` (pre_mlp_layernorm), `...linear_fc2.{weight,bias}`, and a None `_extra_state`
  object per linear and layer (`<key>._extra_state/shard_<layer>_<layers>`);
* linear_qkv's rows grouped per query group: [groups, (q heads per group + 2) x head_dim] (q heads,
  k, v of group 0, then of group 1, ...); ours are [q | k | v], each head-major. With
  --attention-output-gate each group's q heads are followed by their gates ([groups, (2 x q heads per group
  + 2) x head_dim]); ours [q | k | v | gate]. linear_fc1 with
  SwiGLU is [gate | up], as ours;
* Adam's state, read and written by mcore_optimizer.py: FP32Optimizer / Float16OptimizerWithFloat16Params
  keep `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` and, in bf16/fp16, the fp32 masters
  `optimizer.state.fp32_param.<model key>`, shaped as the model tensors, the step in `state.common_step`;
  the DistributedOptimizer (`--use-distributed-optimizer`) keeps the same per-tensor keys with the masters
  as `optimizer.state.param.*` (`fully_reshardable`), or flat per-bucket tensors (`dp_reshardable`,
  Megatron-LM's default), its step in `param_groups[*].step`. The import takes the masters (not the
  bf16 weights) and the checkpoint's own step (never the iteration); the export writes the
  non-distributed optimizer's state, or with `distributed_optimizer` the fully_reshardable one;
* models with experts: the routers' `mlp.router.expert_bias` [E] (--moe-router-enable-expert-bias) is a
  buffer, fp32 whatever the training dtype and without Adam state, on both sides: ours is read from and written
  to our checkpoint's persistent buffers (full_state.FullState.buffers; save_full_dcp), as a training save
  holds it;
* Gated DeltaNet hybrids (--experimental-attention-variant gated_delta_net): per-layer keys, a GDN layer's fused
  in_proj and conv1d one tensor per section (formats/mcore.py, GDN_SECTIONS); the args' linear_* shapes are held
  to our layer (check_megatron_gdn) before any tensor is read.
"""

from __future__ import annotations

import argparse
import io
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..config.megatron_flags import check_megatron_gdn
from . import mcore_optimizer
from .dcp import saved_keys
from .files import CheckpointError, iter_name, nonfinite_tensors
from .formats.base import ConversionError
from .formats.mcore import (
    LAYERS,
    args_from_config,
    config_from_args,
    extra_state_keys,
    from_mcore,
    linear_pattern,
    model_keys,
    refused_args,
    stacked,
    to_mcore,
    transformer_impl,
    unsupported,
)
from .full_state import MOMENTS, full_state
from .pickled import dcp_load, unpickle_common
from .pickled import single_process_quiet as quiet

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_KEY = "common_state/shard_0_1"  # megatron-core's ShardedObject("common_state", (1,), (0,))


# ---- reading a megatron-core checkpoint -----------------------------------------------------
def iteration_dir(load: str) -> str:
    """The iter_NNNNNNN directory of `load` (a root with the tracker file, or the directory itself)."""
    tracker = os.path.join(load, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text != "release" and not (text.isascii() and text.isdigit()):
            raise CheckpointError(f"{tracker} holds {text[:40]!r}: neither an iteration number nor 'release'")
        load = os.path.join(load, "release" if text == "release" else iter_name(int(text)))
    if not os.path.isfile(os.path.join(load, ".metadata")):
        raise CheckpointError(f"{load}: no megatron-core torch_dist checkpoint (no .metadata, no {TRACKER})")
    return load


def read_common(path: str) -> dict:
    """The common (non-tensor) state: `common.pt` (older megatron-core) or the `common_state` object."""
    legacy = os.path.join(path, "common.pt")
    if os.path.isfile(legacy):
        return _common(unpickle_common(legacy, legacy), legacy)
    if COMMON_KEY not in saved_keys(path):
        raise CheckpointError(f"{path}: no common state ({COMMON_KEY}, or common.pt): not a megatron-core checkpoint")
    planner = _BytesAsRead(flatten_state_dict=False)
    dcp_load({COMMON_KEY: io.BytesIO()}, path, planner=planner)
    common = unpickle_common(planner.read[COMMON_KEY], f"{path} ({COMMON_KEY})")
    return _common(common[0] if isinstance(common, list) and common else common, path)


def _common(common, where: str) -> dict:
    if not isinstance(common, dict):
        raise CheckpointError(f"{where}: its common state is a {type(common).__name__}, not megatron-core's dict")
    return common


def read_objects(path: str, keys: list[str]) -> dict:
    """megatron-core's pickled objects `keys` (DCP keys: `<name>/shard_0_1`) of the directory `path`, read as
    `read_common` reads its own (the distributed optimizer's metadata, mcore_optimizer.py)."""
    planner = _BytesAsRead(flatten_state_dict=False)
    dcp_load({k: io.BytesIO() for k in keys}, path, planner=planner)
    out = {}
    for k in keys:
        obj = unpickle_common(planner.read[k], f"{path} ({k})")
        out[k] = obj[0] if isinstance(obj, list) and obj else obj
    return out


class _BytesAsRead(DefaultLoadPlanner):
    """DCP's planner, but a pickled object is kept as its bytes in `read` (DCP's own would unpickle it
    with weights_only=False, running whatever code it names): `pickled.unpickle_common` reads it."""

    keeps_bytes = True  # pickled.SafeReader hands it the bytes as they are

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.read: dict[str, io.BytesIO] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.read[read_item.dest_index.fqn] = value


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron-core torch_dist directory, full (global) shapes, read in this process; each
    finite (its files carry no checksum: damaged bytes read as NaN are refused by key)."""
    metadata = saved_keys(path)
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp_load(state, path)
    # the dp_reshardable flat buckets' padding holds whatever megatron-core's buffer held (never initialized,
    # at random NaN bits): their per-parameter spans are checked once cut out (mcore_optimizer._read_flat)
    bad = nonfinite_tensors({k: v for k, v in state.items() if not k.startswith(mcore_optimizer.FLAT)})
    if bad:
        raise CheckpointError(f"{path}: non-finite values (inf or NaN) in {', '.join(sorted(bad)[:3])}: damaged")
    return state


# ---- writing one --------------------------------------------------------------------------
class _BytesAsWritten(DefaultSavePlanner):
    """DCP's planner, but a BytesIO value is written as it is (megatron-core pickles its objects itself,
    as a list of the shards' data, and reads them back so)."""

    def transform_object(self, write_item, object):  # noqa: A002  (DCP's parameter name)
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def _pickled(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def write(root: str, iteration: int, tensors: dict[str, torch.Tensor], common: dict, model) -> str:
    """megatron-core's torch_dist directory root/iter_NNNNNNN of global `tensors` (model and optimizer
    keys) and the `common` state, in this one process; then the tracker file. Returns the directory.
    `model`: our ModelConfig (or, for a dense model, its number of layers), whose linears get the None extra
    state megatron-core's local spec saves for each."""
    path = os.path.join(root, iter_name(iteration))
    os.makedirs(path, exist_ok=True)
    state: dict = dict(tensors)
    if isinstance(model, int):
        from ..config import ModelConfig

        model = ModelConfig(num_layers=model)  # dense: only the layer count names the extra states
    for key in extra_state_keys(model):
        state[key] = _pickled([None])
    state[COMMON_KEY] = _pickled([common])
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
    with quiet():
        dcp.save(state, storage_writer=writer, planner=_BytesAsWritten(flatten_state_dict=False), no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return path


def object_keys(path: str) -> list[str]:
    """The pickled objects' keys of a megatron-core directory (its extra states and common state)."""
    return sorted(k for k, v in saved_keys(path).items() if isinstance(v, BytesStorageMetadata))


# ---- the two directions ---------------------------------------------------------------------
def _refusals(args, tensors: dict, common: dict, cfg) -> list[str]:
    """Why a megatron-core checkpoint cannot become ours, by name (empty when it can)."""
    why = refused_args(args) + check_megatron_gdn(cfg.model)
    unknown = sorted(k for k in tensors if not k.startswith("optimizer.") and k not in model_keys(cfg))
    if unknown:
        why.append(f"tensors with no counterpart here: {', '.join(unknown[:4])}")
    why += unsupported(cfg)
    return why or (_shape_errors(tensors, cfg) if "embedding.word_embeddings.weight" in tensors else [])


def expected_shapes(cfg, rows: int, impl: str = "transformer_engine") -> dict[str, tuple]:
    """{megatron-core key: global shape} of the model `cfg` describes (embedding rows `rows`), as megatron-core
    keys them (layers stacked, or each layer's own); `impl`: the spec, which names an MoE layer's pre-MLP norm."""
    from ..model import GPT

    try:
        with torch.device("meta"):
            model = GPT(cfg.model, rows)
    except (ArithmeticError, AssertionError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"its args describe no model that can be built: {type(e).__name__}: {e}") from None
    return {k: tuple(v.shape) for k, v in to_mcore(dict(model.named_parameters()), cfg, impl).items()}


def _shape_errors(tensors: dict, cfg) -> list[str]:
    """Each tensor (model, and the optimizer's per parameter) whose shape the args do not give, and each tensor
    the args' model has that is not there, by key (the first few)."""
    m, rows = cfg.model, tensors["embedding.word_embeddings.weight"].shape[0]
    want = expected_shapes(cfg, rows, transformer_impl(tensors))
    layers_stacked = stacked(m)
    if not m.untie_embeddings_and_output_weights:  # a tied copy some layouts write
        want_out = {"output_layer.weight": want["embedding.word_embeddings.weight"]}
    else:
        want_out = {}
    why = [f"no {k}, which its args' model has" for k in sorted(want) if k not in tensors]
    for key, t in sorted(tensors.items()):
        model_key = next((key[len(p) :] for p in _OPTIMIZER_PREFIXES if key.startswith(p)), key)
        shape, expected = tuple(t.shape), want.get(model_key, want_out.get(model_key))
        if expected is None or shape == expected:
            continue
        if layers_stacked and model_key.startswith(LAYERS) and shape[:1] != expected[:1]:
            why.append(f"{key} stacks {shape[0] if shape else 0} layers where its args say --num-layers {m.num_layers}")
        else:
            why.append(f"{key} is {list(shape)} where its args give {list(expected)}")
    return why[:3] + ([f"and {len(why) - 3} more"] if len(why) > 3 else [])


_OPTIMIZER_PREFIXES = tuple(f"optimizer.state.{k}." for k in (*MOMENTS, "fp32_param"))


def import_checkpoint(load: str, save: str, with_optimizer: bool = True) -> tuple[str, dict]:
    """megatron-core's torch_dist checkpoint `load` -> our torch_dist checkpoint under `save` (weights,
    AdamW's moments and step, iteration and consumed samples). Returns (its directory, a summary)."""
    from .save import save_full_dcp

    path = iteration_dir(load)
    common = read_common(path)
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{path}: its common state holds no Megatron-LM args (the model's settings)")
    tensors = read_tensors(path)
    if "embedding.word_embeddings.weight" not in tensors:
        raise CheckpointError(f"{path}: no embedding.word_embeddings.weight: not a GPT checkpoint")
    cfg = config_from_args(args, tensors["embedding.word_embeddings.weight"].shape[0])
    why = _refusals(args, tensors, common, cfg)
    if not with_optimizer:
        why = [w for w in why if "optimizer" not in w]
    elif cfg.model.num_experts and mcore_optimizer.sharding_type(common) != "none":
        why.append(MOE_OPTIMIZER + "with --no-optim (tools/convert_checkpoint.py) or --no-load-optim (a run's --load)")
    elif any(linear_pattern(cfg.model)) and mcore_optimizer.sharding_type(common) == "dp_reshardable":
        why.append(GDN_FLAT_OPTIMIZER)
    if why:
        raise CheckpointError(f"cannot convert {path}: " + "; ".join(why))
    adam = mcore_optimizer.read_adam(path, common, tensors, args, read_objects) if with_optimizer else None
    model = {k: v for k, v in tensors.items() if k in model_keys(cfg)}
    model.update(adam.masters if adam else mcore_optimizer.masters(tensors))  # bf16/fp16 runs: the fp32 masters
    weights, buffers = _split_buffers(from_mcore({k: v.float() for k, v in model.items()}, cfg), cfg, path)
    moments, step = None, None
    if adam is not None:
        per_kind = {kind: from_mcore(adam.moments[kind], cfg) for kind in MOMENTS}
        moments, step = {n: {kind: per_kind[kind][n] for kind in MOMENTS} for n in weights}, adam.step
    iteration = int(common.get("iteration", 0))
    scheduler = common.get("opt_param_scheduler") or {}
    consumed = int(getattr(args, "consumed_train_samples", None) or scheduler.get("num_steps", 0))
    out = save_full_dcp(save, cfg, weights, moments, step, iteration, consumed, buffers)
    dropped = adam.dropped if adam else []  # the fp16 loss scale; extra states (TE's FP8 scales), RNG states:
    dropped += [k for k in object_keys(path) if k != COMMON_KEY and not k.startswith(mcore_optimizer.FLAT)]
    done = {"iteration": iteration, "consumed_samples": consumed, "tensors": len(weights), "optimizer": bool(moments),
            "buffers": len(buffers)}  # fmt: skip
    return out, done | {"dropped": dropped, "step": step, "optimizer_format": adam.sharding if adam else None}


MOE_OPTIMIZER = (
    "the distributed optimizer's Adam state of a model with experts is not converted (megatron-core's "
    "ChainedOptimizer shards the experts' over the expert-data-parallel group; the non-distributed one's is): "
)
EXPERT_BIAS = "mlp.router.expert_bias"
GDN_FLAT_OPTIMIZER = (
    "the distributed optimizer's dp_reshardable Adam state of a gated delta net hybrid is not read (its flat "
    "buffers follow GatedDeltaNet's parameter order, not laid out here): re-save with "
    "--dist-ckpt-optim-fully-reshardable, or leave Adam's state out: --no-optim (tools/convert_checkpoint.py) or "
    "--no-load-optim (a run's --load)"
)


def _split_buffers(state: dict, cfg, path: str) -> tuple[dict, dict]:
    """(weights, buffers) of our single-rank state from megatron-core's: the routers' expert bias is a
    persistent buffer (training state, not a parameter: no Adam state), saved as our training save saves it.
    One its args' model has not (no --moe-router-enable-expert-bias, a dense layer), or of another shape, is
    refused by key."""
    buffers = {k: v for k, v in state.items() if k.endswith(EXPERT_BIAS)}
    want = {n: (cfg.model.num_experts,) for n in _with_expert_bias({}, cfg)}
    if wrong := sorted(k for k, v in buffers.items() if want.get(k) != tuple(v.shape)):
        has = "without --moe-router-enable-expert-bias" if wrong[0] not in want else f"{want[wrong[0]][0]} experts"
        raise CheckpointError(
            f"cannot convert {path}: it holds layer {wrong[0].split('.')[1]}'s {EXPERT_BIAS} "
            f"{list(buffers[wrong[0]].shape)}, but its args describe a model {has} there"
        )
    return {k: v for k, v in state.items() if k not in buffers}, buffers


def _with_expert_bias(buffers: dict, cfg) -> dict:
    """Each router's expert bias megatron-core's MoE layer loads (--moe-router-enable-expert-bias), fp32 as its
    router keeps it: the checkpoint's own, else (saved before our checkpoints held it) zeros, where our own
    --load restarts it too."""
    m = cfg.model
    if not (m.num_experts and m.moe_router_enable_expert_bias):
        return {}
    names = [f"layers.{i}.{EXPERT_BIAS}" for i in range(m.num_layers) if m.is_moe_layer(i)]
    return {n: buffers[n].float() if n in buffers else torch.zeros(m.num_experts) for n in names}


def our_full_state(load: str) -> tuple[dict, dict | None, float | None, dict]:
    """(full fp32 weights, AdamW moments by name or None, AdamW's step or None, meta.json) of our
    checkpoint `load`, any format and layout (full_state.py)."""
    s = full_state(load, optimizer=True)
    return s.weights, s.moments, s.step, s.meta


def _param_groups(cfg) -> list[dict]:
    """Megatron-LM's default AdamW groups (megatron/core/optimizer `_get_param_groups`): the decayed
    parameters first, then the biases and 1-D ones (wd_mult 0); their `params` are the loading run's."""
    o = cfg.optim
    wd = o.weight_decay_span()[0]
    common = {"lr": o.lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps, "lr_mult": 1.0,
              "is_decoupled_lr": False, "max_lr": o.lr, "min_lr": o.min_lr, "is_expert_parallel": False}  # fmt: skip
    return [
        {**common, "weight_decay": wd, "wd_mult": 1.0, "default_config": True},
        {**common, "weight_decay": 0.0, "wd_mult": 0.0, "default_config": True},
    ]


def _adam_common(cfg, step: float, nested: bool) -> dict:
    """The common (non-tensor) state of Megatron-LM's non-distributed Adam: its parameter groups and step. When
    the experts are expert-parallel (EP > 1, or an expert TP other than TP: megatron-core's linears then mark
    them allreduce=False), get_megatron_optimizer builds a ChainedOptimizer of two, the dense parameters' groups
    then the experts' (is_expert_parallel), saved as {0: ..., 1: ...}; else one optimizer holds them all. The
    tensors keep the unprefixed optimizer.state.* keys either way (Megatron-LM saves with
    chained_optim_avoid_prefix)."""

    def one(groups: list[dict]) -> dict:
        state = {"param_groups": groups, "state": {"common_step": torch.tensor(step)}}  # torch's float tensor
        return {"optimizer": state} if nested else state  # Float16OptimizerWithFloat16Params nests it once more

    p, tp = cfg.parallel, cfg.parallel.tensor_model_parallel_size
    if not (cfg.model.num_experts and (p.expert_model_parallel_size > 1 or p.expert_tp_size != tp)):
        return one(_param_groups(cfg))
    experts = {**_param_groups(cfg)[0], "is_expert_parallel": True}  # 2-D weights only (the experts hold no bias)
    return {0: one(_param_groups(cfg)), 1: one([experts])}


def _scheduler_state(cfg, consumed: int, load: str) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() of our schedule after `consumed` samples: its steps (in
    samples) from --train-samples when the run gave it, else from --train-iters x --global-batch-size, as
    Megatron's get_optimizer_param_scheduler; with neither (hand-written args) refused by name."""
    from ..optim.schedules import schedule_for

    if cfg.train.train_iters is None and cfg.train.train_samples is None:
        raise ConversionError(
            f"cannot convert {load} with its optimizer: its run gives neither --train-iters nor --train-samples "
            "(meta.json's config), so Megatron's learning-rate schedule (opt_param_scheduler) has no length; "
            "export it with --no-optim"
        )
    o, s = cfg.optim, schedule_for(cfg.optim, cfg.train)
    start_wd, end_wd = o.weight_decay_span()
    return {"max_lr": o.lr, "lr_warmup_steps": int(s.warmup), "num_steps": consumed, "lr_decay_style": o.lr_decay_style,
            "lr_decay_steps": int(s.decay), "min_lr": o.min_lr, "start_wd": start_wd, "end_wd": end_wd,
            "wd_incr_style": o.weight_decay_incr_style, "wd_incr_steps": int(s.wd_incr)}  # fmt: skip


def export_checkpoint(
    load: str,
    save: str,
    with_optimizer: bool = True,
    distributed_optimizer: bool = False,
    impl: str = "transformer_engine",
    expert_parallel: int | None = None,
) -> tuple[str, dict]:
    """Our checkpoint `load` (any format and layout) -> megatron-core's torch_dist checkpoint under `save`,
    as Megatron-LM's save_checkpoint writes it with the (non-distributed) Adam optimizer, or with
    `distributed_optimizer` its DistributedOptimizer in the fully_reshardable format (mcore_optimizer.py);
    `impl`: the --transformer-impl of the Megatron-LM run that loads it (an MoE layer's pre-MLP norm key);
    `expert_parallel`: its --expert-model-parallel-size (default: our run's), which decides whether its Adam is
    one optimizer or a chain of two (`_adam_common`). Returns (its directory, a summary)."""
    from .layout import config_from_dict

    ours = full_state(load, optimizer=True)
    weights, step, meta = ours.weights, ours.step, ours.meta
    moments = ours.moments if with_optimizer else None
    cfg = config_from_dict(meta["config"])
    if expert_parallel is not None:
        cfg.parallel.expert_model_parallel_size = expert_parallel
    moe_adam = moments is not None and distributed_optimizer and cfg.model.num_experts
    why = unsupported(cfg) + ([MOE_OPTIMIZER + "export it without --use-distributed-optimizer"] if moe_adam else [])
    if why:
        raise ConversionError(f"cannot convert {load} to megatron-core's GPTModel: " + "; ".join(why))
    scheduler = _scheduler_state(cfg, meta["consumed_samples"], load) if moments is not None else None
    low = torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else None
    masters = to_mcore(weights, cfg, impl)
    if lost := sorted(set(expected_shapes(cfg, weights["embedding.weight"].shape[0], impl)) - set(masters)):
        raise ConversionError(
            f"cannot convert {load}: it holds no tensor for megatron-core's {lost[0]}, which its model has"
        )
    tensors = {k: v.to(low) if low else v for k, v in masters.items()}  # the model in its training dtype
    biases = _with_expert_bias(ours.buffers, cfg)
    tensors |= to_mcore(biases, cfg, impl)  # buffers: fp32 (as its router keeps them), no Adam state
    common: dict = {
        "checkpoint_version": 3.0,
        "iteration": meta["iteration"],
        "num_floating_point_operations_so_far": 0,
    }
    if moments is not None and distributed_optimizer:
        per_kind = {kind: to_mcore({n: moments[n][kind] for n in weights}, cfg, impl) for kind in MOMENTS}
        state, optim = mcore_optimizer.write_fully_reshardable(masters, per_kind, float(step or 0), _param_groups(cfg))
        tensors.update(state)
        common.update(optim, opt_param_scheduler=scheduler)
    elif moments is not None:
        for kind in MOMENTS:
            mcore = to_mcore({n: moments[n][kind] for n in weights}, cfg, impl)
            tensors.update({f"optimizer.state.{kind}.{k}": v for k, v in mcore.items()})
        if low:
            tensors.update({f"optimizer.state.fp32_param.{k}": v for k, v in masters.items()})
        common["optimizer"] = _adam_common(cfg, float(step or 0), low is not None)
        common["opt_param_scheduler"] = scheduler
    rows = weights["embedding.weight"].shape[0]
    common["args"] = args_from_config(cfg, meta["iteration"], meta["consumed_samples"], rows, moments is not None, impl)
    if distributed_optimizer:
        vars(common["args"]).update(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
    out = write(save, meta["iteration"], tensors, common, cfg.model)
    done = {"iteration": meta["iteration"], "tensors": len(masters), "optimizer": moments is not None}
    return out, done | {"buffers": len(biases)}
