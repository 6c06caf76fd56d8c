"""megatron-core's Adam state in a torch_dist checkpoint: fp32 masters, both moments and the step, read from
each optimizer megatron-core 0.19 writes and written for its DistributedOptimizer (mcore.py moves the weights).

What megatron-core writes (read off its own `dist_checkpointing.save`, tests/checkpoint/test_mcore_distopt.py):

* FP32Optimizer / Float16OptimizerWithFloat16Params (no `--use-distributed-optimizer`): per model tensor,
  `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` and in bf16/fp16 the masters
  `optimizer.state.fp32_param.<model key>`; the common state's `optimizer` ({"param_groups", "state"},
  nested once more under "optimizer" for Float16) holds `state.common_step`, absent when Adam never stepped.
* DistributedOptimizer, `fully_reshardable` (`--dist-ckpt-optim-fully-reshardable`): the same per-tensor
  keys with the masters as `optimizer.state.param.<model key>` (fp32, whatever the model's dtype); the
  common state's `optimizer.optimizer.param_groups[*].step` is Adam's step.
* DistributedOptimizer, `dp_reshardable` (Megatron-LM's default): one flat fp32 tensor per gradient bucket
  and kind, `optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(<param>, <grad>).bucket_idx_<k>.
  {param,exp_avg,exp_avg_sq}`, of the bucket's unpadded length; pickled objects beside them under the
  same prefix: `per_bucket_numel_unpadded` and `optimizer` (its `param_groups[*].step`). A bucket holds the
  model's parameters in reverse registration order, each starting at a multiple of 64 elements. There are
  no per-parameter offsets in the file: they are laid out here from the model's parameter order (the local
  spec's or Transformer Engine's, which fuses the norms into linear_qkv/linear_fc1) and the buckets'
  lengths, and the layout is accepted only where every master rounds to the checkpoint's own weight. At
  TP x PP > 1 each model-parallel rank writes its stage's shards (`dp_group_idx_<tp rank + TP x pp rank>`),
  joined over TP as `TP_DIM` says; uneven or virtual pipeline stages are refused.

The format is named by the common state's `content_metadata.distrib_optim_sharding_type` (or
`optimizer.param_state_sharding_type`). Anything else is refused by name, never dropped.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp

from .files import CheckpointError, nonfinite_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("param", *MOMENTS)  # the distributed optimizer's names: the fp32 master, the moments
FULLY, DP = "fully_reshardable", "dp_reshardable"
MASTERS = ("optimizer.state.fp32_param.", "optimizer.state.param.")  # Float16Optimizer's, DistributedOptimizer's
FLAT = "optimizer.distributed."
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_Q, _P, _F1, _F2 = (f"decoder.layers.{m}." for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                     "mlp.linear_fc1", "mlp.linear_fc2"))  # fmt: skip
_QK = [f"decoder.layers.self_attention.{n}_layernorm.{w}" for n in "qk" for w in ("weight", "bias")]
# a layer's parameters in registration order: the local spec (separate norm modules) and Transformer Engine's
# (the norms inside linear_qkv/linear_fc1, after linear_proj)
LAYER_ORDER = {
    "local": [_Q + "layer_norm_weight", _Q + "layer_norm_bias", _P + "weight", _P + "bias", _Q + "weight",
              _Q + "bias", *_QK, _F1 + "layer_norm_weight", _F1 + "layer_norm_bias", _F1 + "weight", _F1 + "bias",
              _F2 + "weight", _F2 + "bias"],
    "transformer_engine": [_P + "weight", _P + "bias", _Q + "layer_norm_weight", _Q + "layer_norm_bias",
                           _Q + "weight", _Q + "bias", *_QK, _F1 + "layer_norm_weight", _F1 + "layer_norm_bias",
                           _F1 + "weight", _F1 + "bias", _F2 + "weight", _F2 + "bias"],
}  # fmt: skip
FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


@dataclasses.dataclass
class AdamState:
    """Adam's state of a megatron-core checkpoint, by megatron-core's global model keys."""

    masters: dict[str, torch.Tensor]  # fp32; empty where the checkpoint holds none (fp32 runs, FP32Optimizer)
    moments: dict[str, dict[str, torch.Tensor]]  # kind -> key -> fp32
    step: float
    sharding: str  # "fully_reshardable", "dp_reshardable" or "none" (the non-distributed optimizers)
    dropped: list[str] = dataclasses.field(default_factory=list)  # what the checkpoint holds that is not carried


SCALER = "grad_scaler (fp16's dynamic loss scale: the run restarts it from --initial-loss-scale)"


def sharding_type(common: dict) -> str:
    """The distributed optimizer's format of a checkpoint's common state; "none" for the other optimizers."""
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    return kind or (common.get("optimizer") or {}).get("param_state_sharding_type") or "none"


def _groups_step(groups: list, where: str) -> float | None:
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointError(f"{where}: its parameter groups hold different Adam steps {sorted(steps)}")
    return steps.pop() if steps else None


def adam_step(optimizer: dict, where: str) -> float:
    """Adam's step of a megatron-core optimizer state: `param_groups[*].step` (distributed optimizer) or
    `state.common_step` (the others, which write none before the first step), at either nesting."""
    nested = optimizer.get("optimizer")
    inner: dict = nested if isinstance(nested, dict) else optimizer
    step = _groups_step(inner.get("param_groups") or [], where)
    common = (inner.get("state") or {}).get("common_step")
    if step is None and common is not None:
        step = float(common)
    if step is None and "state" not in inner:
        raise CheckpointError(f"{where}: no Adam step (no param_groups[*].step, no state.common_step)")
    return 0.0 if step is None else step


def read_adam(path: str, common: dict, tensors: dict[str, torch.Tensor], args, read_objects) -> AdamState | None:
    """Adam's masters, moments and step of megatron-core's checkpoint `path` (its common state and global
    tensors read; `read_objects(path, keys)` reads its pickled objects); None when it holds no optimizer state."""
    kind = sharding_type(common)
    if kind == DP:
        return _read_flat(path, tensors, args, read_objects)
    if kind not in ("none", FULLY):
        raise CheckpointError(
            f"{path}: the distributed optimizer's {kind} format is not read here "
            "(re-save with --dist-ckpt-optim-fully-reshardable, or convert with --no-optim)"
        )
    if "optimizer" not in common:
        return None
    _check_dtypes(path, {k: v for k, v in tensors.items() if k.startswith("optimizer.state.")})
    moments = {m: _prefixed(tensors, f"optimizer.state.{m}.") for m in MOMENTS}
    if not moments["exp_avg"]:
        raise CheckpointError(f"{path}: its optimizer state holds no optimizer.state.exp_avg.* tensors")
    kept = masters(tensors)
    wrong = [k for k, m in kept.items() if k in tensors and not torch.equal(m.to(tensors[k].dtype), tensors[k])]
    if wrong:
        raise CheckpointError(f"{path}: the fp32 masters of {', '.join(wrong[:3])} do not round to its weights")
    optimizers = chained(common["optimizer"])
    steps = sorted({adam_step(o, path) for o in optimizers})
    if len(steps) > 1:
        raise CheckpointError(f"{path}: its chained optimizers (dense, experts) hold different Adam steps {steps}")
    dropped = [SCALER] if any("grad_scaler" in o for o in optimizers) else []
    return AdamState(kept, moments, steps[0], kind, dropped)


def chained(optimizer: dict) -> list[dict]:
    """The optimizers of megatron-core's ChainedOptimizer state: {0: dense, 1: experts'} in a checkpoint of a
    model with experts (get_megatron_optimizer), else the one."""
    keys = list(optimizer)
    if keys and all(isinstance(k, int) for k in keys):
        return [optimizer[k] for k in sorted(keys)]
    return [optimizer]


def _check_dtypes(path: str, state: dict) -> None:
    """Refuse optimizer state that is not fp32 masters and floating-point moments (megatron-core's
    --use-precision-aware-optimizer keeps int16 remainders of the masters, or fp8 moments)."""
    master = (".param", *(p[len("optimizer") :] for p in MASTERS))  # flat buckets' "param", per tensor's two

    def unread(key: str, t: torch.Tensor) -> bool:
        is_master = key.endswith(master[0]) or any(m in key for m in master[1:])
        return not t.is_floating_point() or t.element_size() < 2 or is_master and t.dtype != torch.float32

    bad = [f"{k} ({v.dtype})" for k, v in state.items() if unread(k, v)]
    if bad:
        raise CheckpointError(f"{path}: optimizer state not read here (fp32 masters and bf16/fp16/fp32 moments "
                              f"are): {', '.join(bad[:3])}; convert with --no-optim")  # fmt: skip


def masters(tensors: dict) -> dict[str, torch.Tensor]:
    """The fp32 masters kept per model tensor (either optimizer's name), by global model keys."""
    out: dict = {}
    for prefix in MASTERS:
        out |= _prefixed(tensors, prefix)
    return out


def _prefixed(tensors: dict, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}


# ---- dp_reshardable: the flat buckets ----------------------------------------------------------
# the tensor-parallel split of a global key (megatron-core's column-/row-parallel linears, its vocab-parallel
# embedding and output layer): the dimension a TP rank holds 1/TP of; the others are whole on every rank
TP_DIM = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, _Q + "weight": 0, _Q + "bias": 0,
          _P + "weight": 1, _F1 + "weight": 0, _F1 + "bias": 0, _F2 + "weight": 1}  # fmt: skip


# Megatron-LM's args that place layers on pipeline stages other than evenly: not read here
UNEVEN = ("virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")  # fmt: skip


def _read_flat(path: str, tensors: dict, args, read_objects) -> AdamState:
    flat = {k: v for k, v in tensors.items() if k.startswith(FLAT)}
    if not flat:
        raise CheckpointError(f"{path}: its dp_reshardable optimizer state has no flat buffers ({FLAT}*)")
    groups = sorted({k.split(".")[2] for k in flat})
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    uneven = [f"--{n.replace('_', '-')}" for n in UNEVEN if getattr(args, n, None)]
    layers = tensors[_Q + "weight"].shape[0]
    if sorted(groups) != sorted(f"dp_group_idx_{g}" for g in range(tp * pp)) or uneven or layers % pp:
        raise CheckpointError(
            f"{path}: dp_reshardable optimizer state written at TP{tp} x PP{pp} ({len(groups)} model-parallel "
            f"groups{', ' + ' '.join(uneven) if uneven else ''}, {layers} layers): its flat buffers are read here "
            "with the layers split evenly over the stages only; re-save with --dist-ckpt-optim-fully-reshardable "
            "(any layout) or convert with --no-optim"
        )
    _check_dtypes(path, flat)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    buffers = [_flat_group(path, f"{FLAT}dp_group_idx_{g}.", flat, stored, read_objects) for g in range(tp * pp)]
    steps = {step for _, _, step in buffers}
    if len(steps) != 1:
        raise CheckpointError(f"{path}: its model-parallel ranks hold different Adam steps {sorted(steps)}")
    why = []
    for impl in _impls(args):
        state = _unflatten(flat, buffers, tensors, args, impl)
        if isinstance(state, str):
            why.append(f"{impl}: {state}")
            continue
        wrong = [k for k, m in state["param"].items() if not torch.equal(m.to(tensors[k].dtype), tensors[k])]
        if not wrong:
            if bad := nonfinite_tensors({m: state[m] for m in MOMENTS}):  # the masters equal the finite weights
                raise CheckpointError(
                    f"{path}: non-finite values (inf or NaN) in {', '.join(sorted(bad)[:3])}: damaged"
                )
            dropped = [SCALER] if f"{FLAT}dp_group_idx_0.grad_scaler/shard_0_1" in stored else []
            return AdamState(state["param"], {m: state[m] for m in MOMENTS}, steps.pop(), DP, dropped)
        why.append(f"{impl}: the masters of {', '.join(wrong[:3])} do not round to the checkpoint's weights")
    raise CheckpointError(f"{path}: its dp_reshardable buffers match no megatron-core parameter layout "
                          f"({'; '.join(why)}); convert with --no-optim")  # fmt: skip


def _unflatten(flat: dict, buffers: list, tensors: dict, args, impl: str) -> dict | str:
    """{kind: {global key: fp32 tensor}} of the model-parallel groups' flat `buffers` (group tp_rank +
    TP x pp_rank, megatron-core's model-parallel rank), laid out as `impl`'s spec; or why they do not fit."""
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    pieces: dict = {kind: {} for kind in KINDS}
    for stage in range(pp):
        order = model_order(tensors, impl, untied, stage, pp)
        shards = []
        for rank in range(tp):
            lengths, bucket_keys, _ = buffers[rank + tp * stage]
            spans = layout(order, lengths, lambda k, i: _local_shape(tensors, k, i, tp))
            if isinstance(spans, str):
                return f"TP rank {rank}, stage {stage}: {spans}"
            shards.append({kind: _cut(flat, bucket_keys, kind, spans, tensors, tp) for kind in KINDS})
        for kind in KINDS:
            pieces[kind] |= _whole([s[kind] for s in shards], bool(getattr(args, "swiglu", False)))
    # a tied output layer's copy of the embedding (a last stage's) is dropped: the checkpoint names the first's
    return {kind: {k: v for k, v in _stacked(pieces[kind]).items() if k in tensors} for kind in KINDS}


def _flat_group(path: str, prefix: str, flat: dict, stored, read_objects) -> tuple[list[int], list[str], float]:
    """(its buckets' unpadded lengths, their keys, Adam's step) of one model-parallel group's flat state."""
    names = [f"{prefix}{n}/shard_0_1" for n in ("optimizer", "per_bucket_numel_unpadded")]
    missing = [n for n in names if n not in stored]
    if missing:
        raise CheckpointError(f"{path}: no {', '.join(missing)} (the distributed optimizer's metadata)")
    opt, buffers = (read_objects(path, names)[n] for n in names)
    buckets = {k[: k.rindex(".")] for k in flat if k.startswith(prefix)}
    if len(buffers) != 1 or len(next(iter(buffers[0].values()))) != len(buckets):
        raise CheckpointError(f"{path}: {len(buckets)} flat buckets in {len(buffers)} buffers under {prefix}; one "
                              "buffer of one parameter dtype is read here (no experts, no fp8 parameters)")  # fmt: skip
    ((dtypes, lengths),) = buffers[0].items()
    step = _groups_step(opt.get("param_groups") or [], path)
    if step is None:
        raise CheckpointError(f"{path}: {prefix}optimizer holds no param_groups[*].step (Adam's step)")
    return lengths, [f"{prefix}gbuf_idx_0.dtype_{dtypes}.bucket_idx_{i}" for i in range(len(lengths))], step


def _impls(args) -> list[str]:
    """The layer specs to try, the args' own first (Megatron-LM's --transformer-impl)."""
    first = getattr(args, "transformer_impl", "transformer_engine")
    return [first, *(k for k in LAYER_ORDER if k != first)] if first in LAYER_ORDER else list(LAYER_ORDER)


def model_order(tensors: dict, impl: str, untied: bool, stage: int = 0, stages: int = 1) -> list:
    """megatron-core's GPTModel parameters of pipeline `stage` (layers split evenly) in registration order,
    as (global key, layer or None): those the checkpoint holds (biases, norms' biases, position embeddings),
    the output layer when `untied` or, tied, on a last stage that is not the first (its copy of the
    embedding, which megatron-core keeps in a bucket of its own)."""
    layers = tensors[_Q + "weight"].shape[0] // stages
    order: list[tuple[str, int | None]] = [(k, None) for k in FIRST if k in tensors and stage == 0]
    for i in range(stage * layers, (stage + 1) * layers):
        order += [(k, i) for k in LAYER_ORDER[impl] if k in tensors]
    if stage < stages - 1:
        return order
    order += [(k, None) for k in LAST[:-1] if k in tensors]
    return order + [(LAST[-1], None)] if untied or stages > 1 else order


def _local_shape(tensors: dict, key: str, layer: int | None, tp: int) -> torch.Size:
    """A TP rank's shape of a global key's tensor (one layer's, for the stacked layer keys; a tied output
    layer's, the embedding's)."""
    whole = tensors[key] if key in tensors else tensors[FIRST[0]]  # absent: a tied output layer
    shape = list(whole.shape if layer is None else whole.shape[1:])
    if key in TP_DIM:
        shape[TP_DIM[key]] //= tp
    return torch.Size(shape)


def layout(order: list, lengths: list[int], shape) -> dict | str:
    """{(key, layer): (bucket, start, numel)}: the parameters in reverse order, each from a multiple of 64,
    a bucket closed where its unpadded length ends (`shape(key, layer)`: a parameter's); or why `lengths`
    do not fit."""
    spans, bucket, pos = {}, 0, 0
    for key, layer in reversed(order):
        if bucket == len(lengths):
            return f"parameters left after {len(lengths)} buckets"
        start = -(-pos // 64) * 64
        numel = shape(key, layer).numel()
        spans[key, layer], pos = (bucket, start, numel), start + numel
        if pos > lengths[bucket]:
            return f"{key} ends at {pos}, past its bucket's {lengths[bucket]} elements"
        if -(-pos // 64) * 64 >= lengths[bucket]:
            bucket, pos = bucket + 1, 0
    return spans if bucket == len(lengths) else f"{len(lengths) - bucket} buckets left unfilled"


def _cut(flat: dict, bucket_keys: list, kind: str, spans: dict, tensors: dict, tp: int) -> dict:
    """{(key, layer): one TP rank's fp32 tensor} of one kind, cut out of its flat buckets by `spans`."""
    return {
        (key, layer): flat[f"{bucket_keys[bucket]}.{kind}"][start : start + n]
        .float()
        .view(_local_shape(tensors, key, layer, tp))
        for (key, layer), (bucket, start, n) in spans.items()
    }


def _whole(shards: list[dict], swiglu: bool) -> dict:
    """{(key, layer): global tensor} of the TP ranks' `shards`: the split keys concatenated along their
    dimension (SwiGLU's fc1: each rank holds [its gate rows | its up rows]), the others rank 0's."""
    out = {}
    for key, layer in shards[0]:
        parts = [s[key, layer] for s in shards]
        if key not in TP_DIM:
            out[key, layer] = parts[0]
        elif swiglu and key.startswith(_F1):
            halves = [p.chunk(2) for p in parts]
            out[key, layer] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[key, layer] = torch.cat(parts, TP_DIM[key])
    return out


def _stacked(pieces: dict) -> dict[str, torch.Tensor]:
    """{key: tensor} of {(key, layer): tensor}, the layers stacked."""
    out: dict[str, dict] = {}
    for (key, layer), t in pieces.items():
        out.setdefault(key, {})[layer] = t
    return {k: torch.stack([v[i] for i in sorted(v)]) if None not in v else v[None] for k, v in out.items()}


# ---- writing: the DistributedOptimizer's fully_reshardable state --------------------------------
def write_fully_reshardable(masters: dict, moments: dict, step: float, groups: list[dict]) -> tuple[dict, dict]:
    """(tensors, common-state entries) of megatron-core's DistributedOptimizer in the fully_reshardable
    format: fp32 `masters` and `moments` (kind -> key -> tensor) by global keys, Adam's `step` in every group."""
    tensors = {f"optimizer.state.param.{k}": v.float() for k, v in masters.items()}
    for kind in MOMENTS:
        tensors |= {f"optimizer.state.{kind}.{k}": v.float() for k, v in moments[kind].items()}
    optimizer = {"param_groups": [g | {"step": float(step)} for g in groups]}
    common = {"optimizer": {"optimizer": optimizer, "param_state_sharding_type": FULLY},
              "content_metadata": {"distrib_optim_sharding_type": FULLY, **CONTENT_METADATA}}  # fmt: skip
    return tensors, common
