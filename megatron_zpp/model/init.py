"""Deterministic, layout-independent weight init.

Every parameter is drawn from its own generator, seeded by (seed, parameter name), at
its full single-rank shape, and then cut to this rank's TP shard. Names carry global
layer indices, so any TP/PP layout starts from exactly the single-rank weights, and a
tied embedding copy on the last pipeline stage equals the first stage's."""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn

from ..tensor_parallel.layers import shard


def full_shape(p: nn.Parameter, tp_size: int) -> list[int]:
    shape = list(p.shape)
    if getattr(p, "tp_split", None) is not None and tp_size > 1:
        shape[p.tp_split[0]] *= tp_size
    return shape


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    for name, p in model.named_parameters():
        rule = getattr(p, "init", ("normal", 0.02))
        if rule[0] == "ones":
            p.fill_(1.0)
        elif rule[0] == "zeros":
            p.zero_()
        else:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            full = torch.randn(full_shape(p, tp_size), generator=gen, dtype=torch.float32) * rule[1]
            p.copy_(shard(full, p.tp_split, tp_rank, tp_size))


def count_parameters(model: nn.Module, tp_size: int = 1) -> int:
    """Parameters of the full (unsharded) model part held here."""
    total = 0
    for p in model.parameters():
        n = 1
        for s in full_shape(p, tp_size):
            n *= s
        total += n
    return total
