"""Dropout masks that do not depend on the parallel layout (--dropout-masks layout-invariant, the default).

A generator per rank draws different masks on every layout: data-parallel ranks take other micro-batches than
the single rank's sequence of them, pipeline stages and context-parallel slices draw from other streams. Here an
element's mask is a pure function of where it sits in the global batch: the seed, the dropout site (embedding,
each layer's mixer and MLP outputs, each softmax layer's probabilities), the sample's position in the run's
sample stream (the sampler's index: data/loader.py puts it in every batch as `samples`), the token's position in
the sequence, and the channel (hidden dropout) or the head and key position (attention dropout). Every layout
then drops exactly the single rank's elements, an activation recompute redraws the same mask with no generator
state, and a resumed run the uninterrupted run's.

The function is a 32-bit integer hash (two multiply-xorshift rounds, constants from Wellons' hash prospector,
below 2^31 so that products of 32-bit values fit int64 on every device) applied axis by axis: a key per sample,
then per token, then per channel; an element is kept when its hash is at least p * 2^32. Its cost is a few
integer operations per element (an int64 temporary of the activation's size), paid only in training with p > 0.

Attention dropout under these masks runs the attention explicitly (scores, softmax, mask, product: the path
SDPA takes on CPU with dropout anyway); on GPUs this gives up the flash kernels' in-kernel dropout.
--dropout-masks per-rank keeps torch's generators (Megatron's behaviour: masks that differ per layout).

Without a micro-batch's sample positions (a layer run outside the training schedule) the per-rank path runs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..tensor_parallel import random as tp_random
from .context import ParallelContext

_MASK32 = 0xFFFFFFFF
_MUL = (0x21F0AAAD, 0x735A2D97)
_AXIS_SALT = 0x9E3779B1  # a different stream per axis: tokens, channels, heads, keys hash apart


def _mix(h: torch.Tensor) -> torch.Tensor:
    """One 32-bit avalanche of int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL[0]) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL[1]) & _MASK32
    return h ^ (h >> 15)


def keep_mask(p: float, site: int, samples: torch.Tensor, axes: list[torch.Tensor]) -> torch.Tensor:
    """Bool [B, len(axes[0]), len(axes[1]), ...]: which elements survive dropout p at `site` for the samples
    at positions `samples` [B], the coordinates of each further axis given as int64 positions."""
    seed = tp_random.dropout_seed()
    key = torch.tensor((seed * 1000003 + site) & _MASK32, device=samples.device)
    h = _mix((samples.to(torch.int64) & _MASK32) ^ _mix(key))
    return _keep(h, [a.to(h.device, torch.int64) for a in axes], 1, int(p * 2**32))


HASH_SLICE = 1 << 22  # elements hashed at once: the int64 temporaries stay ~100 MB whatever the activation's size


def _keep(h: torch.Tensor, axes: list[torch.Tensor], n: int, threshold: int) -> torch.Tensor:
    """The masks below the prefix keys h, axis n onwards; in blocks of the leading axis when they are large."""
    h = _mix(h[..., None] ^ _mix((axes[0] + n * _AXIS_SALT) & _MASK32))
    if len(axes) == 1:
        return h >= threshold
    below = h.numel() // h.shape[-1] * math.prod(len(a) for a in axes[1:])  # elements per index of this axis
    step = max(1, HASH_SLICE // below)
    blocks = [_keep(h[..., i : i + step], axes[1:], n + 1, threshold) for i in range(0, h.shape[-1], step)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=h.dim() - 1)


def apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p), as nn.Dropout scales (autograd keeps the bool mask, as nn.Dropout does)."""
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def layout_invariant(masks: str) -> bool:
    """Whether this run draws layout-invariant masks now: the flag, and a micro-batch's sample positions."""
    return masks == "layout-invariant" and tp_random.micro_batch_samples() is not None


class HiddenDropout(nn.Module):
    """--hidden-dropout on this rank's [B, T, H] activation (its CP slice; its TP shard of the slice under
    sequence parallelism), keyed on (site, sample, token, channel)."""

    def __init__(self, p: float, site: int, ctx: ParallelContext, masks: str):
        super().__init__()
        self.p, self.site, self.ctx, self.masks = p, site, ctx, masks
        # per-rank fallback: sequence-parallel shards differ per TP rank, so must their masks
        self.per_rank = (tp_random.ShardedDropout if ctx.sequence_parallel else nn.Dropout)(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if not layout_invariant(self.masks):
            return self.per_rank(x)
        B, T, H = x.shape
        ctx, shards = self.ctx, self.ctx.tp_size if self.ctx.sequence_parallel else 1
        first = ctx.cp_rank * T * shards + (ctx.tp.rank * T if shards > 1 else 0)
        tokens = torch.arange(first, first + T, device=x.device)
        channels = torch.arange(H, device=x.device)
        samples = tp_random.micro_batch_samples()
        return apply_mask(x, keep_mask(self.p, self.site, samples, [tokens, channels]), self.p)


def probabilities_dropout(p: float, site: int, first_head: int):
    """The layout-invariant attention-probability dropout of one softmax layer (the caller uses it when
    `layout_invariant`; else SDPA's own): a function (probs [B, heads, Tq, Tk], first query position) -> the
    dropped probabilities, keyed on (site, sample, head,
    query, key). first_head: this TP rank's first head."""
    samples = tp_random.micro_batch_samples()

    def drop(probs: torch.Tensor, first_query: int) -> torch.Tensor:
        _, heads, Tq, Tk = probs.shape
        dev = probs.device
        axes = [
            torch.arange(first_head, first_head + heads, device=dev),
            torch.arange(first_query, first_query + Tq, device=dev),
            torch.arange(Tk, device=dev),
        ]
        return apply_mask(probs, keep_mask(p, site, samples, axes), p)

    return drop


def site(layer: int, what: str) -> int:
    """A dropout site's number: 0 the embedding; per layer its mixer output, MLP output, attention probabilities."""
    return 0 if what == "embedding" else 1 + 3 * layer + ("mixer", "mlp", "probs").index(what)
