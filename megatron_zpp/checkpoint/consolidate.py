"""Consolidate a sharded checkpoint into full single-rank weights (any saved layout).

    state, config = consolidate("ckpt")   # state: GPT(cfg.model, V).state_dict()'s names, fp32 tensors

The weights and persistent buffers (the routers' expert bias) of `full_state.full_state` (the one reader of
our checkpoints as full tensors: every file checked against meta.json's sha256, the zpp format reassembled
from its safetensors rank files, torch_dist by DCP), with the run's config dict: what a single-rank GPT's
`load_state_dict(state, strict=True)` takes.
"""

from __future__ import annotations

import torch

from .files import find_checkpoint
from .full_state import full_state
from .layout import config_from_dict


def consolidate(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(the single-rank model's state dict: full fp32 weights and the saved persistent buffers, by name; the
    run's config dict) of the checkpoint `ckpt_dir/latest` names (or of an iteration directory itself)."""
    s = full_state(ckpt_dir)
    return s.model_state(), s.config


def padded_vocab_of(state: dict) -> int:
    return state["embedding.weight"].shape[0]


__all__ = ["config_from_dict", "consolidate", "find_checkpoint", "padded_vocab_of"]
