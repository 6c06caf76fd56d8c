"""Gated DeltaNet (Yang et al. 2025; fla's GatedDeltaNet, Qwen3-Next) as a layer.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t

q, k, v: head-split projections, each through a short causal depthwise convolution and SiLU;
q and k L2-normalised; b = sigmoid(x W_b) (2 sigmoid with --linear-allow-neg-eigval);
log a = -exp(A_log) * softplus(x W_a + dt_bias).
Output: per-head RMSNorm times silu(x W_gate), then the output projection. Every projection is
split by heads over TP (the convolution is per channel, A_log and dt_bias per head).

Packed documents: log a = -inf at each document's first token (the state resets) and the
convolution reads no token of an earlier document.

Context parallelism (context_parallel/gdn.py): the operator's state goes over the CP ranks by --cp-algo
(All-Scan, all-gather or ring), and the convolution reads the previous rank's last kernel-1 tokens.

--attention-type gdn (hybrids with --softmax-attention-every); chunk length --linear-chunk-size."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig, default_linear_chunk_size
from ..context_parallel.gdn import gdn_context_parallel
from ..context_parallel.halo import previous_tokens
from ..ops.gdn import chunk_gdn
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark
from .context import ParallelContext
from .documents import Documents


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.ctx, self.chunk_size, self.eps = ctx, cfg.linear_chunk_size, cfg.gdn_norm_epsilon
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0  # beta in (0, 2): negative eigenvalues
        self.selective = cfg.recompute_granularity == "selective"
        self.heads, self.head_dim = cfg.num_attention_heads // ctx.tp_size, cfg.head_dim
        shape, std = cfg.mixer_of_kind("gdn"), cfg.init_method_std
        heads, width = shape.heads, shape.out_width
        # q | k | v | output gate (width each) | a | b (one per head), each split by heads over TP
        self.proj_in = ColumnParallelLinear(cfg.hidden_size, list(shape.sections), ctx.tp, std, ctx.sequence_parallel)
        local, self.halo = self.heads * self.head_dim, shape.halo_tokens
        self.conv = mark(
            nn.Parameter(torch.empty(shape.conv_channels // ctx.tp_size, shape.conv_kernel)),
            ("normal", std),
            (0, (width,) * 3),
        )  # q | k | v channels, depthwise
        # per head, drawn at all heads and then sliced (TP-invariant): the decay rate A = exp(A_log), A ~ U(1, 16)
        # (megatron-core's range, Mamba2's; fla's U(0, 16) reaches A = 0, no decay), and the step bias
        # softplus^-1(dt), dt = exp(U(log 1e-3, log 0.1)) clamped at 1e-4 (fla's; megatron-core and Qwen3-Next: 1)
        self.A_log = mark(nn.Parameter(torch.empty(self.heads)), ("log_of_uniform", 1.0, 16.0), (0, (heads,)))
        dt_init = ("softplus_inverse_of_log_uniform", 1e-3, 0.1, 1e-4)
        self.dt_bias = mark(nn.Parameter(torch.empty(self.heads)), dt_init, (0, (heads,)))
        self.head_norm = mark(nn.Parameter(torch.empty(local)), ("ones",), (0, (width,)))
        self.proj_out = RowParallelLinear(width, cfg.hidden_size, ctx.tp, out_std, ctx.sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, documents: Documents | None = None) -> torch.Tensor:
        h = self.proj_in(x)
        # selective recompute: everything between the two projections runs again in the backward
        o = recompute.checkpoint(self._core, h, documents) if self.selective else self._core(h, documents)
        return self.proj_out(o)

    def _core(self, h: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """Convolution, gates, the delta-rule operator, head norm and output gate: [B, T, width/TP]."""
        B, T, _ = h.shape
        local, H, D = self.heads * self.head_dim, self.heads, self.head_dim
        qkv, gate, a, b = h.split([3 * local, local, H, H], dim=-1)
        separate = documents is not None and documents.separate
        qkv = F.silu(self._conv(qkv, documents if separate else None))
        q, k, v = (t.view(B, T, H, D) for t in qkv.split(local, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = -_fp32(self.A_log).exp() * F.softplus(_fp32(a) + _fp32(self.dt_bias))
        if separate:
            g = g.masked_fill(documents.starts(T)[:, :, None], float("-inf"))
        o = self._mix(q, k, v, g, _fp32(b).sigmoid() * self.beta_scale)
        o = F.rms_norm(_fp32(o), (D,), eps=self.eps) * _fp32(self.head_norm).view(H, D)
        return (o.reshape(B, T, local) * F.silu(_fp32(gate))).to(h.dtype)

    def _conv(self, qkv: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """The causal convolution of this rank's tokens, reading the kernel-1 tokens before them (the previous
        CP rank's, or zeros before the sequence) where they belong to the same document."""
        (B, T, C), lead, ctx = qkv.shape, self.halo, self.ctx
        halo = previous_tokens(qkv, lead, ctx.cp) if ctx.cp_size > 1 else qkv.new_zeros(B, lead, C)
        doc = None
        if documents is not None:  # document labels of the halo and the slice (-1: before the sequence)
            start = documents.offset - lead
            doc = F.pad(documents.doc_ids[:, max(start, 0) : documents.offset + T], (max(-start, 0), 0), value=-1)
        return causal_conv(torch.cat([halo, qkv], dim=1), self.conv, doc)[:, lead:]

    def _mix(self, q, k, v, g, beta) -> torch.Tensor:
        ctx, chunk, T = self.ctx, self.chunk_size or default_linear_chunk_size(q.device.type), q.shape[1]
        out_dtype = torch.promote_types(v.dtype, torch.float32)
        if ctx.cp_size > 1:  # this rank's slice; the state flows over the CP ranks
            return gdn_context_parallel(
                q, k, v, g, beta, ctx.cp, ctx.cp_algo, ctx.all_scan_blocks, chunk_size=chunk, out_dtype=out_dtype
            )
        pad = -T % chunk  # e.g. generation: zero tokens at the end leave earlier outputs unchanged
        if pad:
            q, k, v, g, beta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, g, beta))
        return chunk_gdn(q, k, v, g, beta, chunk_size=chunk, out_dtype=out_dtype)[0][:, :T]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over [B, T, C] (zeros before the first token); with document labels
    doc [B, T] a token reads only earlier tokens of its own document."""
    kernel, T = weight.shape[1], x.shape[1]
    out = x * weight[:, -1]
    for lag in range(1, kernel):
        shifted = F.pad(x, (0, 0, lag, 0))[:, :T]
        if doc is not None:  # the token lag back belongs to another document: read zero
            same = F.pad(doc, (lag, 0), value=-1)[:, :T] == doc
            shifted = shifted * same[..., None].to(x.dtype)
        out = out + shifted * weight[:, -1 - lag]
    return out


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Gates and the norm run in fp32 for bf16 models (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
