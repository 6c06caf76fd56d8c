"""Gated linear attention (GLA, Yang et al. 2024) with per-key data-dependent decay.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,     o_t = scale * q_t S_t

The log-decay g = logsigmoid(gate logits) / normalizer is computed in log space and the
recurrence runs in the chunked form of ops/gla.py with an fp32 state. The gate logits
come from a full-rank projection (--gla-gate-low-rank 0: a fifth head-split section of
the input projection) or, as in the GLA paper, from a low-rank one x W_down W_up + b
(rank 16 there). Output: per-head RMSNorm, times a SiLU output gate, then the output
projection. Every projection is split by heads over TP; W_down is replicated, and its
gradient, computed from this rank's heads only, is a partial sum over TP. The projections take
no bias whatever --add-bias-linear says (Megatron's flag names softmax attention's and the MLP's
linears; the GLA paper's and flash-linear-attention's projections have none, and the remote-code
HF export holds none); the block's MLP follows the flag.

Packed documents (--reset-attention-mask): the log decay of each document's first token is
-inf, so exp(g) = 0 erases all earlier state there; the chunked form, the kernels and the CP
state scan (whose slice decay gamma is then 0) keep this exact and finite, and the gate's
gradient at those tokens is 0."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig, default_linear_chunk_size
from ..context_parallel import gla_context_parallel
from ..ops.gla import chunk_gla
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark
from .context import ParallelContext
from .documents import Documents


class GatedLinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.ctx = ctx
        self.heads, self.head_dim = cfg.num_attention_heads // ctx.tp_size, cfg.head_dim
        self.chunk_size, self.normalizer, self.eps = cfg.linear_chunk_size, cfg.gla_gate_normalizer, cfg.norm_epsilon
        # None (a config that skipped validation's derive): the default of the device the forward runs on
        self.low_rank = cfg.gla_gate_low_rank
        self.selective = cfg.recompute_granularity == "selective"
        shape, std = cfg.mixer_of_kind("gla"), cfg.init_method_std
        width = shape.out_width
        # q | k | v | output gate (| decay gate when full rank), each split by heads over TP
        self.proj_in = ColumnParallelLinear(cfg.hidden_size, list(shape.sections), ctx.tp, std, ctx.sequence_parallel)
        if self.low_rank:
            local = self.heads * self.head_dim
            self.gate_down = mark(
                nn.Parameter(torch.empty(self.low_rank, cfg.hidden_size)),
                ("normal", std),
                tp_partial_grad=ctx.tp_size > 1,
            )
            self.gate_up = mark(nn.Parameter(torch.empty(local, self.low_rank)), ("normal", std), (0, (width,)))
            self.gate_bias = mark(nn.Parameter(torch.empty(local)), ("zeros",), (0, (width,)))
        self.head_norm = mark(nn.Parameter(torch.empty(self.heads * self.head_dim)), ("ones",), (0, (width,)))
        self.proj_out = RowParallelLinear(width, cfg.hidden_size, ctx.tp, out_std, ctx.sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, documents: Documents | None = None) -> torch.Tensor:
        # no positional encoding: the decay orders tokens
        # the low-rank gate's down-projection shares proj_in's input: one product keeps (and under
        # sequence parallelism gathers) that input once for both
        h, down = self.proj_in(x, self.gate_down) if self.low_rank else (self.proj_in(x), None)
        # selective recompute: everything between the two projections runs again in the backward
        o = recompute.checkpoint(self._core, h, down, documents) if self.selective else self._core(h, down, documents)
        return self.proj_out(o)

    def _core(self, h: torch.Tensor, down: torch.Tensor | None, documents: Documents | None) -> torch.Tensor:
        """Gates, the chunked operator, head norm and output gate: [B, T, width/TP] before proj_out."""
        B, T, _ = h.shape
        parts = h.chunk(4 if self.low_rank else 5, dim=-1)
        gate_logits = parts[4] if not self.low_rank else F.linear(down, self.gate_up, self.gate_bias)
        q, k, v, gate, g = (t.view(B, T, self.heads, self.head_dim) for t in (*parts[:4], gate_logits))
        g = F.logsigmoid(_at_least_fp32(g)) / self.normalizer
        if documents is not None and documents.separate:  # a hard reset at each document start
            g = g.masked_fill(documents.starts(T)[:, :, None, None], float("-inf"))
        o = _at_least_fp32(self._mix(q, k, v, g))
        o = F.rms_norm(o, (self.head_dim,), eps=self.eps) * self.head_norm.to(o.dtype).view(self.heads, -1)
        o = o.to(h.dtype) * F.silu(gate)
        return o.reshape(B, T, -1)

    def _mix(self, q, k, v, g) -> torch.Tensor:
        ctx, T = self.ctx, q.shape[1]
        chunk = self.chunk_size or default_linear_chunk_size(q.device.type)
        if ctx.cp_size > 1:  # this rank's slice; the state flows over the CP ranks
            return gla_context_parallel(q, k, v, g, ctx.cp, ctx.cp_algo, ctx.all_scan_blocks, chunk_size=chunk)
        pad = -T % chunk  # e.g. generation: zero tokens at the end leave earlier outputs unchanged
        if pad:
            q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        # o stays in the compute dtype (fp32 for bf16 inputs): the head norm reads it without a bf16 round trip
        out_dtype = torch.promote_types(v.dtype, torch.float32)
        return chunk_gla(q, k, v, g, chunk_size=chunk, out_dtype=out_dtype)[0][:, :T]


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Gates and the head norm run in fp32 for bf16 models (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
