"""Checkpoints: sharded save; load at the same layout (exact resume) or at another one
(resharded). See sharded.py for the format, files.py for the rank-file codec, reshard.py
and layout.py for resharding."""

from .files import CheckpointError, read_meta
from .sharded import load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_meta", "save_checkpoint"]
