"""Checkpoints: sharded save/load for the same parallel layout (see sharded.py for the format)."""
from .sharded import CheckpointError, load_checkpoint, read_meta, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_meta", "save_checkpoint"]
