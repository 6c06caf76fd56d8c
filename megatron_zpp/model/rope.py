"""Rotary position embedding (RoPE) tables, for the rotation of pairs (x[i], x[i + d/2]) as GPT-NeoX and
Llama do (ops/rope.py rotates). Positions are absolute, so a context-parallel rank passes its slice's offset;
with --reset-position-ids they are per token ([B, T], restarting at each document) and so are the tables."""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] (fp32) for integer `positions` [T], or [B, T, head_dim] for [B, T]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()
