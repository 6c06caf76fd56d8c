"""Learning-rate schedules, global-norm clipping, the gradient finalize shared by every
engine, and AdamW on fp32 masters."""

from .clipping import clip_, clip_by_global_norm, counted_once, global_grad_norm
from .finalize import finalize_model_grads
from .nonfinite import StepCheck, check_step
from .optimizer import MixedPrecisionAdamW, adamw_order, build_adamw, set_lr, set_rates
from .schedules import Rates, learning_rate, learning_rate_at_samples, rates_at

__all__ = [
    "learning_rate",
    "learning_rate_at_samples",
    "rates_at",
    "Rates",
    "global_grad_norm",
    "clip_",
    "clip_by_global_norm",
    "counted_once",
    "MixedPrecisionAdamW",
    "adamw_order",
    "build_adamw",
    "set_lr",
    "set_rates",
    "finalize_model_grads",
    "StepCheck",
    "check_step",
]
