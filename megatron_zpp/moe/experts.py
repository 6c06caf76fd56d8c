"""The routed experts: E MLPs of width `ffn_hidden_size` (SwiGLU, [gate | up] as megatron-core and our dense
MLP, or gelu), one parameter per expert in the x @ W orientation a grouped GEMM takes, keyed by the GLOBAL
expert index:

    experts.fc1.{e} [H, 2F / ETP] (swiglu; gelu: [H, F / ETP]),  experts.fc2.{e} [F / ETP, H]

A rank holds only its expert-parallel share (experts ep_rank * E/EP .. (ep_rank + 1) * E/EP - 1) and, under
expert tensor parallelism, its ETP slice of each (fc1 by output columns, gate and up sections alike; fc2 by
input rows). So expert parallelism is "which parameters a rank owns", as pipeline stages are: the
layout-independent init by name gives every layout the single-rank weights, and checkpoints reshard across
EP by name. Each weight is marked with its init rule and TP split (`tp_split`, over the ETP group, not TP)
and `expert_parallel = True` (its gradient is reduced over the expert-data-parallel group).

The forward stacks the local experts' weights with torch.stack (a copy of the rank's expert weights, and
its backward splits the gradient back) for one grouped GEMM over the permuted tokens [M, H], expert-major
with `tokens_per_expert` rows per LOCAL expert. No bias (megatron-core's grouped experts, transformers'
Qwen3-MoE / Mixtral experts)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ..ops import swiglu as swiglu_ops
from ..ops.grouped_gemm import grouped_mm
from ..tensor_parallel.layers import mark
from ..topology import Group
from .config import MoEConfig


def _size_rank(group: Group | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size, group.rank)


def local_experts(num_experts: int, ep: Group | None) -> range:
    """The global indices of the experts this EP rank holds (contiguous, E / EP of them)."""
    size, rank = _size_rank(ep)
    per_rank = num_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def check_expert_split(cfg: MoEConfig, ep_size: int, etp_size: int) -> None:
    """Raise ValueError (one line naming the flags) when the experts do not split over EP x ETP."""
    if cfg.num_experts % ep_size:
        raise ValueError(f"--num-experts {cfg.num_experts} is not divisible by --expert-model-parallel-size {ep_size}")
    if cfg.ffn_hidden_size % etp_size:
        raise ValueError(
            f"--moe-ffn-hidden-size {cfg.ffn_hidden_size} is not divisible by --expert-tensor-parallel-size {etp_size}"
        )


def _expert_weight(shape: tuple[int, int], std: float, tp_split: tuple, dtype: torch.dtype) -> nn.Parameter:
    p = mark(nn.Parameter(torch.empty(shape, dtype=dtype)), ("normal", std), tp_split=tp_split)
    p.expert_parallel = True  # type: ignore[attr-defined]
    if not p.is_meta:  # on meta (the planning tools, a sharded start-up) a draw is shapes only, and 3 ms an expert
        nn.init.normal_(p, std=std)  # a local draw, so that a layer built alone runs; the model's init redraws by name
    return p


class GroupedExperts(nn.Module):
    def __init__(
        self,
        cfg: MoEConfig,
        ep: Group | None = None,
        etp: Group | None = None,
        init_std: float = 0.02,
        out_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        etp_size = _size_rank(etp)[0]
        check_expert_split(cfg, _size_rank(ep)[0], etp_size)
        self.swiglu, self.grouped_gemm = cfg.activation == "swiglu", cfg.grouped_gemm
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        sections = (f, f) if self.swiglu else (f,)
        self.experts = local_experts(cfg.num_experts, ep)
        self.fc1 = nn.ParameterDict(
            {
                str(e): _expert_weight((h, sum(sections) // etp_size), init_std, (1, sections), dtype)
                for e in self.experts
            }
        )
        self.fc2 = nn.ParameterDict(
            {str(e): _expert_weight((f // etp_size, h), out_std, (0, (f,)), dtype) for e in self.experts}
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [M, H] expert-major over the local experts -> [M, H] (this rank's ETP partial sum under ETP)."""
        if not self.grouped_gemm and not is_fake(x):
            return self._each(x, tokens_per_expert)
        w1 = torch.stack([self.fc1[str(e)] for e in self.experts])
        w2 = torch.stack([self.fc2[str(e)] for e in self.experts])
        h = grouped_mm(x, w1, tokens_per_expert)
        h = swiglu_ops.swiglu(h) if self.swiglu else F.gelu(h)
        return grouped_mm(h, w2, tokens_per_expert)

    def _each(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Without --moe-grouped-gemm: one GEMM per local expert on its rows (megatron-core's SequentialMLP;
        the row counts are read on the host), the same sums as the grouped GEMM's."""
        out = []
        for e, rows in zip(self.experts, x.split(tokens_per_expert.tolist())):
            h = rows @ self.fc1[str(e)]
            out.append((swiglu_ops.swiglu(h) if self.swiglu else F.gelu(h)) @ self.fc2[str(e)])
        return torch.cat(out) if out else x.new_zeros(0, x.shape[-1])
