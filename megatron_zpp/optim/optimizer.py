"""AdamW on fp32 master weights.

For an fp32 model the master weights are the parameters themselves. For bf16 the
optimizer keeps an fp32 copy of each parameter, steps it with the fp32 main gradient,
and writes the result back rounded to bf16 (Megatron's mixed-precision optimizer).
Norm weights and other 1-D parameters get no weight decay."""
from __future__ import annotations

import torch

from ..config import OptimConfig


class MixedPrecisionAdamW:
    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                        for p in self.params]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=True)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
