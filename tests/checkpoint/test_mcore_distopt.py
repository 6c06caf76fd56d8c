"""megatron-core's DistributedOptimizer checkpoints (bf16, DP2: the sharding is real), both ways, against
megatron-core itself (0.19.2, the test extra).

One 2-rank gloo job: megatron-core's GPTModel (local spec, bf16 parameters, fp32 gradient buffers) in its
DistributedDataParallel, its DistributedOptimizer (get_megatron_optimizer) and scheduler train 2 steps and
save with `dist_checkpointing.save` in both formats (fully_reshardable and dp_reshardable, Megatron-LM's
default); the converter imports each; megatron-core resumes each at DP2 for 3 steps (the reference) and
our loop resumes the dp_reshardable import at DP2 (ZeRO-1, bf16) for the same 3 steps; the converter exports
that with --use-distributed-optimizer and megatron-core's DistributedOptimizer loads it at DP2. Before that,
in the same job: megatron-core's non-distributed bf16 optimizer (Float16OptimizerWithFloat16Params) at DP2,
and the DistributedOptimizer at TP2 and at PP2 (2 Adam steps on random gradients in its buffers), whose
dp_reshardable imports must equal their fully_reshardable ones (megatron-core's own gather).

What megatron-core's optimizer holds is read with its own gather (`get_parameter_state_dp_zero`) and its own
buffer offsets (`param_index_map`), placed at the global keys its model's sharded state dict names.

Shims beyond test_mcore's `_cpu_shims`, none of which changes what is computed or written (`_distopt_shims`):
megatron-core's mixed-precision optimizer allocates its unit loss scale (and clip_grads its norm) with
device='cuda', its fully_reshardable gather moves its buffers with `.cuda()`, and it types its parameters by
`Tensor.type()` == 'torch.cuda.BFloat16Tensor' (so a CPU tensor is "not a supported type"): a TorchFunctionMode
maps device 'cuda' to 'cpu', `.cuda()` to the tensor itself and answers `type()` with the CUDA name of the same
dtype; the gradient buffers wait on `torch.cuda.current_stream()` (CUDA-graph events that
are never set here), given torch.cpu's no-op stream. And its fully_reshardable load under torch's own Adam
(without Apex/TE; GPU runs have TE's FusedAdam, which keeps no per-parameter step tensor) looks the state's
'step' tensor up among the loaded tensors, which never hold it (the step travels in param_groups and is set
before): the shim hands it a non-tensor there, which megatron-core's own loop skips. Its load under torch's
Adam also hands every parameter's state one shared step tensor (which torch's Adam then increments once per
parameter: 25 after 3 steps of 8 parameters) and, dp_reshardable, overwrites it with the value held before
the load: `_resume` gives each parameter its own tensor of the step megatron-core loaded into its
param_groups (where TE's FusedAdam keeps it).
"""

import argparse
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron_zpp import training
from megatron_zpp.checkpoint import CheckpointError, mcore, mcore_optimizer
from megatron_zpp.checkpoint.save import save_full_dcp
from megatron_zpp.data.mock import MockGPTDataset
from megatron_zpp.model import GPT
from tests.checkpoint.test_mcore import (
    GPT_FLAGS,
    LLAMA_FLAGS,
    MEGATRON_ITERS,
    ROWS,
    RUN,
    SEQ,
    _cfg,
    _convert,
    _cpu_shims,
    _fresh,
    _mcore_forward,
    _mcore_model,
    _megatron_args,
)
from tests.dist import run_distributed

FLAGS = LLAMA_FLAGS + RUN + " --bf16"
FORMATS = (mcore_optimizer.FULLY, mcore_optimizer.DP)
KINDS = ("param", *mcore_optimizer.MOMENTS)


class _CudaIsCpu(TorchFunctionMode):
    """device='cuda' -> 'cpu'; `t.cuda()` -> t; `t.type()` of a CPU tensor -> its CUDA name (megatron-core's
    dtype checks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _distopt_shims():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _cpu_shims()
    torch.cuda.current_stream = lambda *a, **k: torch.cpu.current_stream()
    set_state = DistributedOptimizer._set_main_param_and_optimizer_states
    DistributedOptimizer._set_main_param_and_optimizer_states = lambda self, p, t: set_state(
        self, p, {"step": None, **t}
    )
    _CudaIsCpu().__enter__()  # for the rest of this rank's process


def _trainer(cfg, distributed: bool = True, tp: int = 1, stage: int | None = None):
    """megatron-core's bf16 GPTModel in its DDP, DistributedOptimizer (or, not `distributed`, its
    Float16OptimizerWithFloat16Params) and OptimizerParamScheduler, as Megatron-LM builds them for these
    flags with --bf16 [--use-distributed-optimizer] --accumulate-allreduce-grads-in-fp32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(11)
    model = _mcore_model(cfg, tp, stage)
    model.config.bf16, model.config.params_dtype = True, torch.bfloat16
    model = model.to(torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    o, g = cfg.optim, cfg.train.global_batch_size
    oc = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=True,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    opt = get_megatron_optimizer(oc, [ddp])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters * g,
        lr_decay_steps=cfg.train.train_iters * g, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=cfg.train.train_iters * g, wd_incr_style="constant",
    )  # fmt: skip
    return model, ddp, opt, sched


def _steps(cfg, ddp, opt, sched, first: int, last: int) -> list[tuple[float, float]]:
    """Megatron-LM's train step: this DP rank's micro-batches (1 sample each) of every global batch in
    [first, last), each loss (mean per-token cross-entropy) over the number of micro-batches, gradients in
    the fp32 buffers reduce-scattered, the DistributedOptimizer's step (clipping inside), the scheduler.
    Returns each step's (global mean loss, lr)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_group()
    g, rank, world = cfg.train.global_batch_size, dp.rank(), dp.size()
    data, micro = MockGPTDataset(last * g, SEQ, 100, cfg.train.seed), g // world
    steps = []
    for it in range(first, last):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros(())
        for i in range(it * g + rank * micro, it * g + (rank + 1) * micro):
            sample = torch.from_numpy(data[i])[None]
            logits = _mcore_forward(ddp, sample[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, ROWS), sample[:, 1:].reshape(-1)) / micro
            loss.backward()
            total += loss.detach()
        ddp.finish_grad_sync()
        lr = opt.param_groups[0]["lr"]
        assert opt.step()[0]
        sched.step(increment=g)
        torch.distributed.all_reduce(total, group=dp)
        steps.append((total.item() / world, lr))
    return steps


def _held(model, opt) -> dict:
    """{kind: {global key: fp32 tensor}} and Adam's step of what megatron-core's DistributedOptimizer holds,
    gathered by its own code, cut by its own buffer offsets, named by its model's sharded state dict (TP1:
    a layer's tensor is its slice of the stacked global one)."""
    inner = opt.chained_optimizers[0]
    world = inner.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True)
    keys = {id(sh.data): sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    layer = {
        id(p): int(n.split(".")[2]) if n.startswith("decoder.layers.") else None for n, p in model.named_parameters()
    }
    out: dict = {k: {} for k in KINDS}
    for gbuf_idx, buffer in enumerate(inner.buffers):
        (tensors,) = world[gbuf_idx].values()
        for param, (start, end, _) in buffer.param_index_map.items():
            for kind in KINDS:
                value = tensors[kind][start:end].view(param.shape).clone()
                if layer[id(param)] is None:
                    out[kind][keys[id(param)]] = value
                else:
                    out[kind].setdefault(keys[id(param)], {})[layer[id(param)]] = value
    for kind in KINDS:  # the layers stacked, as the global tensors are
        out[kind] = {k: torch.stack([v[i] for i in range(len(v))]) if isinstance(v, dict) else v
                     for k, v in out[kind].items()}  # fmt: skip
    steps = {g["step"] for g in inner.state_dict()["optimizer"]["param_groups"]}
    return {"state": out, "step": steps}


def _held_float16(model, opt) -> dict:
    """The same of megatron-core's Float16OptimizerWithFloat16Params (per parameter: its fp32 master and
    Adam's state of that master)."""
    inner = opt.chained_optimizers[0]
    keys = {id(sh.data): sh.key for sh in model.sharded_state_dict().values() if not sh.key.endswith("_extra_state")}
    layer = {id(p): int(n.split(".")[2]) if n.startswith("decoder.layers.") else 0 for n, p in model.named_parameters()}
    out: dict = {k: {} for k in KINDS}
    for params, masters in zip(inner.float16_groups, inner.fp32_from_float16_groups):
        for param, master in zip(params, masters):
            state = {"param": master, **{k: inner.optimizer.state[master][k] for k in mcore_optimizer.MOMENTS}}
            for kind, value in state.items():
                out[kind].setdefault(keys[id(param)], {})[layer[id(param)]] = value.detach().clone()
    stacked = {kind: {k: torch.stack([v[i] for i in sorted(v)]) if k.startswith("decoder.layers.") else v[0]
                      for k, v in out[kind].items()} for kind in KINDS}  # fmt: skip
    steps = {float(s["step"]) for s in inner.optimizer.state.values()}
    return {"state": stacked, "step": steps}


def _save(cfg, model, opt, sched, root, fmt, tp: int = 1, pp: int = 1):
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": fmt, **mcore_optimizer.CONTENT_METADATA} if fmt else {}
    sd = {"model": model.sharded_state_dict(metadata=metadata)}
    sd["optimizer"] = opt.sharded_state_dict(sd, metadata=metadata)
    # Megatron-LM's args as test_mcore writes them (Llama); the GPT config's through the converter's writer
    args = _megatron_args(cfg) if cfg.model.activation == "swiglu" else mcore.args_from_config(cfg, 0, 0, ROWS)
    fully = fmt == mcore_optimizer.FULLY
    vars(args).update(bf16=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      use_distributed_optimizer=bool(fmt),
                      dist_ckpt_optim_fully_reshardable=fully, transformer_impl="local")  # fmt: skip
    sd.update(args=args, checkpoint_version=3.0, iteration=MEGATRON_ITERS, opt_param_scheduler=sched.state_dict(),
              num_floating_point_operations_so_far=0)  # fmt: skip
    dist_checkpointing.save(sd, _fresh(os.path.join(root, f"iter_{MEGATRON_ITERS:07d}")), content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, mcore.TRACKER), "w") as f:
            f.write(str(MEGATRON_ITERS))
    torch.distributed.barrier()


def _resume(cfg, root, distributed: bool = True):
    """megatron-core's trainer at DP2 loaded from `root` as Megatron-LM's load_checkpoint does (the format
    named by the checkpoint's content metadata)."""
    from megatron.core import dist_checkpointing

    model, ddp, opt, sched = _trainer(cfg, distributed)
    if not distributed:  # Float16OptimizerWithFloat16Params: its own sharded_state_dict sets its state up
        path = mcore.iteration_dir(root)
        sd = {"model": model.sharded_state_dict()}
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True)
        loaded = dist_checkpointing.load(sd, path)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        return model, opt
    # without Apex/TE, DistributedOptimizer.state_dict() takes Adam's step from torch's per-parameter state,
    # empty before a first step: megatron-core's own dummy state (zero gradients, one step), which the load
    # replaces in place (masters, moments, step; the model's weights come from the checkpoint)
    opt.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
    path = mcore.iteration_dir(root)
    metadata = dist_checkpointing.load_content_metadata(path)
    sd = {"model": model.sharded_state_dict(metadata=metadata)}
    sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(sd, path)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])
    inner = opt.chained_optimizers[0].optimizer
    for group in inner.param_groups:  # see the module docstring: one step tensor per parameter, as loaded
        for p in group["params"]:
            inner.state[p]["step"] = torch.tensor(float(group["step"]))
    return model, ddp, opt, sched


def _ours_by_mcore_key(load, cfg) -> dict:
    """{kind: {global key: tensor}} of our checkpoint `load` (masters and moments), through the converter's
    name mapping."""
    weights, moments, step, _ = mcore.our_full_state(load)
    out = {"param": mcore.to_mcore(weights, cfg)}
    out |= {k: mcore.to_mcore({n: m[k] for n, m in moments.items()}, cfg) for k in mcore_optimizer.MOMENTS}
    return {"state": out, "step": step}


def _float16_case(rank, cfg, root):
    """megatron-core's non-distributed bf16 optimizer at DP2: (what it holds, the import's summary and state)."""
    model, ddp, opt, sched = _trainer(cfg, distributed=False)
    _steps(cfg, ddp, opt, sched, 0, MEGATRON_ITERS)
    held = _held_float16(model, opt)
    _save(cfg, model, opt, sched, os.path.join(root, "float16"), None)
    out = None
    if rank == 0:
        summary = mcore.import_checkpoint(os.path.join(root, "float16"), os.path.join(root, "float16-ours"))[1]
        out = (held, summary, _ours_by_mcore_key(os.path.join(root, "float16-ours"), cfg))
    torch.distributed.barrier()
    return out


def _layout_case(rank, cfg, root, tp: int, pp: int, name: str):
    """The DistributedOptimizer at TP`tp` x PP`pp` (DP1; a stage a rank at PP2) takes 2 Adam steps on
    random fp32 gradients in its own buffers (the layout is the test, not the data) and saves both
    formats: {format: the import's (summary, state)} (fully_reshardable: megatron-core's own model-space
    gather of the flat buffers)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model, ddp, opt, sched = _trainer(cfg, tp=tp, stage=rank if pp > 1 else None)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(MEGATRON_ITERS):
        for buffer in ddp.buffers:
            buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=gen) * 1e-2)
        ddp.finish_grad_sync()
        assert opt.step()[0]
        sched.step(increment=cfg.train.global_batch_size)
    out = {}
    for fmt in FORMATS:
        _save(cfg, model, opt, sched, os.path.join(root, f"{name}-{fmt}"), fmt, tp=tp, pp=pp)
        if rank == 0:
            summary = mcore.import_checkpoint(
                os.path.join(root, f"{name}-{fmt}"), os.path.join(root, f"{name}-{fmt}-o")
            )
            out[fmt] = (summary[1], _ours_by_mcore_key(os.path.join(root, f"{name}-{fmt}-o"), cfg))
        torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    return out


def _all_cases(rank, world, root):
    _distopt_shims()
    from megatron.core import parallel_state

    cfg = _cfg(FLAGS, world)
    parallel_state.initialize_model_parallel(1, 1)  # TP1, DP2
    float16 = _float16_case(rank, cfg, root)
    gpt = _cfg(GPT_FLAGS + RUN + " --bf16", world)  # tied embedding (a last stage's copy), biases, positions
    layouts = {name: _layout_case(rank, c, root, tp, pp, name)
               for name, c, tp, pp in (("tp2", cfg, 2, 1), ("pp2", cfg, 1, 2), ("gpt-pp2", gpt, 1, 2))}  # fmt: skip
    model, ddp, opt, sched = _trainer(cfg)
    written = _steps(cfg, ddp, opt, sched, 0, MEGATRON_ITERS)
    held = _held(model, opt)
    for fmt in FORMATS:
        _save(cfg, model, opt, sched, os.path.join(root, fmt), fmt)
    out = {"written": written, "held": held if rank == 0 else None, "imported": {}, "float16": float16, **layouts}
    for fmt in FORMATS:
        if rank == 0:
            summary = mcore.import_checkpoint(os.path.join(root, fmt), os.path.join(root, f"{fmt}-ours"))[1]
            out["imported"][fmt] = (summary, _ours_by_mcore_key(os.path.join(root, f"{fmt}-ours"), cfg))
        torch.distributed.barrier()
    fully = _resume(cfg, os.path.join(root, mcore_optimizer.FULLY))  # megatron-core resumes either format alike
    out["fully_reference"] = _steps(cfg, *fully[1:], MEGATRON_ITERS, cfg.train.train_iters)
    ref_model, ref_ddp, ref_opt, ref_sched = _resume(cfg, os.path.join(root, mcore_optimizer.DP))
    reference = _steps(cfg, ref_ddp, ref_opt, ref_sched, MEGATRON_ITERS, cfg.train.train_iters)
    ours = os.path.join(root, "ours")
    flags = f"{FLAGS} --zero-stage 1 --ckpt-format torch_dist --save {ours} --load {root}/{mcore_optimizer.DP}-ours"
    history = training.train(training.setup(_cfg(flags, world)))
    out["steps"] = ([(h["loss"], h["lr"]) for h in history], reference)
    after = _held(ref_model, ref_opt)  # a gather: every rank
    out["after"] = (_ours_by_mcore_key(ours, cfg), after) if rank == 0 else None
    if rank == 0:
        mcore.export_checkpoint(ours, os.path.join(root, "back"), distributed_optimizer=True)
    torch.distributed.barrier()
    back_model, _, back_opt, _ = _resume(cfg, os.path.join(root, "back"))
    back = _held(back_model, back_opt)
    if rank == 0:  # and without --use-distributed-optimizer: the non-distributed bf16 optimizer's format
        mcore.export_checkpoint(ours, os.path.join(root, "back16"))
    torch.distributed.barrier()
    back16 = _held_float16(*_resume(cfg, os.path.join(root, "back16"), distributed=False))
    out["back"] = {"distributed": back, "float16": back16, "ours": _ours_by_mcore_key(ours, cfg) if rank == 0 else None}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("distopt"))
    return run_distributed(_all_cases, 2, root, timeout=300)[0] | {"root": root}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_import_holds_megatrons_masters_moments_and_step_bitwise(results, fmt):
    summary, imported = results["imported"][fmt]
    held = results["held"]
    assert summary["optimizer_format"] == fmt and summary["step"] == MEGATRON_ITERS == imported["step"]
    assert held["step"] == {float(MEGATRON_ITERS)}
    for kind in KINDS:
        ours, theirs = imported["state"][kind], held["state"][kind]
        assert _max_diff(ours, theirs) == 0.0, kind
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), kind
    # the masters are not the bf16 weights: the import would be off by up to a bf16 rounding without them
    assert any(not torch.equal(m, m.bfloat16().float()) for m in imported["state"]["param"].values())


def test_float16_optimizer_imports_its_masters_and_step_bitwise(results):
    """The non-distributed bf16 optimizer (Float16OptimizerWithFloat16Params): its masters are
    `optimizer.state.fp32_param.*`, its step `optimizer.optimizer.state.common_step` (nested once more than
    FP32Optimizer's)."""
    held, summary, imported = results["float16"]
    assert summary["optimizer_format"] == "none" and summary["step"] == MEGATRON_ITERS == imported["step"]
    assert held["step"] == {float(MEGATRON_ITERS)}
    for kind in KINDS:
        assert _max_diff(imported["state"][kind], held["state"][kind]) == 0.0, kind


@pytest.mark.parametrize("layout", ["tp2", "pp2", "gpt-pp2"])
def test_dp_reshardable_at_tp2_and_pp2_imports_as_megatrons_own_gather(results, layout):
    """At TP2 each tensor-parallel rank writes its own flat buffers of its shards (SwiGLU's fc1: [gate | up]
    of its rows), at PP2 each stage of its layers: the import equals that of the fully_reshardable
    checkpoint, megatron-core's own gather."""
    (flat_summary, flat), (_, fully) = results[layout][mcore_optimizer.DP], results[layout][mcore_optimizer.FULLY]
    assert flat_summary["optimizer_format"] == mcore_optimizer.DP and flat["step"] == fully["step"] == 2
    for kind in KINDS:
        assert _max_diff(flat["state"][kind], fully["state"][kind]) == 0.0, kind


def test_three_steps_here_equal_megatrons_own_resume(results):
    """Both formats resume alike in megatron-core; ours, from the import, within bf16's reach of it: the same
    weights give losses 6e-5 apart (two bf16 forwards), and an element whose gradient is at that noise level
    may take its Adam step (at most about the lr, 2.6e-3) the other way."""
    ours, reference = results["steps"]
    assert len(ours) == len(reference) == 3 and results["fully_reference"] == reference
    assert np.allclose([lr for _, lr in ours], [lr for _, lr in reference], rtol=1e-6, atol=0)
    losses = np.array([loss for loss, _ in ours]), np.array([loss for loss, _ in reference])
    assert np.allclose(*losses, rtol=1e-4, atol=0), losses
    after, ref = results["after"]
    assert after["step"] == 5 and ref["step"] == {5.0}
    assert _max_diff(after["state"]["param"], ref["state"]["param"]) <= 4e-3
    for kind in mcore_optimizer.MOMENTS:
        scale = max(v.abs().max().item() for v in ref["state"][kind].values())
        assert _max_diff(after["state"][kind], ref["state"][kind]) <= 1e-2 * scale, kind


@pytest.mark.parametrize("optimizer", ["distributed", "float16"])
def test_export_loads_into_megatrons_optimizers(results, optimizer):
    """--use-distributed-optimizer: its DistributedOptimizer (fully_reshardable) at DP2; without: its
    Float16OptimizerWithFloat16Params (the masters as fp32_param, the step nested as it nests it)."""
    loaded, ours = results["back"][optimizer], results["back"]["ours"]
    assert loaded["step"] == {ours["step"]} == {5.0}
    for kind in KINDS:
        assert _max_diff(loaded["state"][kind], ours["state"][kind]) == 0.0, kind


@pytest.mark.parametrize("dtype", ["--bf16", "--fp16"])
@pytest.mark.parametrize("distributed", [False, True])
def test_step_is_the_checkpoints_not_the_iteration(tmp_path, capsys, distributed, dtype):
    """Iteration 5 after 2 Adam steps (3 skipped, as an fp16 overflow skips them): the step comes back 2,
    from state.common_step or param_groups[*].step; the fp32 masters of a bf16 or fp16 run come back
    bitwise, under either optimizer's name (fp32_param, param)."""
    cfg = _cfg(LLAMA_FLAGS + RUN + " " + dtype)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(cfg.model, ROWS).named_parameters()}
    moments = {n: {k: torch.rand(w.shape, generator=gen) for k in mcore.MOMENTS} for n, w in weights.items()}
    save_full_dcp(str(tmp_path / "ours"), cfg, weights, moments, 2.0, 5, 20)
    to = ["--load", str(tmp_path / "ours"), "--to", "megatron", "--save", str(tmp_path / "mlm")]
    assert _convert(to + ["--use-distributed-optimizer"] * distributed) == 0
    path = mcore.iteration_dir(str(tmp_path / "mlm"))
    assert mcore_optimizer.sharding_type(mcore.read_common(path)) == (mcore_optimizer.FULLY if distributed else "none")
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    saved = mcore.read_tensors(path)
    assert saved[qkv].dtype == (torch.bfloat16 if dtype == "--bf16" else torch.float16)
    assert saved[f"optimizer.state.{'param' if distributed else 'fp32_param'}.{qkv}"].dtype == torch.float32
    back = ["--from", "megatron", "--load", str(tmp_path / "mlm"), "--to", "sharded", "--save", str(tmp_path / "b")]
    assert _convert(back) == 0
    assert "iteration 5, Adam step 2 (" in capsys.readouterr().out
    got, got_moments, step, meta = mcore.our_full_state(str(tmp_path / "b"))
    assert (step, meta["iteration"]) == (2.0, 5)
    assert all(torch.equal(got[n], w) for n, w in weights.items())
    assert all(torch.equal(got_moments[n][k], moments[n][k]) for n in weights for k in mcore.MOMENTS)


def test_what_is_not_read_is_refused_by_name(results, monkeypatch):
    """megatron-core's own dp_reshardable checkpoint, read with what would make it unreadable here: one
    CheckpointError naming the cause, never a wrong layout read."""
    path = mcore.iteration_dir(os.path.join(results["root"], mcore_optimizer.DP))
    common, tensors = mcore.read_common(path), mcore.read_tensors(path)

    def refusal(args) -> str:
        with pytest.raises(CheckpointError) as e:
            mcore_optimizer.read_adam(path, common, tensors, args, mcore.read_objects)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "written at TP1 x PP2 (1 model-parallel groups" in refusal(
        argparse.Namespace(**{**vars(common["args"]), "pipeline_model_parallel_size": 2})
    )
    uneven = argparse.Namespace(**{**vars(common["args"]), "decoder_first_pipeline_num_layers": 1})
    assert "--decoder-first-pipeline-num-layers" in refusal(uneven)
    # a layer order the buffers do not follow: its masters do not round to the weights, for either spec
    monkeypatch.setitem(mcore_optimizer.LAYER_ORDER, "local", mcore_optimizer.LAYER_ORDER["local"][::-1])
    monkeypatch.setitem(mcore_optimizer.LAYER_ORDER, "transformer_engine", mcore_optimizer.LAYER_ORDER["local"])
    why = refusal(common["args"])
    assert "match no megatron-core parameter layout" in why and "do not round to the checkpoint's weights" in why
    assert "convert with --no-optim" in why


def test_masters_that_are_not_fp32_or_not_the_weights_are_refused(results):
    """--use-precision-aware-optimizer's int16 remainders in place of masters, or masters that do not round
    to the checkpoint's own weights: refused by name, in one line."""
    path = mcore.iteration_dir(os.path.join(results["root"], mcore_optimizer.FULLY))
    common, tensors = mcore.read_common(path), mcore.read_tensors(path)
    key = "optimizer.state.param.decoder.final_layernorm.weight"
    for value, cause in ((tensors[key].to(torch.int16), "(torch.int16)"), (tensors[key] + 0.1, "do not round")):
        with pytest.raises(CheckpointError, match="decoder.final_layernorm.weight") as e:
            mcore_optimizer.read_adam(path, common, tensors | {key: value}, common["args"], mcore.read_objects)
        assert cause in str(e.value) and "\n" not in str(e.value)
