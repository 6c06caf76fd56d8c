"""Pipeline parallelism: layer placement, p2p between stages, and the schedules
(no pipelining, 1F1B, interleaved 1F1B)."""

from .p2p import StageLink
from .schedules import run_schedule
from .stages import ChunkPlacement, build_stage_model, stage_chunks, stage_layers, virtual_stage_layers

__all__ = [
    "StageLink",
    "run_schedule",
    "ChunkPlacement",
    "build_stage_model",
    "stage_chunks",
    "stage_layers",
    "virtual_stage_layers",
]
