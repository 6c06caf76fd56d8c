"""The shared expert: a dense MLP every token passes through beside the routed experts (megatron-core's
SharedExpertMLP, --moe-shared-expert-intermediate-size), optionally scaled per token by a sigmoid gate
Linear(h, 1) (--moe-shared-expert-gate; Qwen3-Next's `shared_expert_gate`). One rank: plain linears."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import swiglu as swiglu_ops
from .config import MoEConfig


class SharedExpert(nn.Module):
    def __init__(self, cfg: MoEConfig, init_std: float = 0.02, out_std: float = 0.02, dtype=torch.float32):
        super().__init__()
        assert cfg.shared_expert_size, "SharedExpert needs MoEConfig.shared_expert_size"
        self.swiglu = cfg.activation == "swiglu"
        h, s = cfg.hidden_size, cfg.shared_expert_size
        self.fc1 = nn.Linear(h, 2 * s if self.swiglu else s, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(s, h, bias=False, dtype=dtype)
        self.gate = nn.Linear(h, 1, bias=False, dtype=dtype) if cfg.shared_expert_gate else None
        for lin, std in ((self.fc1, init_std), (self.fc2, out_std), (self.gate, init_std)):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        out = self.fc2(swiglu_ops.swiglu(h) if self.swiglu else F.gelu(h))
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out
