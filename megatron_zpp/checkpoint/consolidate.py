"""Consolidate a sharded checkpoint into full single-rank weights (any saved layout).

    state, config = consolidate("ckpt")   # state: {param name: fp32 tensor}, as GPT(cfg.model, V) names them

The weights of `full_state.full_state` (the one reader of our checkpoints as full tensors: every file
checked against meta.json's sha256, the zpp format reassembled from its safetensors rank files, torch_dist
by DCP), with the run's config dict.
"""

from __future__ import annotations

import torch

from .files import find_checkpoint
from .full_state import full_state
from .layout import config_from_dict


def consolidate(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(full fp32 weights by single-rank parameter name, the run's config dict) of the
    checkpoint `ckpt_dir/latest` names (or of an iteration directory itself)."""
    s = full_state(ckpt_dir)
    return s.weights, s.config


def padded_vocab_of(state: dict) -> int:
    return state["embedding.weight"].shape[0]


__all__ = ["config_from_dict", "consolidate", "find_checkpoint", "padded_vocab_of"]
