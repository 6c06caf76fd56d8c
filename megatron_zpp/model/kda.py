"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692; transformers' KimiLinearDeltaAttention, fla's KDA) as a layer.

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t

Gated DeltaNet with a per-channel decay a_t = exp(g_t) [K]. q, k, v: head-split projections, each through a short
causal depthwise convolution and SiLU; q and k L2-normalised as fla's l2norm (x / sqrt(sum x^2 + 1e-6));
b = sigmoid(x W_b) per head; the log decay from a low-rank projection of rank head_dim (Kimi Linear's f_a, f_b),
g = -exp(A_log) softplus(x W_fa W_fb + dt_bias) with A_log per head and dt_bias per channel. Output: RMSNorm over
each head's channels with one shared [head_dim] weight, times sigmoid(x W_ga W_gb) (the low-rank output gate
g_a, g_b), then the output projection.

Tensor parallelism: q | k | v | b and the up-projections f_b, g_b are split by heads (dt_bias, A_log and the
convolution with them); the down-projections f_a | g_a are replicated (one product with proj_in's input, as GLA's
low-rank gate) and their gradient, like the shared norm weight's, is a partial sum per TP rank.

Packed documents: g = -inf on every channel at each document's first token (chunk_kda's hard reset) and the
convolution reads no token of an earlier document. Context parallelism: the operator's state goes over the CP
ranks by --cp-algo through context_parallel/delta_rule.py with chunk_kda as the local operator (a dense [K, K]
transition), and the convolution reads the previous rank's last kernel-1 tokens (model/short_conv.py).

--attention-type kda (hybrids with --softmax-attention-every); chunk length --linear-chunk-size."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig, default_linear_chunk_size
from ..context_parallel.delta_rule import delta_rule_context_parallel
from ..ops.kda import chunk_kda
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark
from .context import ParallelContext
from .documents import Documents
from .norm import l2norm
from .short_conv import conv_with_halo

L2_EPS = 1e-6  # fla's l2norm (and transformers' copy of it): x / sqrt(sum x^2 + eps)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.ctx, self.chunk_size, self.eps = ctx, cfg.linear_chunk_size, cfg.norm_epsilon
        self.selective = cfg.recompute_granularity == "selective"
        self.heads, self.head_dim = cfg.num_attention_heads // ctx.tp_size, cfg.head_dim
        shape, std, tp = cfg.mixer_of_kind("kda"), cfg.init_method_std, ctx.tp_size
        heads, width, local, rank = shape.heads, shape.out_width, self.heads * self.head_dim, self.head_dim
        # q | k | v (width each) | b (one per head), each split by heads over TP
        self.proj_in = ColumnParallelLinear(cfg.hidden_size, list(shape.sections), ctx.tp, std, ctx.sequence_parallel)
        # f_a | g_a: the decay's and the output gate's down-projections, replicated over TP
        down = nn.Parameter(torch.empty(shape.replicated, cfg.hidden_size))
        self.gate_down = mark(down, ("normal", std), tp_partial_grad=tp > 1)
        self.decay_up = mark(nn.Parameter(torch.empty(local, rank)), ("normal", std), (0, (width,)))  # f_b
        self.gate_up = mark(nn.Parameter(torch.empty(local, rank)), ("normal", std), (0, (width,)))  # g_b
        bound = shape.conv_kernel**-0.5  # nn.Conv1d's default for a depthwise kernel (fla's, Kimi Linear's)
        conv = nn.Parameter(torch.empty(shape.conv_channels // tp, shape.conv_kernel))
        self.conv = mark(conv, ("uniform", -bound, bound), (0, (width,) * 3))  # q | k | v channels, depthwise
        # drawn at all heads (channels) and then sliced: A = exp(A_log) ~ U(1, 16) per head and dt_bias per
        # channel = softplus^-1(dt), dt = exp(U(log 1e-3, log 0.1)) clamped at 1e-4 (transformers' and fla's KDA)
        self.A_log = mark(nn.Parameter(torch.empty(self.heads)), ("log_of_uniform", 1.0, 16.0), (0, (heads,)))
        dt_init = ("softplus_inverse_of_log_uniform", 1e-3, 0.1, 1e-4)
        self.dt_bias = mark(nn.Parameter(torch.empty(local)), dt_init, (0, (width,)))
        self.head_norm = mark(nn.Parameter(torch.empty(self.head_dim)), ("ones",), tp_partial_grad=tp > 1)
        self.proj_out = RowParallelLinear(width, cfg.hidden_size, ctx.tp, out_std, ctx.sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, documents: Documents | None = None) -> torch.Tensor:
        # the gates' down-projection shares proj_in's input: one product keeps (under SP gathers) it once
        h, down = self.proj_in(x, self.gate_down)
        # selective recompute: everything between the projections runs again in the backward
        o = recompute.checkpoint(self._core, h, down, documents) if self.selective else self._core(h, down, documents)
        return self.proj_out(o)

    def _core(self, h: torch.Tensor, down: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """Convolution, gates, the KDA operator, head norm and output gate: [B, T, width/TP]."""
        B, T, _ = h.shape
        local, H, D = self.heads * self.head_dim, self.heads, self.head_dim
        qkv, b = h.split([3 * local, H], dim=-1)
        decay_down, gate_down = down.split(D, dim=-1)
        separate = documents is not None and documents.separate
        qkv = F.silu(conv_with_halo(qkv, self.conv, self.ctx, documents if separate else None))
        q, k, v = (t.view(B, T, H, D) for t in qkv.split(local, dim=-1))
        q, k = l2norm(q, L2_EPS), l2norm(k, L2_EPS)
        f = _fp32(F.linear(decay_down, self.decay_up)) + _fp32(self.dt_bias)
        g = -_fp32(self.A_log).exp()[:, None] * F.softplus(f.view(B, T, H, D))
        if separate:
            g = g.masked_fill(documents.starts(T)[:, :, None, None], float("-inf"))
        o = self._mix(q, k, v, g, _fp32(b).sigmoid())
        o = F.rms_norm(_fp32(o), (D,), eps=self.eps) * _fp32(self.head_norm)
        gate = _fp32(F.linear(gate_down, self.gate_up)).view(B, T, H, D).sigmoid()
        return (o * gate).reshape(B, T, local).to(h.dtype)

    def _mix(self, q, k, v, g, beta) -> torch.Tensor:
        ctx, chunk = self.ctx, self.chunk_size or default_linear_chunk_size(q.device.type)
        out_dtype = torch.promote_types(v.dtype, torch.float32)
        if ctx.cp_size > 1:  # this rank's slice; the state flows over the CP ranks
            algo, blocks = ctx.cp_algo, ctx.all_scan_blocks
            return delta_rule_context_parallel(
                q, k, v, g, beta, ctx.cp, algo, blocks, chunk_size=chunk, out_dtype=out_dtype, op=chunk_kda
            )
        return chunk_kda(q, k, v, g, beta, chunk_size=chunk, out_dtype=out_dtype)[0]  # any T (the op pads)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Gates and the norm run in fp32 for bf16 models (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
