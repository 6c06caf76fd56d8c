"""A run: everything one rank trains with, set up from a validated config.

    cfg -> distributed init -> groups -> tokenizer -> model (init from the single-rank
    weights) -> data-parallel engine -> checkpoint (--load: ours, or megatron-core's converted on
    the fly) -> data iterators

With --load, setup restores the checkpoint (model and optimizer into the engine; the RNG
streams, iteration and data position into a TrainState) before the data iterator is built,
so the data continues where it stopped; the Run is built last, complete, and not changed
after (the loop changes its TrainState)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from dataclasses import dataclass, field

import torch

from ..checkpoint import CheckpointError, LoadTarget, Restored, SaveState, load_checkpoint
from ..checkpoint.files import locate_checkpoint, saved_iterations
from ..checkpoint.guard import guard_save_dir
from ..config import Config, ConfigError
from ..data.inputs import load_tokenizer
from ..data.loader import BatchIterator
from ..data.tokenizer import Tokenizer
from ..logging_utils import log, set_logging_level
from ..model import GPT, count_parameters, describe_block
from ..model.attention import describe_attention_backend
from ..ops.dispatch import KernelUnavailable, describe, set_kernels
from ..ops.norm import backend as norm_backend
from ..ops.quantize import quantizer_backend
from ..optim.loss_scaler import LossScaler
from ..optim.schedules import checkpoint_schedule, schedule_resume_warning
from ..pipeline_parallel import StageLink
from ..tensor_parallel.random import seed_parallel_rng
from ..topology import ProcessGroups
from ..validation.checkpoint import find_load, missing_checkpoint
from ..validation.model import model_warnings
from ..zero import DataParallelEngine, build_engine
from .builders import build_data, build_model, build_stage_link
from .determinism import apply_deterministic_mode
from .distributed import ExitSignal, init_distributed
from .evaluation import resume_valid_position
from .mcore_load import converted
from .profiling import MemorySnapshots, check_device
from .state import TrainState


@dataclass(frozen=True)
class Run:
    """Built once, complete, after the checkpoint restore. What changes as the run trains lives in
    `state` (the loop's counters, saved in checkpoints) and `saves` (the checkpoint code's own)."""

    cfg: Config
    groups: ProcessGroups
    device: torch.device
    rank: int
    tokenizer: Tokenizer
    chunks: list[GPT]  # this pipeline stage's model chunks (one, or V virtual stages)
    link: StageLink | None  # p2p to the neighbouring stages (None without PP)
    dp: DataParallelEngine  # gradient reduction, clipping, the optimizer step, their state
    train_data: BatchIterator
    valid_data: object
    state: TrainState  # iteration, consumed samples, loss scaler, ...: what the loop changes
    saves: SaveState = field(default_factory=SaveState)  # the last checkpoint, an --async-save in flight
    resharded_from: list[str] | None = None  # the layout changes a resharded --load went through
    exit_signal: ExitSignal | None = None  # installed at set-up, so a signal while loading is kept
    memory_snapshots: MemorySnapshots | None = None  # --record-memory-history (recording from set-up)
    # --use-checkpoint-opt_param-scheduler: optim.schedules.checkpoint_schedule
    checkpoint_schedule: tuple | None = None
    moe_metrics: dict = field(default_factory=dict)  # the last step's router losses and expert loads (MoE)
    started_at: float = 0.0  # time.time() at setup: --exit-duration-in-mins counts from it, as Megatron's start


def setup(cfg: Config) -> Run:
    started_at = time.time()
    set_logging_level(cfg.log.logging_level)
    deterministic = apply_deterministic_mode() if cfg.train.deterministic_mode else None  # before NCCL, cuBLAS
    groups, device = init_distributed(cfg)
    t = cfg.train
    exit_signal = ExitSignal(t.exit_signal_handler, t.exit_signal, device, t.exit_duration_in_mins, started_at)
    exit_signal.install()
    _check_device_and_kernels(cfg, device)
    memory_snapshots = MemorySnapshots(cfg, groups.rank, device)  # before the model: its allocations too
    if cfg.data.tokenizer_type_inferred:
        log(f"--tokenizer-type {cfg.data.tokenizer_type} (inferred: {cfg.data.tokenizer_type_inferred})", groups.rank)
    tokenizer = load_tokenizer(cfg, groups.tp.size)  # a bad tokenizer model is a ConfigError
    seed_parallel_rng(cfg.train.seed, groups.tp_rank, groups.pp_rank, groups.cp_rank, device)
    chunks, init = build_model(cfg, groups, tokenizer.padded_vocab_size, device)  # on meta: the engine fills them
    n_params = sum(count_parameters(c, groups.tp.size) for c in chunks)
    link = build_stage_link(cfg, groups, device)
    dp = build_engine(cfg, chunks, groups, init)
    state = TrainState(loss_scaler=LossScaler.from_config(cfg.train))
    restored, schedule = _restore_into(state, LoadTarget(cfg, groups, device, dp, tokenizer.padded_vocab_size))
    if cfg.train.save:
        _guard_save(cfg, groups, device, restored, state.iteration)
    resume_valid_position(cfg.train, state)
    assert state.consumed_valid_samples is not None  # resume_valid_position placed it
    train_data, valid_data = build_data(
        cfg,
        groups,
        tokenizer,
        device,
        consumed=state.consumed_samples,
        iteration=state.iteration,
        consumed_valid=state.consumed_valid_samples,
    )
    run = Run(
        cfg,
        groups,
        device,
        groups.rank,
        tokenizer,
        chunks,
        link,
        dp,
        train_data,
        valid_data,
        state,
        SaveState(last=restored.path if restored else None),
        resharded_from=restored.resharded_from if restored else None,
        exit_signal=exit_signal,
        memory_snapshots=memory_snapshots,
        checkpoint_schedule=schedule,
        started_at=started_at,
    )
    _log_setup(run, n_params)
    if deterministic:
        log(deterministic, run.rank)
    return run


def _check_device_and_kernels(cfg: Config, device) -> None:
    """The device the launch gave, and --kernels on it (one ConfigError line when they cannot run)."""
    check_device(cfg, device)
    try:
        set_kernels(cfg.train.kernels, device)
    except KernelUnavailable as e:
        raise ConfigError(str(e)) from None


def _restore_into(state: TrainState, target: LoadTarget):
    """--load / --pretrained-checkpoint: the model, optimizer, RNG and position into `state`; (what was
    restored, the checkpoint's LR schedule), both None without a load."""
    cfg = target.cfg
    if not (cfg.train.load or cfg.train.pretrained_checkpoint):
        return None, None
    restored, schedule = _restore(target)
    if restored:
        state.load_state_dict(restored.train_state)
        state.pending_rng_state, state.resumed_from = restored.rng_state, restored.path
    return restored, schedule


def _same_dir(a: str | None, b: str | None) -> bool:
    if not (a and b):
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def _restore(target: LoadTarget) -> tuple[Restored | None, tuple | None]:
    """--load or --pretrained-checkpoint restored, and the schedule of the checkpoint loaded
    (_schedule_from_checkpoint). A megatron-core torch_dist --load is converted on the fly (mcore_load)."""
    t, rank = target.cfg.train, target.rank
    if not (t.load and find_load(t.load, t.ckpt_step)[0] == "mcore"):
        restored = _load(target, t.load)
        return restored, _schedule_from_checkpoint(target.cfg, restored, rank)
    with converted(target, t.load) as (root, source):
        try:
            restored = _load(target, root)
        except CheckpointError as e:  # it names the temporary conversion: name --load instead
            raise CheckpointError(f"--load {t.load} (a megatron-core checkpoint, converted): {e}") from None
        schedule = _schedule_from_checkpoint(target.cfg, restored, rank)
    assert restored is not None  # the conversion holds one
    return dataclasses.replace(restored, path=source), schedule  # the run resumed from Megatron's directory


def _load(target: LoadTarget, load: str | None) -> Restored | None:
    """--load (`load`: the directory load_checkpoint reads): a checkpoint, or (as Megatron-LM) none: a
    warning, and the run starts from scratch."""
    t, rank = target.cfg.train, target.rank
    restored = load_checkpoint(target, load, t.ckpt_step) if load else None
    if not restored and t.pretrained_checkpoint:  # Megatron's: finetune from it while --load holds nothing
        restored = load_checkpoint(target, t.pretrained_checkpoint, finetune=True)
        if not restored:
            raise CheckpointError(
                f"--pretrained-checkpoint {t.pretrained_checkpoint}: holds no checkpoint (no 'latest', no meta.json)"
            )
        log(f"--load {t.load} holds no checkpoint: finetuning from --pretrained-checkpoint", rank)
    if restored:
        if restored.warning:
            log(f"warning: {restored.warning}", rank)
        log(f"loaded {restored.description}", rank)
        return restored
    assert t.load is not None  # without --load, --pretrained-checkpoint has loaded or raised above
    what = missing_checkpoint(t.load)
    if t.exit_on_missing_checkpoint:  # validation.check_load refuses it before any work; the directory changed since
        raise CheckpointError(f"--load {t.load}: {what} (--exit-on-missing-checkpoint)")
    also = " (it is also --save: a requeued job's first start)" if _same_dir(t.load, t.save) else ""
    log(f"warning: --load {t.load}: {what}{also}: starting from scratch (--exit-on-missing-checkpoint: an error)", rank)
    return None


def _schedule_from_checkpoint(cfg: Config, restored: Restored | None, rank: int) -> tuple | None:
    """--use-checkpoint-opt_param-scheduler: the loaded checkpoint's schedule, logged (Megatron's values);
    a resume whose schedule differs from its checkpoint's says how, and whose wins."""
    if restored is None:
        return None
    found = locate_checkpoint(restored.path)
    assert found is not None  # the checkpoint just loaded
    _, meta = found
    warning = schedule_resume_warning(cfg, meta["config"]) if restored.train_state else None  # not a finetune
    if warning:
        log(f"warning: {warning}", rank)
    if not cfg.optim.use_checkpoint_opt_param_scheduler:
        return None
    o, s = schedule = checkpoint_schedule(cfg, meta["config"])
    log(
        f"schedule from the checkpoint (--use-checkpoint-opt_param-scheduler): lr {o.lr:g} to {o.min_lr:g}, "
        f"{o.lr_decay_style}, warmup {s.warmup:g} and decay {s.decay:g} samples, weight decay "
        f"{o.weight_decay_incr_style} {o.weight_decay_span()[0]:g} to {o.weight_decay_span()[1]:g} over {s.wd_incr:g}",
        rank,
    )
    return schedule


def _guard_save(cfg: Config, groups: ProcessGroups, device, restored: Restored | None, iteration: int) -> None:
    """--save: this run's lock, and no overwriting a directory it did not load from (checkpoint/guard.py)."""
    t = cfg.train
    assert t.save is not None  # called for --save only
    loaded_root = os.path.dirname(restored.path) if restored else None
    guard_save_dir(t.save, loaded_root, t.override_checkpoint, groups.rank, groups, device)
    have = saved_iterations(t.save)
    if have and t.override_checkpoint and not _same_dir(loaded_root, t.save):
        log(
            f"--override-checkpoint: {os.path.abspath(t.save)} holds checkpoints up to iteration {have[-1]}; "
            f"this run saves over them from iteration {iteration + 1} on and moves 'latest' to its own",
            groups.rank,
        )


def _describe_experts(cfg: Config) -> str:
    """The start-up log's words for the MoE layers (empty without --num-experts)."""
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        return ""
    pattern = "".join("E" if m.is_moe_layer(i) else "-" for i in range(m.num_layers))
    shared = (
        f" + a shared expert of {m.moe_shared_expert_intermediate_size}"
        if m.moe_shared_expert_intermediate_size
        else ""
    )
    etp = p.expert_tp_size
    return (
        f", MLPs {pattern} (E: {m.num_experts} experts of {m.expert_ffn_size}, top-{m.moe_router_topk} "
        f"{m.moe_router_score_function}{shared}; EP {p.expert_model_parallel_size} x expert TP {etp}, "
        f"{m.moe_token_dispatcher_type} dispatcher)"
    )


def _log_setup(run: Run, n_params: int) -> None:
    cfg, groups, rank = run.cfg, run.groups, run.rank
    p = cfg.parallel
    log(
        f"layout: world {p.world_size} = TP {p.tensor_model_parallel_size} x CP {p.context_parallel_size} x "
        f"DP {p.data_parallel_size} x PP {p.pipeline_model_parallel_size} (order {p.order}, "
        f"{groups.topo.num_nodes} node(s) of {groups.topo.ranks_per_node} ranks), device {run.device}",
        rank,
    )
    kinds = [cfg.model.layer_kind(i) for i in range(cfg.model.num_layers)]
    log(
        f"model: {n_params / 1e6:.2f}M parameters on pipeline stage 0, layers "
        f"{''.join({'softmax': 'S', 'gla': 'G', 'gdn': 'D', 'kda': 'K'}[k] for k in kinds)} (S softmax, G GLA, "
        f"D GDN, K KDA; "
        f"{describe_block(cfg.model)}){_describe_experts(cfg)}, vocab "
        f"{run.tokenizer.vocab_size} padded to {run.tokenizer.padded_vocab_size}, "
        f"{_precision(cfg)}"
        f"{', blocks compiled (--torch-compile, inductor)' if cfg.train.torch_compile else ''}",
        rank,
    )
    te = "present, not used" if importlib.util.find_spec("transformer_engine") else "not installed"
    log(describe(run.device), rank)
    attention = describe_attention_backend(cfg.model.attention_backend, run.device)
    log(
        f"other ops: {norm_backend(run.device)}; attention: {attention}; ZeRO++ quantizers: {quantizer_backend()}; "
        f"transformer-engine: {te}{'; subnormal floats flushed to zero' if run.device.type == 'cpu' else ''}",
        rank,
    )
    log(f"{run.dp.describe()}; optimizer: {run.dp.optimizer_name}", rank)
    for warning in model_warnings(cfg):
        log(f"warning: {warning}", rank)


def _precision(cfg: Config) -> str:
    t = cfg.train
    if t.fp16:
        how = f"static scale {t.loss_scale:g}" if t.loss_scale else f"dynamic from {t.initial_loss_scale:g}"
        return f"fp16 compute + fp32 master weights, loss scaling ({how})"
    return "bf16 compute + fp32 master weights" if t.bf16 else "fp32"
