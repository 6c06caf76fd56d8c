"""Learning-rate schedules: linear warmup (the step that ends at u units of the warmup W
takes lr * u / W), then decay to --min-lr, reached at the end of the decay span (counted
from 0, warmup included, as Megatron counts it): constant, linear, cosine, or WSD: stay at
--lr, then decay over the last window of the span (default a tenth of the span after
the warmup).

Units are iterations with --train-iters (--lr-warmup-iters, --lr-decay-iters, default
the train iters; --lr-wsd-decay-iters) and samples with --train-samples
(--lr-warmup-samples, --lr-decay-samples, default the train samples;
--lr-wsd-decay-samples), where a step advances the schedule by its global batch, so a
batch-size ramp-up moves the schedule by the samples it really consumed (Megatron's
OptimizerParamScheduler, stepped by the batch). --lr-warmup-fraction sets the warmup to
that fraction of the decay span in either unit. With a constant batch G both units give
the same rate at every step (samples = G x iterations)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config, OptimConfig


@dataclass(frozen=True)
class Span:
    """Where the schedule's phases end, in one unit (iterations or samples)."""

    warmup: float
    decay: float
    wsd: float | None  # WSD window; None = a tenth of decay - warmup


def _span(cfg: OptimConfig, decay: int, warmup: int, wsd: int | None) -> Span:
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    return Span(warmup, decay, wsd)


def learning_rate(cfg: OptimConfig, iteration: int, train_iters: int) -> float:
    """LR for the optimizer step taken at `iteration` (0-based), iteration-based schedule."""
    span = _span(cfg, cfg.lr_decay_iters or train_iters, cfg.lr_warmup_iters, cfg.lr_wsd_decay_iters)
    return scheduled_lr(cfg, span, iteration, 1)


def learning_rate_at_samples(cfg: OptimConfig, consumed_samples: int, batch: int, train_samples: int) -> float:
    """LR for the step that starts after `consumed_samples` and takes `batch` samples."""
    span = _span(cfg, cfg.lr_decay_samples or train_samples, cfg.lr_warmup_samples, cfg.lr_wsd_decay_samples)
    return scheduled_lr(cfg, span, consumed_samples, batch)


def step_learning_rate(cfg: Config, iteration: int, consumed_samples: int) -> float:
    """LR of the next step of a run, in the unit its length was given in."""
    t = cfg.train
    if t.train_samples is None:
        return learning_rate(cfg.optim, iteration, t.train_iters)
    batch = t.global_batch_at(consumed_samples)
    return learning_rate_at_samples(cfg.optim, consumed_samples, batch, t.train_samples)


def scheduled_lr(cfg: OptimConfig, span: Span, done: float, size: float) -> float:
    """LR of a step that starts after `done` units and lasts `size` units."""
    warmup, decay_end = span.warmup, span.decay
    if warmup and done < warmup:
        return cfg.lr * min((done + size) / warmup, 1.0)
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    progress = min(max(done - warmup, 0) / max(decay_end - warmup, 1), 1.0)
    spread = cfg.lr - cfg.min_lr
    if cfg.lr_decay_style == "linear":
        return cfg.lr - spread * progress
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + spread * 0.5 * (1 + math.cos(math.pi * progress))
    # WSD: warmup, stable, then the final decay window
    wsd = span.wsd or max(1, (decay_end - warmup) // 10)
    into_decay = done - (decay_end - wsd)
    if into_decay < 0:
        return cfg.lr
    p = min(into_decay / wsd, 1.0)
    if cfg.lr_wsd_decay_style == "cosine":
        return cfg.min_lr + spread * 0.5 * (1 + math.cos(math.pi * p))
    if cfg.lr_wsd_decay_style == "exponential":
        return cfg.lr * (max(cfg.min_lr, 1e-12) / cfg.lr) ** p
    return cfg.lr - spread * p
