"""Learning-rate schedules, global-norm clipping and the mixed-precision optimizer."""
from .finalize import finalize_model_grads
from .clipping import clip_, counted_once, global_grad_norm
from .optimizer import MixedPrecisionAdamW
from .schedules import learning_rate

__all__ = ["learning_rate", "global_grad_norm", "clip_", "counted_once", "MixedPrecisionAdamW", "finalize_model_grads"]
