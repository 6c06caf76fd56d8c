"""A run: everything one rank trains with, set up from a validated config.

    cfg -> distributed init -> groups -> tokenizer -> model (init from the single-rank
    weights) -> data-parallel engine -> checkpoint (--load) -> data iterators

With --load, setup restores the checkpoint (model, optimizer, RNG, iteration, data
position) before the data iterator is built, so the data continues where it stopped."""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field

import torch

from ..checkpoint import CheckpointError, load_checkpoint
from ..checkpoint.files import locate_checkpoint, saved_iterations
from ..checkpoint.guard import guard_save_dir
from ..config import Config, ConfigError
from ..data.inputs import load_tokenizer
from ..data.loader import BatchIterator
from ..logging_utils import log, set_logging_level
from ..model import GPT, count_parameters, describe_block
from ..model.attention import describe_attention_backend
from ..ops.dispatch import KernelUnavailable, describe, set_kernels
from ..ops.norm import backend as norm_backend
from ..ops.quantize import quantizer_backend
from ..optim.loss_scaler import LossScaler
from ..optim.schedules import checkpoint_schedule
from ..pipeline_parallel import StageLink
from ..tensor_parallel.random import seed_parallel_rng
from ..topology import ProcessGroups
from ..zero import DataParallelEngine, build_engine
from .builders import build_data, build_model, build_stage_link
from .determinism import apply_deterministic_mode
from .distributed import ExitSignal, init_distributed
from .evaluation import resume_valid_position
from .profiling import MemorySnapshots, check_device


@dataclass
class Run:
    cfg: Config
    groups: ProcessGroups
    device: torch.device
    rank: int
    tokenizer: object
    chunks: list[GPT]  # this pipeline stage's model chunks (one, or V virtual stages)
    link: StageLink | None  # p2p to the neighbouring stages (None without PP)
    dp: DataParallelEngine  # gradient reduction, clipping, the optimizer step, their state
    train_data: BatchIterator
    valid_data: object
    iteration: int = 0
    consumed_samples: int = 0
    resharded_from: list[str] | None = None  # the layout changes a resharded --load went through
    load_warning: str | None = None  # a --load that worked but is worth one line (a legacy, unverified meta.json)
    stopped_by_signal: bool = False  # --exit-signal-handler: the signal ended train() early
    exit_signal: ExitSignal | None = None  # installed at set-up, so a signal while loading is kept
    memory_snapshots: MemorySnapshots | None = None  # --record-memory-history (recording from set-up)
    tracking: dict = field(default_factory=dict)  # run metadata kept in checkpoints: {"wandb_run_id": ...}
    # --fp16: the loss scaler; steps skipped on overflow (they do not advance the LR schedule)
    loss_scaler: LossScaler | None = None
    skipped_iterations: int = 0
    skipped_samples: int = 0
    checkpoint_schedule: tuple | None = (
        None  # --use-checkpoint-opt_param-scheduler: optim.schedules.checkpoint_schedule
    )
    last_step_skipped: bool = False
    consecutive_skips: int = 0  # --fp16: overflowing steps in a row (more than --max-skipped-steps stops the run)
    pending_rng_state: dict | None = None  # a same-layout --load's RNG streams, set right before the first step
    last_checkpoint: str | None = None  # the iteration dir last saved or loaded: where a stopped run resumes
    pending_save: object | None = None  # an --async-save in flight (checkpoint/async_save.SaveJob), sealed later
    dcp_writer_group: object | None = None  # --async-save --ckpt-format torch_dist: DCP's own gloo group
    stopped_by: str | None = None  # why train() stopped before --train-iters (signal, interrupt, interval, duration)
    stop_request: tuple = (0, 0, 0)  # the last step's agreed stop lanes (ExitSignal.lanes)
    resumed_from: str | None = None  # the checkpoint --load restored, until the first step's record names it
    started_at: float = 0.0  # time.time() at setup: --exit-duration-in-mins counts from it, as Megatron's start
    consumed_valid_samples: int | None = None  # where the validation iterator continues (None: not known yet)
    final_evaluation: dict = field(default_factory=dict)  # train(final_evaluation=True): val/test loss and ppl


def setup(cfg: Config) -> Run:
    started_at = time.time()
    set_logging_level(cfg.log.logging_level)
    deterministic = apply_deterministic_mode() if cfg.train.deterministic_mode else None  # before NCCL, cuBLAS
    groups, device = init_distributed(cfg)
    t = cfg.train
    exit_signal = ExitSignal(t.exit_signal_handler, t.exit_signal, device, t.exit_duration_in_mins, started_at)
    exit_signal.install()
    check_device(cfg, device)
    try:
        set_kernels(cfg.train.kernels, device)
    except KernelUnavailable as e:
        raise ConfigError(str(e)) from None
    memory_snapshots = MemorySnapshots(cfg, groups.rank, device)  # before the model: its allocations too
    if cfg.data.tokenizer_type_inferred:
        log(f"--tokenizer-type {cfg.data.tokenizer_type} (inferred: {cfg.data.tokenizer_type_inferred})", groups.rank)
    tokenizer = load_tokenizer(cfg, groups.tp.size)  # a bad tokenizer model is a ConfigError
    seed_parallel_rng(cfg.train.seed, groups.tp_rank, groups.pp_rank, groups.cp_rank, device)
    chunks, init = build_model(cfg, groups, tokenizer.padded_vocab_size, device)  # on meta: the engine fills them
    n_params = sum(count_parameters(c, groups.tp.size) for c in chunks)
    run = Run(
        cfg,
        groups,
        device,
        groups.rank,
        tokenizer,
        chunks,
        build_stage_link(cfg, groups, device),
        build_engine(cfg, chunks, groups, init),
        None,
        None,
        exit_signal=exit_signal,
        memory_snapshots=memory_snapshots,
        loss_scaler=LossScaler.from_config(cfg.train),
        started_at=started_at,
    )
    if cfg.train.load or cfg.train.pretrained_checkpoint:  # model, optimizer, RNG, position
        _load(run)
    if cfg.train.save:
        _guard_save(run)
    resume_valid_position(run)
    run.train_data, run.valid_data = build_data(
        cfg,
        groups,
        tokenizer,
        device,
        consumed=run.consumed_samples,
        iteration=run.iteration,
        consumed_valid=run.consumed_valid_samples,
    )
    _log_setup(run, n_params)
    if deterministic:
        log(deterministic, run.rank)
    return run


def _same_dir(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _load(run: Run) -> None:
    """--load: a checkpoint, or nothing only where --load is --save (the first start of a requeued job)."""
    t = run.cfg.train
    restored = load_checkpoint(run, t.load, t.ckpt_step) if t.load else None
    if not restored and t.pretrained_checkpoint:  # Megatron's: finetune from it while --load holds nothing
        restored = load_checkpoint(run, t.pretrained_checkpoint, finetune=True)
        if not restored:
            raise CheckpointError(
                f"--pretrained-checkpoint {t.pretrained_checkpoint}: holds no checkpoint (no 'latest', no meta.json)"
            )
        log(f"--load {t.load} holds no checkpoint: finetuning from --pretrained-checkpoint", run.rank)
    if restored:
        if run.load_warning:
            log(f"warning: {run.load_warning}", run.rank)
        log(f"loaded {restored}", run.rank)
        run.resumed_from = run.last_checkpoint
        _schedule_from_checkpoint(run)
    elif _same_dir(t.load, t.save) and not t.exit_on_missing_checkpoint:
        log(f"no checkpoint in {os.path.abspath(t.load)} yet (it is also --save): starting from scratch", run.rank)
    else:
        what = "does not exist" if not os.path.exists(t.load) else "holds no checkpoint (no 'latest', no meta.json)"
        why = " (--exit-on-missing-checkpoint)" if t.exit_on_missing_checkpoint else ""
        raise CheckpointError(
            f"--load {t.load}: {what}{why}; give a checkpoint root or an iteration directory in it, "
            "or drop --load to start from scratch"
        )


def _schedule_from_checkpoint(run: Run) -> None:
    """--use-checkpoint-opt_param-scheduler: the loaded checkpoint's schedule, logged (Megatron's values)."""
    if not run.cfg.optim.use_checkpoint_opt_param_scheduler:
        return
    _, meta = locate_checkpoint(run.last_checkpoint)
    run.checkpoint_schedule = o, s = checkpoint_schedule(run.cfg, meta["config"])
    log(
        f"schedule from the checkpoint (--use-checkpoint-opt_param-scheduler): lr {o.lr:g} to {o.min_lr:g}, "
        f"{o.lr_decay_style}, warmup {s.warmup:g} and decay {s.decay:g} samples, weight decay "
        f"{o.weight_decay_incr_style} {o.weight_decay_span()[0]:g} to {o.weight_decay_span()[1]:g} over {s.wd_incr:g}",
        run.rank,
    )


def _guard_save(run: Run) -> None:
    """--save: this run's lock, and no overwriting a directory it did not load from (checkpoint/guard.py)."""
    t = run.cfg.train
    loaded_root = os.path.dirname(run.last_checkpoint) if run.last_checkpoint else None
    guard_save_dir(t.save, loaded_root, t.override_checkpoint, run.rank, run.groups, run.device)
    have = saved_iterations(t.save)
    if have and t.override_checkpoint and not _same_dir(loaded_root, t.save):
        log(
            f"--override-checkpoint: {os.path.abspath(t.save)} holds checkpoints up to iteration {have[-1]}; "
            f"this run saves over them from iteration {run.iteration + 1} on and moves 'latest' to its own",
            run.rank,
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
        f"{''.join('S' if k == 'softmax' else 'G' for k in kinds)} (S softmax, G GLA; "
        f"{describe_block(cfg.model)}), vocab "
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
        f"transformer-engine: {te}",
        rank,
    )
    log(f"{run.dp.describe()}; optimizer: {run.dp.optimizer_name}", rank)


def _precision(cfg: Config) -> str:
    t = cfg.train
    if t.fp16:
        how = f"static scale {t.loss_scale:g}" if t.loss_scale else f"dynamic from {t.initial_loss_scale:g}"
        return f"fp16 compute + fp32 master weights, loss scaling ({how})"
    return "bf16 compute + fp32 master weights" if t.bf16 else "fp32"
