"""AdamW on fp32 master weights, and the one rule for its parameter groups.

Weight decay applies to matrices (>= 2-D) only, not to norm weights and biases; AdamW
numbers its parameters group by group, decayed first (`adamw_order`), which is also how
a checkpoint's optimizer state is indexed (checkpoint/layout.py reads it from here).

For an fp32 model the master weights are the parameters themselves. For bf16 the
optimizer keeps an fp32 copy of each parameter, steps it with the fp32 main gradient,
and writes the result back rounded to bf16 (Megatron's mixed-precision optimizer)."""

from __future__ import annotations

import torch

from ..config import OptimConfig


def adamw_order(ndims: list[int]) -> list[int]:
    """Indices of the parameters (by their ndim) in AdamW's numbering: decayed ones first."""
    return [i for i, n in enumerate(ndims) if n >= 2] + [i for i, n in enumerate(ndims) if n < 2]


def build_adamw(params: list[torch.Tensor], ndims: list[int], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over fp32 `params` whose model parameters have `ndims` dimensions."""
    order = adamw_order(ndims)
    decayed = sum(1 for n in ndims if n >= 2)
    groups = [
        {"params": [params[i] for i in order[:decayed]], "weight_decay": cfg.weight_decay},
        {"params": [params[i] for i in order[decayed:]], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class MixedPrecisionAdamW:
    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        self.opt = build_adamw(self.masters, [p.ndim for p in self.params], cfg)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        set_lr(self.opt, lr)
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
