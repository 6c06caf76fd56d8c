"""Pipeline parallelism: layer placement, p2p between stages, and the schedules
(no pipelining, 1F1B, interleaved 1F1B)."""

from .p2p import StageLink
from .schedules import run_schedule
from .stages import (
    ChunkPlacement,
    build_rank_chunks,
    build_stage_model,
    stage_chunks,
    stage_layers,
    stand_in_context,
    virtual_stage_layers,
)

__all__ = [
    "StageLink",
    "run_schedule",
    "ChunkPlacement",
    "build_rank_chunks",
    "build_stage_model",
    "stand_in_context",
    "stage_chunks",
    "stage_layers",
    "virtual_stage_layers",
]
