"""Loss scaling for --fp16 (Megatron-LM's meaning and defaults).

The loss is multiplied by the scale before the backward, so that small fp16 gradients do not
flush to zero; the engine divides the fp32 gradients by it before clipping. A step whose
gradients hold an inf or NaN (its global norm is not finite, which every rank sees alike) is
skipped: no optimizer update, and the learning-rate schedule does not advance. Megatron's
dynamic rule: each overflow takes one from the hysteresis count and halves the scale when the
count is spent (never below --min-loss-scale); after --loss-scale-window steps without one the
scale doubles and the count is refilled. --loss-scale S keeps S (a step that overflows is still
skipped). Scales are powers of two, so scaling and unscaling are exact in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth_tracker: int = 0  # steps since the last overflow or growth
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, t) -> LossScaler | None:
        """The scaler --fp16 asks for (TrainConfig), or None without --fp16."""
        if not t.fp16:
            return None
        if t.loss_scale is not None:
            return cls(float(t.loss_scale), dynamic=False)
        window, hysteresis = t.loss_scale_window, t.hysteresis
        return cls(float(t.initial_loss_scale), True, t.min_loss_scale, window, hysteresis, 0, hysteresis)

    @staticmethod
    def overflowed(grad_norm: float) -> bool:
        return not math.isfinite(grad_norm)

    def update(self, overflow: bool) -> None:
        """After a step: Megatron's DynamicGradScaler rule (nothing changes a static scale)."""
        if not self.dynamic:
            return
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker, self.hysteresis_left = 0, self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker, self.hysteresis_left = int(state["growth_tracker"]), int(state["hysteresis_left"])
