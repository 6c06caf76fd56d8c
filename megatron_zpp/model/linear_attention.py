"""Gated linear attention (GLA, Yang et al. 2024) with per-key data-dependent decay.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,     o_t = scale * q_t S_t

The log-decay g = logsigmoid(W_g x) / normalizer is computed in log space and the
recurrence runs in the chunked form of ops/gla.py with an fp32 state. Output: per-head
RMSNorm, times a SiLU output gate, then the output projection. All projections are
split by heads over TP (the decay gate is full-rank so that it splits like q and k)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..ops.gla import chunk_gla
from ..sequence_parallel import gla_context_parallel
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark


class GatedLinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp, sequence_parallel: bool, out_std: float, cp=None, cp_algo="all-scan",
                 all_scan_blocks: int = 1):
        super().__init__()
        n = 1 if tp is None else tp.size
        self.cp, self.cp_algo, self.all_scan_blocks = cp, cp_algo, all_scan_blocks
        self.heads, self.head_dim = cfg.num_attention_heads // n, cfg.head_dim
        self.chunk_size, self.normalizer, self.eps = cfg.gla_chunk_size, cfg.gla_gate_normalizer, cfg.norm_epsilon
        width = cfg.num_attention_heads * cfg.head_dim
        # q | k | v | output gate | decay gate, each split by heads over TP
        self.proj_in = ColumnParallelLinear(cfg.hidden_size, [width] * 5, tp, cfg.init_method_std, sequence_parallel)
        self.head_norm = mark(nn.Parameter(torch.empty(self.heads * self.head_dim)), ("ones",), (0, (width,)))
        self.proj_out = RowParallelLinear(width, cfg.hidden_size, tp, out_std, sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:  # no positional encoding: decay orders tokens
        h = self.proj_in(x)
        B, T, _ = h.shape
        q, k, v, gate, g = (t.view(B, T, self.heads, self.head_dim) for t in h.chunk(5, dim=-1))
        g = F.logsigmoid(g.float()) / self.normalizer
        if self.cp is not None and self.cp.size > 1:  # this rank's slice; the state flows over the CP ranks
            o = gla_context_parallel(q, k, v, g, self.cp, self.cp_algo, self.all_scan_blocks,
                                     chunk_size=self.chunk_size)
        else:
            pad = -T % self.chunk_size  # e.g. generation: zero tokens at the end leave earlier outputs unchanged
            if pad:
                q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
            o = chunk_gla(q, k, v, g, chunk_size=self.chunk_size)[0][:, :T]
        o = F.rms_norm(o.float(), (self.head_dim,), eps=self.eps) * self.head_norm.float().view(self.heads, -1)
        o = o.to(x.dtype) * F.silu(gate)
        return self.proj_out(o.reshape(B, T, -1))
