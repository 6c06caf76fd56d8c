"""Consolidate a sharded checkpoint into full single-rank weights (any saved layout).

    state, config = consolidate("ckpt")   # state: {param name: fp32 tensor}, as GPT(cfg.model, V) names them

Every rank file is checked against meta.json's sha256 and read as safetensors (nothing unpickled);
the parameters are reassembled by `reshard.SavedCheckpoint` (the same reader that
reshards a checkpoint into another layout on load), from the fp32 master weights. A torch_dist
checkpoint (dcp.py) is checked the same way and assembled by DCP.
"""

from __future__ import annotations

import sys

import torch

from ..progress import progress
from .dcp import full_weights
from .files import DCP_FORMAT, find_checkpoint, legacy_warning
from .layout import config_from_dict
from .reshard import SavedCheckpoint


def consolidate(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(full fp32 weights by single-rank parameter name, the run's config dict) of the
    checkpoint `ckpt_dir/latest` names (or of an iteration directory itself)."""
    path, meta = find_checkpoint(ckpt_dir)
    if legacy_warning(meta):  # saved before meta.json.sha256: read, meta.json unverified
        print(f"warning: {legacy_warning(meta)}", file=sys.stderr)
    if meta["format"] == DCP_FORMAT:  # --ckpt-format torch_dist: DCP assembles the full tensors
        return dict(sorted(full_weights(path, meta).items())), meta["config"]
    saved = SavedCheckpoint(path, meta)
    names = progress(saved.names(), "consolidating", unit=" tensors")
    return {name: saved.full(name, moments=False)["param"] for name in names}, meta["config"]


def padded_vocab_of(state: dict) -> int:
    return state["embedding.weight"].shape[0]


__all__ = ["consolidate", "config_from_dict", "find_checkpoint", "padded_vocab_of"]
