"""Learning-rate schedules: linear warmup over --lr-warmup-iters (step i of the warmup
takes lr * (i + 1) / warmup), then decay to --min-lr, reached at iteration
--lr-decay-iters (counted from 0, warmup included, as Megatron counts it; default the
train iters): constant, linear, cosine, or WSD: stay at --lr, then decay over the last
--lr-wsd-decay-iters before it (default a tenth of the iterations after the warmup)."""

from __future__ import annotations

import math

from ..config import OptimConfig


def learning_rate(cfg: OptimConfig, iteration: int, train_iters: int) -> float:
    """LR for the optimizer step taken at `iteration` (0-based)."""
    warmup = cfg.lr_warmup_iters
    if warmup and iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    decay_iters = cfg.lr_decay_iters or train_iters
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    progress = min(max(iteration - warmup, 0) / max(decay_iters - warmup, 1), 1.0)
    span = cfg.lr - cfg.min_lr
    if cfg.lr_decay_style == "linear":
        return cfg.lr - span * progress
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + span * 0.5 * (1 + math.cos(math.pi * progress))
    # WSD: warmup, stable, then the final decay window
    wsd = cfg.lr_wsd_decay_iters or max(1, (decay_iters - warmup) // 10)
    into_decay = iteration - (decay_iters - wsd)
    if into_decay < 0:
        return cfg.lr
    p = min(into_decay / wsd, 1.0)
    if cfg.lr_wsd_decay_style == "cosine":
        return cfg.min_lr + span * 0.5 * (1 + math.cos(math.pi * p))
    if cfg.lr_wsd_decay_style == "exponential":
        return cfg.lr * (max(cfg.min_lr, 1e-12) / cfg.lr) ** p
    return cfg.lr - span * p
