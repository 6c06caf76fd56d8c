"""E experts, each an MLP of width `ffn_hidden_size` (SwiGLU, [gate | up] as megatron-core and our dense
MLP, or gelu), stored as stacked weights in the x @ W orientation a grouped GEMM takes:

    fc1 [E, H, 2F] (swiglu) or [E, H, F],  fc2 [E, F, H]

The input is the permuted tokens [M, H], expert-major with `tokens_per_expert` rows each; no bias (as
megatron-core's grouped experts and transformers' Qwen3-MoE / Mixtral experts)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import swiglu as swiglu_ops
from ..ops.grouped_gemm import grouped_mm
from .config import MoEConfig


class GroupedExperts(nn.Module):
    def __init__(self, cfg: MoEConfig, init_std: float = 0.02, out_std: float = 0.02, dtype=torch.float32):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
        self.fc1 = nn.Parameter(torch.empty(e, h, 2 * f if self.swiglu else f, dtype=dtype))
        self.fc2 = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        nn.init.normal_(self.fc1, std=init_std)
        nn.init.normal_(self.fc2, std=out_std)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        h = grouped_mm(x, self.fc1, tokens_per_expert)
        h = swiglu_ops.swiglu(h) if self.swiglu else F.gelu(h)
        return grouped_mm(h, self.fc2, tokens_per_expert)
