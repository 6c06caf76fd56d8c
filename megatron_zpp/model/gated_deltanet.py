"""Gated DeltaNet (Yang et al. 2025; fla's GatedDeltaNet, Qwen3-Next) as a layer.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t

q, k, v: head-split projections, each through a short causal depthwise convolution and SiLU;
q and k L2-normalised (fla's l2norm, eps 1e-6 on the sum of squares); b = sigmoid(x W_b)
(2 sigmoid with --linear-allow-neg-eigval);
log a = -exp(A_log) * softplus(x W_a + dt_bias). Output: a norm over each head's V channels with one
shared [V] weight, times silu(x W_gate), then the output projection. The norm is megatron-core's out_norm
(GatedDeltaNet builds it from the config: Transformer Engine's RMSNorm / LayerNorm, apex's or torch's without it),
in fp32, eps --norm-epsilon (--linear-norm-epsilon), o_t one head's [V] channels:

    RMSNorm                    y = o_t / sqrt(mean(o_t^2) + eps) * g
    LayerNorm                  y = (o_t - mean(o_t)) / sqrt(var(o_t) + eps) * g + b     (biased variance)
    g = w (init 1), or with --apply-layernorm-1p g = 1 + w (zero_centered_gamma, w init 0); b [V] init 0

--gdn-out-norm rmsnorm keeps the plain RMSNorm (g = w) whatever --normalization and --apply-layernorm-1p say
(fla's GatedDeltaNet; the checkpoints saved before the flag). Qwen3-Next's RMSNormGated stores g itself.

Heads as megatron-core's GatedDeltaNet (and Qwen3-Next's): Hk query/key heads of K channels and H value
heads of V (--linear-num-key-heads, --linear-num-value-heads, --linear-key-head-dim, --linear-value-head-dim);
H is a multiple of Hk and value head j reads key head j // (H / Hk); the state is K x V per value head.
Every projection is split by heads over TP, each rank holding whole groups (the convolution is per
channel, A_log and dt_bias per value head; the norm weight and bias are replicated, their gradients summed over TP).

Packed documents: log a = -inf at each document's first token (the state resets) and the
convolution reads no token of an earlier document.

Context parallelism (context_parallel/delta_rule.py): the operator's state goes over the CP ranks by --cp-algo
(All-Scan, all-gather or ring), and the convolution reads the previous rank's last kernel-1 tokens.

--attention-type gdn (hybrids with --softmax-attention-every); chunk length --linear-chunk-size."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig, default_linear_chunk_size
from ..context_parallel.delta_rule import delta_rule_context_parallel
from ..ops.gdn import chunk_gdn
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import mark
from .context import ParallelContext
from .documents import Documents
from .norm import gain, gain_init, l2norm
from .short_conv import conv_with_halo


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.ctx, self.chunk_size, self.eps = ctx, cfg.linear_chunk_size, cfg.gdn_norm_epsilon
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0  # beta in (0, 2): negative eigenvalues
        self.selective = cfg.recompute_granularity == "selective"
        shape, std, tp = cfg.mixer_of_kind("gdn"), cfg.init_method_std, ctx.tp_size
        # this rank's heads: whole groups of value heads with the key head they read (validation: both divide by TP)
        self.key_heads, self.heads = shape.key_heads // tp, shape.heads // tp
        self.key_dim, self.head_dim = shape.key_dim, shape.value_dim
        # q | k | v | output gate | a | b (one per value head), each split by heads over TP
        self.proj_in = ColumnParallelLinear(cfg.hidden_size, list(shape.sections), ctx.tp, std, ctx.sequence_parallel)
        self.halo, (qk, _, v) = shape.halo_tokens, shape.sections[:3]
        # q | k | v channels, depthwise; nn.Conv1d's default init (megatron-core's, fla's): kaiming_uniform(a=sqrt(5))
        # over a fan-in of the kernel, U(+-1/sqrt(kernel)); drawn at full width then sliced (TP-invariant)
        bound = shape.conv_kernel**-0.5
        self.conv = mark(
            nn.Parameter(torch.empty(shape.conv_channels // tp, shape.conv_kernel)),
            ("uniform", -bound, bound),
            (0, (qk, qk, v)),
        )
        # per value head, drawn at all heads then sliced (TP-invariant): the decay rate A = exp(A_log), A ~ U(1, 16)
        # (megatron-core's range, Mamba2's; fla's U(0, 16) reaches A = 0, no decay), and the step bias
        # softplus^-1(dt), dt = exp(U(log 1e-3, log 0.1)) clamped at 1e-4 (fla's; megatron-core and Qwen3-Next: 1)
        heads = (shape.heads,)
        self.A_log = mark(nn.Parameter(torch.empty(self.heads)), ("log_of_uniform", 1.0, 16.0), (0, heads))
        dt_init = ("softplus_inverse_of_log_uniform", 1e-3, 0.1, 1e-4)
        self.dt_bias = mark(nn.Parameter(torch.empty(self.heads)), dt_init, (0, heads))
        # the output norm (--gdn-out-norm): megatron-core's out_norm by --normalization / --apply-layernorm-1p
        kind, self.one_plus = cfg.gdn_norm
        per_head = cfg.gdn_head_norm == "per_head"
        self.head_norm = self._norm_parameter(per_head, gain_init(self.one_plus), v)
        self.head_norm_bias = self._norm_parameter(per_head, ("zeros",), v) if kind == "LayerNorm" else None
        self.proj_out = RowParallelLinear(v, cfg.hidden_size, ctx.tp, out_std, ctx.sequence_parallel)

    def _norm_parameter(self, per_head: bool, init: tuple, v: int) -> nn.Parameter:
        """An output-norm weight or bias: one [V] for every head (megatron-core, fla, Qwen3-Next), replicated over
        TP, each TP rank's heads giving a share of its gradient; or (--gdn-head-norm per_head) one per channel of
        every head, split with the heads."""
        if not per_head:
            return mark(nn.Parameter(torch.empty(self.head_dim)), init, tp_partial_grad=self.ctx.tp_size > 1)
        return mark(nn.Parameter(torch.empty(self.heads * self.head_dim)), init, (0, (v,)))

    def forward(self, x: torch.Tensor, rope=None, documents: Documents | None = None) -> torch.Tensor:
        h = self.proj_in(x)
        # selective recompute: everything between the two projections runs again in the backward
        o = recompute.checkpoint(self._core, h, documents) if self.selective else self._core(h, documents)
        return self.proj_out(o)

    def _core(self, h: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """Convolution, gates, the delta-rule operator, head norm and output gate: [B, T, width/TP]."""
        B, T, _ = h.shape
        Hk, H, K, V = self.key_heads, self.heads, self.key_dim, self.head_dim
        qkv, gate, a, b = h.split([2 * Hk * K + H * V, H * V, H, H], dim=-1)
        separate = documents is not None and documents.separate
        qkv = F.silu(self._conv(qkv, documents if separate else None))
        q, k, v = qkv.split([Hk * K, Hk * K, H * V], dim=-1)
        # the op runs on value heads: value head j reads key head j // (H / Hk) (megatron-core's repeat_interleave)
        q, k = (l2norm(t.view(B, T, Hk, K)).repeat_interleave(H // Hk, dim=2) for t in (q, k))
        g = -_fp32(self.A_log).exp() * F.softplus(_fp32(a) + _fp32(self.dt_bias))
        if separate:
            g = g.masked_fill(documents.starts(T)[:, :, None], float("-inf"))
        o = self._mix(q, k, v.view(B, T, H, V), g, _fp32(b).sigmoid() * self.beta_scale)
        return (self._norm(_fp32(o)).reshape(B, T, H * V) * F.silu(_fp32(gate))).to(h.dtype)

    def _norm(self, o: torch.Tensor) -> torch.Tensor:
        """The output norm over each head's V channels of o [B, T, H, V] (see the module docstring)."""
        V = self.head_dim
        scale = gain(self.head_norm, self.one_plus).to(o.dtype).view(-1, V)
        if self.head_norm_bias is None:
            return F.rms_norm(o, (V,), eps=self.eps) * scale
        return F.layer_norm(o, (V,), eps=self.eps) * scale + self.head_norm_bias.to(o.dtype).view(-1, V)

    def _conv(self, qkv: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """The causal convolution with the document resets and the CP halo (model/short_conv.py)."""
        return conv_with_halo(qkv, self.conv, self.ctx, documents)

    def _mix(self, q, k, v, g, beta) -> torch.Tensor:
        ctx, chunk = self.ctx, self.chunk_size or default_linear_chunk_size(q.device.type)
        out_dtype = torch.promote_types(v.dtype, torch.float32)
        if ctx.cp_size > 1:  # this rank's slice; the state flows over the CP ranks
            return delta_rule_context_parallel(
                q, k, v, g, beta, ctx.cp, ctx.cp_algo, ctx.all_scan_blocks, chunk_size=chunk, out_dtype=out_dtype
            )
        return chunk_gdn(q, k, v, g, beta, chunk_size=chunk, out_dtype=out_dtype)[0]  # any T (the op pads)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Gates and the norm run in fp32 for bf16 models (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
