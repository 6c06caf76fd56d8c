"""Plain data parallelism (ZeRO stage 0): every rank holds the whole model chunk and its
optimizer state; full fp32 gradients are all-reduced over DP x CP before the step.

State dict ("model"): {"chunk{c}.{param name}": weight} and, for bf16, {"master.{i}":
fp32 master} (i: the parameter's index in this rank's chunks, in order)."""

from __future__ import annotations

import torch

from ..optim import MixedPrecisionAdamW, clip_by_global_norm, counted_once, finalize_model_grads
from ..topology import ProcessGroups
from .engine import DataParallelEngine, check_keys, copy_checked
from .grad_buffer import GradBuffer


class DDPEngine(DataParallelEngine):
    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroups, optim_cfg):
        self.chunks, self.groups = chunks, groups
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.grads = GradBuffer(self.params)
        self.optimizer = MixedPrecisionAdamW(self.params, optim_cfg)
        self.optimizer_name = self.optimizer.name
        self.clip = optim_cfg.clip_grad

    def describe(self) -> str:
        return (
            f"data parallel: plain, fp32 gradients all-reduced over DP x CP ({self.groups.dp_cp.size} ranks, "
            f"{self.groups.dp_cp.link})"
        )

    def zero_grad(self) -> None:
        self.grads.zero()

    def step(self, lr: float) -> float:
        g = self.groups
        tied = [c.embedding.weight.main_grad for c in self.chunks if hasattr(c, "embedding") and c.tied]
        finalize_model_grads([p.main_grad for p in self.params if getattr(p, "tp_partial_grad", False)], tied, g)
        self.grads.all_reduce_mean(g.dp_cp)
        counted = [p.main_grad for p in self.params if counted_once(p, g.tp_rank, g.is_first_stage)]
        norm = clip_by_global_norm(counted, [p.main_grad for p in self.params], [g.mp], self.clip)
        self.optimizer.step(lr)
        return norm

    # ---- state -------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {f"chunk{c}.{n}": p for c, chunk in enumerate(self.chunks) for n, p in chunk.named_parameters()}
        for i, (p, m) in enumerate(zip(self.optimizer.params, self.optimizer.masters)):
            if m is not p:  # bf16: the fp32 master is the real weight
                out[f"master.{i}"] = m
        return out

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: t.detach() for k, t in self._tensors().items()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self._tensors()
        check_keys(set(state), set(mine))
        for name, t in mine.items():
            copy_checked(name, t.data, state[name])
