"""Learning-rate schedules, global-norm clipping, the gradient finalize shared by every
engine, and AdamW on fp32 masters."""

from .clipping import clip_, clip_by_global_norm, counted_once, global_grad_norm
from .finalize import finalize_model_grads
from .nonfinite import StepCheck, check_step
from .optimizer import MixedPrecisionAdamW, adamw_order, build_adamw, set_lr
from .schedules import learning_rate, learning_rate_at_samples, step_learning_rate

__all__ = [
    "learning_rate",
    "learning_rate_at_samples",
    "step_learning_rate",
    "global_grad_norm",
    "clip_",
    "clip_by_global_norm",
    "counted_once",
    "MixedPrecisionAdamW",
    "adamw_order",
    "build_adamw",
    "set_lr",
    "finalize_model_grads",
    "StepCheck",
    "check_step",
]
