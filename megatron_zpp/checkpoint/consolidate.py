"""Consolidate a sharded checkpoint into full single-rank weights (any saved layout).

    state, config = consolidate("ckpt")   # state: {param name: fp32 tensor}, as GPT(cfg.model, V) names them

Every rank file is checked against meta.json's sha256 and read as safetensors (nothing unpickled);
the parameters are reassembled by `reshard.SavedCheckpoint` (the same reader that
reshards a checkpoint into another layout on load), from the fp32 master weights.
"""
from __future__ import annotations

import json
import os

import torch

from .layout import config_from_dict
from .reshard import SavedCheckpoint
from .sharded import FORMAT, CheckpointError, read_meta


def find_checkpoint(ckpt_dir: str) -> tuple[str, dict]:
    """(iteration dir, meta) of `ckpt_dir/latest`, or of `ckpt_dir` when it is an iteration dir."""
    meta_path = os.path.join(ckpt_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path}: unknown format {meta.get('format')!r} (expected {FORMAT})")
        return ckpt_dir, meta
    found = read_meta(ckpt_dir)
    if found is None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint (no 'latest' file)")
    return found


def consolidate(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(full fp32 weights by single-rank parameter name, the run's config dict) of the
    checkpoint `ckpt_dir/latest` names (or of an iteration directory itself)."""
    path, meta = find_checkpoint(ckpt_dir)
    saved = SavedCheckpoint(path, meta)
    return {name: saved.full(name, moments=False)["param"] for name in saved.names()}, meta["config"]


def padded_vocab_of(state: dict) -> int:
    return state["embedding.weight"].shape[0]


__all__ = ["consolidate", "config_from_dict", "find_checkpoint", "padded_vocab_of"]
