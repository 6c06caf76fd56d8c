"""Logging, evaluation and profiling (Megatron's _add_logging_args and _add_validation_args)."""

from __future__ import annotations

from ..config import Config
from .common import derived, failed


def check_log(cfg: Config, world_size: int) -> list[str]:
    """Logging and evaluation (Megatron's _add_logging_args and _add_validation_args)."""
    g, t = cfg.log, cfg.train
    checks = [
        (g.log_interval >= 1, "--log-interval must be >= 1"),
        (
            g.tensorboard_log_interval >= 1,
            f"--tensorboard-log-interval {g.tensorboard_log_interval}: must be >= 1",
        ),
        (g.tensorboard_queue_size >= 1, f"--tensorboard-queue-size {g.tensorboard_queue_size}: must be >= 1"),
        (
            g.log_memory_interval is None or g.log_memory_interval >= 1,
            f"--log-memory-interval {g.log_memory_interval}: must be >= 1 (leave it out for none)",
        ),
        (
            g.logging_level is None or 0 <= g.logging_level <= 50,
            f"--logging-level {g.logging_level}: a level of Python's logging, 0 to 50 (10 DEBUG, 20 INFO, 30 WARNING)",
        ),
        (t.eval_iters >= 0, f"--eval-iters {t.eval_iters}: must be >= 0 (0: no evaluation)"),
        (t.eval_interval >= 0, f"--eval-interval {t.eval_interval}: must be >= 0 (0: none during training)"),
        (
            t.start_eval_at_iter is None or t.start_eval_at_iter >= 0,
            f"--start-eval-at-iter {t.start_eval_at_iter}: must be >= 0",
        ),
    ]
    return failed(checks + _eval_batch_checks(cfg)) + _check_profiling(cfg, world_size)


def _eval_batch_checks(cfg: Config) -> list:
    t, p = cfg.train, cfg.parallel
    micro = t.eval_micro_batch_size or t.micro_batch_size
    batch = t.eval_global_batch_size or derived(t.global_batch_size)
    per_round = micro * p.data_parallel_size
    return [
        (micro >= 1 and batch >= 1, "--eval-global-batch-size and --eval-micro-batch-size must be >= 1"),
        (
            micro < 1 or batch % per_round == 0,
            f"--eval-global-batch-size {batch} must be a multiple of the evaluation micro-batch {micro} x DP "
            f"{p.data_parallel_size} = {per_round}",
        ),
        (
            t.eval_micro_batch_size in (None, t.micro_batch_size) or p.pipeline_model_parallel_size == 1,
            f"--eval-micro-batch-size {t.eval_micro_batch_size} with pipeline parallelism is not built (the stages "
            f"exchange micro-batches of --micro-batch-size {t.micro_batch_size}): leave it out",
        ),
    ]


def _check_profiling(cfg: Config, world_size: int) -> list[str]:
    """--profile and --record-memory-history; what needs CUDA: check_device_needs."""
    g = cfg.log
    bad_ranks = [r for r in g.profile_ranks if not 0 <= r < world_size]
    return failed(
        [
            (g.profile or not g.use_pytorch_profiler, "--use-pytorch-profiler needs --profile (which steps to trace)"),
            (
                not g.profile or 0 <= g.profile_step_start < g.profile_step_end,
                f"--profile-step-start {g.profile_step_start} must be >= 0 and below --profile-step-end "
                f"{g.profile_step_end}",
            ),
            (
                not (g.profile or g.record_memory_history) or not bad_ranks,
                f"--profile-ranks {' '.join(map(str, bad_ranks))}: no such rank (world size {world_size})",
            ),
        ]
    )


def check_device_needs(cfg: Config, device_type: str) -> list[str]:
    """What needs CUDA, refused by name on another device: with the other refusals (validate's run checks,
    for the launch's device) and again by the run for the device it got."""
    g = cfg.log
    if device_type == "cuda":
        return []
    return failed(
        [
            (
                not (g.profile and not g.use_pytorch_profiler),
                f"--profile without --use-pytorch-profiler opens an nsys capture range (cudaProfilerStart), which "
                f"needs CUDA (device here: {device_type}); add --use-pytorch-profiler for a torch.profiler chrome "
                "trace",
            ),
            (
                not g.record_memory_history,
                f"--record-memory-history records the CUDA caching allocator "
                f"(torch.cuda.memory._record_memory_history), which needs CUDA (device here: {device_type}; torch "
                "keeps no such history for it): leave it out, or use --profile --use-pytorch-profiler for a trace "
                "of the steps",
            ),
        ]
    )
