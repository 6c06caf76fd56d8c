"""The short causal depthwise convolution of the delta-rule mixers (Gated DeltaNet, KDA: kernel 4 over q | k | v,
fla's ShortConvolution), with packed-document resets and, under context parallelism, the halo: the previous CP
slice's last kernel-1 tokens (context_parallel/halo.py). A neutral file: no mixer imports another's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..context_parallel.halo import previous_tokens
from .context import ParallelContext
from .documents import Documents


def conv_with_halo(x: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext, documents: Documents | None):
    """The causal convolution of this rank's tokens x [B, T, C], reading the kernel-1 tokens before them (the
    previous CP rank's, or zeros before the sequence) where they belong to the same document (`documents`:
    None when documents do not separate)."""
    (B, T, C), lead = x.shape, weight.shape[1] - 1
    halo = previous_tokens(x, lead, ctx.cp) if ctx.cp_size > 1 else x.new_zeros(B, lead, C)
    doc = None
    if documents is not None:  # document labels of the halo and the slice (-1: before the sequence)
        start = documents.offset - lead
        doc = F.pad(documents.doc_ids[:, max(start, 0) : documents.offset + T], (max(-start, 0), 0), value=-1)
    return causal_conv(torch.cat([halo, x], dim=1), weight, doc)[:, lead:]


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
