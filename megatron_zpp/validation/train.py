"""The run: batch sizes and their schedules (ramp-up, step schedule), the optimizer and its LR
schedule, precision and loss scaling, run control (seed, dropout, exits)."""

from __future__ import annotations

import math

from ..config import Config, TrainConfig
from ..config.batch_schedule import parse_step_schedule
from ..optim.schedules import schedule_errors
from .common import derived, failed


def check_batch(cfg: Config, world_size: int) -> list[str]:
    p, t = cfg.parallel, cfg.train
    dp, pp, cp = p.data_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    per_step, batch = t.micro_batch_size * dp, derived(t.global_batch_size)
    errors = (
        failed(
            [
                (
                    batch % per_step == 0,
                    f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x DP = "
                    f"{t.micro_batch_size} x {dp}; use a multiple of {per_step}",
                )
            ]
        )
        + _check_rampup(t, per_step)
        + _check_step_schedule(cfg, per_step)
    )
    if t.train_iters_from_samples and derived(t.train_iters) < 1:
        errors.append(f"--train-samples {t.train_samples} is less than one step (--global-batch-size)")
    if p.num_layers_per_virtual_pipeline_stage is not None and not errors:
        # START, INCR: all ramp sizes follow; every batch of a step schedule
        sizes = sorted({batch, *t.rampup_batch_size[:2], *(b for _, b in t.batch_steps)})
        errors += failed(
            [
                (
                    (size // per_step) % pp == 0,
                    f"the interleaved schedule needs the number of micro-batches per step ({size // per_step} = "
                    f"batch {size} / (micro batch x DP)) to be a multiple of --pipeline-model-parallel-size {pp}",
                )
                for size in sizes
            ]
        )
    if t.generate_tokens:
        errors += failed(
            [
                (
                    pp == 1 and cp == 1,
                    "--generate-tokens needs --pipeline-model-parallel-size 1 and "
                    "--context-parallel-size 1 (or use tools/generate.py on a checkpoint)",
                )
            ]
        )
    return errors


def _check_step_schedule(cfg: Config, per_step: int) -> list[str]:
    """--step-batch-size-schedule: parsed as Megatron parses it, alone (not with a ramp-up), ending at the
    global batch, and every batch whole micro-batches (Megatron checks each as it comes)."""
    t, flag = cfg.train, "--step-batch-size-schedule"
    if not t.step_batch_size_schedule:
        return []
    try:
        steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as e:
        return [f"{flag} {t.step_batch_size_schedule!r}: {e}"]
    odd = sorted({b for _, b in steps if b % per_step})
    return failed(
        [
            (not t.rampup_batch_size, f"{flag} and --rampup-batch-size are two batch schedules: give one"),
            (
                steps[-1][1] == t.global_batch_size,
                f"{flag} ends at batch {steps[-1][1]} but --global-batch-size is {t.global_batch_size}: drop "
                "--global-batch-size (Megatron refuses both) or make them equal",
            ),
            (not odd, f"{flag}: batches {odd} are not multiples of --micro-batch-size x DP = {per_step}"),
        ]
    )


def _check_rampup(t: TrainConfig, per_step: int) -> list[str]:
    """--rampup-batch-size START INCR SAMPLES: every batch of the ramp is START + k INCR, so
    START and INCR multiples of micro x DP keep each one whole micro-batches (Megatron checks
    each batch as it comes; these two checks say it at start-up)."""
    if not t.rampup_batch_size:
        return []
    start, incr, _ = t.rampup_batch_size
    flag, batch = "--rampup-batch-size", derived(t.global_batch_size)
    return failed(
        [
            (t.train_samples is not None, f"{flag} needs --train-samples (sample-based training, as in Megatron)"),
            (
                start % per_step == 0 and incr % per_step == 0,
                f"{flag}: START {start} and INCR {incr} must be multiples of --micro-batch-size x DP = {per_step}",
            ),
            (
                start < batch and (batch - start) % incr == 0,
                f"{flag}: START {start} must be below --global-batch-size {t.global_batch_size} and reach it in "
                f"steps of INCR {incr}",
            ),
        ]
    )


def check_optim(cfg: Config, world_size: int) -> list[str]:
    o = cfg.optim
    checks = failed(
        [
            (math.isfinite(o.lr) and o.lr >= 0, f"--lr {o.lr} must be a finite number >= 0"),
            (
                not math.isfinite(o.lr) or 0 <= o.min_lr <= o.lr,
                f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}",
            ),
            (0 <= o.adam_beta1 < 1, f"--adam-beta1 {o.adam_beta1} must be in [0, 1)"),
            (0 <= o.adam_beta2 < 1, f"--adam-beta2 {o.adam_beta2} must be in [0, 1)"),
            (o.adam_eps > 0, f"--adam-eps {o.adam_eps} must be > 0"),
            (o.clip_grad >= 0, f"--clip-grad {o.clip_grad} must be >= 0 (0 turns clipping off)"),
            (o.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0"),
            (o.lr_warmup_samples >= 0, "--lr-warmup-samples must be >= 0"),
            (
                o.lr_warmup_fraction is None or 0 <= o.lr_warmup_fraction <= 1,
                f"--lr-warmup-fraction {o.lr_warmup_fraction} must be between 0 and 1",
            ),
            (
                o.lr_warmup_fraction is None or not (o.lr_warmup_iters or o.lr_warmup_samples),
                "give one of --lr-warmup-fraction, --lr-warmup-iters and --lr-warmup-samples",
            ),
            (
                not math.isfinite(o.lr) or 0 <= o.lr_warmup_init <= o.lr,
                f"--lr-warmup-init {o.lr_warmup_init} must be between 0 and --lr {o.lr}",
            ),
        ]
    )
    return checks + _check_schedule_units(cfg) + schedule_errors(cfg)  # the scheduler's own (optim/schedules.py)


def _check_schedule_units(cfg: Config) -> list[str]:
    """Megatron's rule: with --train-samples the LR schedule is given in samples, with
    --train-iters in iterations; a setting in the other unit is refused, not ignored."""
    o = cfg.optim
    if cfg.train.train_samples is not None:
        wrong = [("--lr-warmup-iters", o.lr_warmup_iters), ("--lr-decay-iters", o.lr_decay_iters)]
        wrong += [("--lr-wsd-decay-iters", o.lr_wsd_decay_iters)]
        return [
            f"{f} is for --train-iters: with --train-samples use {f.replace('iters', 'samples')}" for f, v in wrong if v
        ]
    wrong = [("--lr-warmup-samples", o.lr_warmup_samples), ("--lr-decay-samples", o.lr_decay_samples)]
    wrong += [("--lr-wsd-decay-samples", o.lr_wsd_decay_samples)]
    return [
        f"{f} needs --train-samples (with --train-iters use {f.replace('samples', 'iters')})" for f, v in wrong if v
    ]


def check_precision(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    return failed(
        [
            (not (t.fp16 and t.bf16), "give either --fp16 or --bf16, not both"),
            (
                t.loss_scale is None or t.loss_scale > 0,
                f"--loss-scale must be > 0 (got {t.loss_scale}; leave it out for dynamic scaling)",
            ),
            (
                0 < t.min_loss_scale <= t.initial_loss_scale,
                f"--min-loss-scale {t.min_loss_scale} must be > 0 and at most --initial-loss-scale "
                f"{t.initial_loss_scale}",
            ),
            (t.loss_scale_window >= 1, f"--loss-scale-window must be >= 1 (got {t.loss_scale_window})"),
            (t.hysteresis >= 1, f"--hysteresis must be >= 1 (got {t.hysteresis})"),
            (
                not (t.calculate_per_token_loss and cfg.data.eod_mask_loss),
                "--calculate-per-token-loss with --eod-mask-loss (a mean over the global batch's unmasked tokens) is "
                "not built: drop one (--eod-mask-loss alone averages each micro-batch's unmasked tokens)",
            ),
        ]
    )


def check_run_control(cfg: Config, world_size: int) -> list[str]:
    t, m = cfg.train, cfg.model
    return failed(
        [
            (0 <= t.seed < 2**32, f"--seed {t.seed} must be in [0, 2^32)"),
            (0 <= m.hidden_dropout < 1, f"--hidden-dropout {m.hidden_dropout} must be in [0, 1)"),
            (0 <= m.attention_dropout < 1, f"--attention-dropout {m.attention_dropout} must be in [0, 1)"),
            (t.max_skipped_steps >= 0, f"--max-skipped-steps must be >= 0 (got {t.max_skipped_steps})"),
            (t.exit_interval is None or t.exit_interval >= 1, f"--exit-interval must be >= 1 (got {t.exit_interval})"),
            (
                t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
                f"--exit-duration-in-mins must be > 0 (got {t.exit_duration_in_mins})",
            ),
            (t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0 (got {t.manual_gc_interval})"),
        ]
    )
