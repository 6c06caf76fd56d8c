"""Causal softmax self-attention with grouped-query heads (GQA) and RoPE (or no rotation:
learned absolute positions are added to the embedding), on PyTorch
SDPA (flash / memory-efficient kernels on GPU, the math path on CPU). Heads are split
over TP: each rank holds num_heads/TP query heads and num_query_groups/TP kv heads.

--qk-layernorm-full-width (OLMo 2/3, OLMo Hybrid): q_norm and k_norm span all of a projection's heads (model/norm.py
FullWidthRMSNorm: its sum of squares summed over TP).

--attention-output-gate (megatron-core's, Qwen3-Next's): qkv also projects a gate per query channel, and the
attention output is multiplied by its sigmoid before the output projection. Our qkv rows are q | k | v | gate
(megatron-core interleaves q | gate | k | v per query group, Qwen3-Next q | gate per head in q_proj: the
converters reorder rows).

Packed documents (--reset-attention-mask): a boolean block-diagonal causal mask [B, 1, T, T]
built from the document ids (the math path on CPU). On GPU, SDPA with a mask runs the
memory-efficient kernel, not flash; the flash path would be per-document varlen attention
(flash_attn_varlen_func with cu_seqlens from the document starts, no [T, T] mask at all), or
FlexAttention's document mask, which skip the masked blocks: not built here."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig
from ..context_parallel import attention_context_parallel
from ..context_parallel.attention import explicit_attention
from ..ops import rope as rope_ops
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.random import model_parallel_rng
from .context import ParallelContext
from .documents import Documents
from .dropout import layout_invariant, probabilities_dropout, site
from .norm import FullWidthRMSNorm, build_norm

# --attention-backend (Megatron's names) -> the SDPA backends allowed on CUDA; auto: SDPA's own choice
_SDPA_BACKENDS = {
    "flash": ("FLASH_ATTENTION",),
    "fused": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"),
    "unfused": ("MATH",),
    "local": ("MATH",),
}


def describe_attention_backend(backend: str, device: torch.device) -> str:
    """The start-up log's words for the softmax attention path --attention-backend selects."""
    if device.type != "cuda":
        return f"torch SDPA, CPU kernel (--attention-backend {backend} selects a backend on CUDA only)"
    if backend == "auto":
        return "torch SDPA, its own backend choice (--attention-backend auto)"
    names = "/".join(_SDPA_BACKENDS[backend])
    return f"torch SDPA restricted to {names} (--attention-backend {backend}; packed documents and CP use masks)"


def _sdpa_backend(backend: str, device: torch.device):
    """A context restricting SDPA to --attention-backend's kernels on CUDA (a no-op elsewhere)."""
    if backend == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, n) for n in _SDPA_BACKENDS[backend]])


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float, layer: int = 0):
        super().__init__()
        self.cp = ctx.cp
        n, tp, sequence_parallel = ctx.tp_size, ctx.tp, ctx.sequence_parallel
        self.head_dim = d = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim  # --rotary-percent: the first channels of each head rotate
        self.heads, self.kv_heads = cfg.num_attention_heads // n, cfg.kv_heads // n
        self.dropout, self.dropout_masks, self.dropout_site = (
            cfg.attention_dropout,
            cfg.dropout_masks,
            site(layer, "probs"),
        )
        self.first_head = (tp.rank if n > 1 else 0) * self.heads  # this TP rank's heads: the masks' head keys
        self.backend = cfg.attention_backend
        self.selective = cfg.recompute_granularity == "selective"  # the core attention is recomputed in backward
        self.gated = cfg.attention_output_gate
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            list(cfg.mixer_of_kind("softmax").sections),  # q | k | v (| gate): each split by heads over TP
            tp,
            cfg.init_method_std,
            sequence_parallel,
            bias=cfg.qkv_bias,
        )
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, tp, out_std, sequence_parallel, bias=cfg.add_bias_linear
        )
        self.rotary_interleaved = cfg.rotary_interleaved
        self.q_norm = self.k_norm = None
        self.full_width_norm = cfg.qk_layernorm and cfg.qk_layernorm_full_width
        if self.full_width_norm:  # OLMo 2: over all of q's (k's) heads, weights split by heads over TP
            full = functools.partial(FullWidthRMSNorm, eps=cfg.norm_epsilon, tp=tp, tp_size=n)
            self.q_norm = full(cfg.num_attention_heads * d, one_plus=cfg.apply_layernorm_1p)
            self.k_norm = full(cfg.kv_heads * d, one_plus=cfg.apply_layernorm_1p)
        elif cfg.qk_layernorm:  # one [head dim] weight for all heads: replicated over TP, its grad a partial sum
            norm = functools.partial(build_norm, cfg.normalization, d, cfg.norm_epsilon, n > 1, cfg.apply_layernorm_1p)
            self.q_norm, self.k_norm = norm(), norm()

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, documents: Documents | None = None
    ) -> torch.Tensor:
        """rope: the cos/sin tables, or None (learned absolute positions, already in x, or none at all)."""
        qkv = self.qkv(x)
        B, T, _ = qkv.shape
        d = self.head_dim
        qk_width = (self.heads + self.kv_heads) * d  # q then k heads: one slice, rotated in place by the kernel
        qk = self._normed(qkv[..., :qk_width].view(B, T, -1, d))
        if rope is not None and self.rotary_interleaved:
            # the pairs (x[2i], x[2i+1]) moved to (i, i + r/2), where the rotation below pairs them; q and k are
            # reordered alike, so q . k is that of the interleaved rotation
            r = self.rotary_dim
            order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)]).to(qk.device)
            qk = qk[..., order]
        if rope is None:
            q, k = qk.split([self.heads, self.kv_heads], dim=2)
        elif self.rotary_dim == d:
            q, k = rope_ops.apply_rope_qk(qk, *rope, q_heads=self.heads)
        else:  # partial RoPE, as Megatron: rotate the first channels, pass the rest
            q, k = rope_ops.apply_rope_qk(qk[..., : self.rotary_dim].contiguous(), *rope, q_heads=self.heads)
            q = torch.cat([q, qk[:, :, : self.heads, self.rotary_dim :]], dim=-1)
            k = torch.cat([k, qk[:, :, self.heads :, self.rotary_dim :]], dim=-1)
        v = qkv[..., qk_width : qk_width + self.kv_heads * d].view(B, T, self.kv_heads, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        o = self._core_attention(q, k, v, documents).transpose(1, 2).reshape(B, T, self.heads * d)
        if self.gated:  # --attention-output-gate: per channel, local to the token (CP and SP need nothing more)
            o = _output_gate(o, qkv[..., qk_width + self.kv_heads * d :])
        return self.proj(o)

    def _normed(self, qk: torch.Tensor) -> torch.Tensor:
        """--qk-layernorm: each query and key head normalized (q's weight for q heads, k's for k heads); with
        --qk-layernorm-full-width all query heads together, and all key heads."""
        if self.q_norm is None or self.k_norm is None:
            return qk
        q, k = qk.split([self.heads, self.kv_heads], dim=2)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)

    def _core_attention(self, q, k, v, documents: Documents | None):
        dropout = self.dropout if self.training else 0.0
        doc_ids = documents.doc_ids if documents is not None else None  # None: attend across documents
        drop = None  # layout-invariant masks: the probabilities' dropout keyed on (sample, head, query, key)
        if dropout and layout_invariant(self.dropout_masks):
            drop = probabilities_dropout(dropout, self.dropout_site, self.first_head)
        per_rank = dropout and drop is None  # SDPA's dropout: heads differ per TP rank, so must its masks
        # the explicit path keeps no [b, heads, s, s] probabilities for the backward: it reruns, as flash does
        again = self.selective or drop is not None
        with model_parallel_rng() if per_rank else contextlib.nullcontext():
            if (self.cp is not None and self.cp.size > 1) or doc_ids is not None:
                # local queries against the keys of every CP slice, masked to their documents
                return attention_context_parallel(q, k, v, self.cp, dropout, self.training, doc_ids, again, drop)
            attend = functools.partial(_attend, self.backend, dropout, self.kv_heads != self.heads, drop)
            return recompute.checkpoint(attend, q, k, v) if again else attend(q, k, v)


def _output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate), the sigmoid in fp32 and the product back in o's dtype (megatron-core's
    `_apply_output_gate`; Qwen3-Next's `attn_output * torch.sigmoid(gate)`, the same in fp32)."""
    return (o * torch.sigmoid(gate.float())).to(o.dtype)


def _attend(backend: str, dropout: float, gqa: bool, drop, q, k, v):
    """Causal SDPA on --attention-backend's kernels (inside the function: a recompute reruns it the same way);
    with layout-invariant dropout masks (`drop`), the attention computed explicitly."""
    if drop is not None:
        return explicit_attention(q, k, v, None, drop, 0)
    with _sdpa_backend(backend, q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
