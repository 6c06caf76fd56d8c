"""Checkpoints: sharded save; load at the same layout (exact resume) or at another one
(resharded). See sharded.py for the format, reshard.py and layout.py for resharding."""
from .sharded import CheckpointError, load_checkpoint, read_meta, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_meta", "save_checkpoint"]
