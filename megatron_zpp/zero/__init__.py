"""Data parallelism: plain (stage 0) and ZeRO-1/2/3 with ZeRO++ (qwZ, hpZ, qgZ) and
multi-level hierarchical partitioning, over the DP x CP group of the topology. Both
engines implement `DataParallelEngine` (engine.py); `build_engine` picks one."""

from __future__ import annotations

import torch

from ..config import Config
from ..topology import ProcessGroups
from .ddp_engine import DDPEngine
from .engine import DataParallelEngine
from .zero_engine import ZeroEngine

__all__ = ["DataParallelEngine", "DDPEngine", "ZeroEngine", "build_engine"]


def build_engine(cfg: Config, chunks: list[torch.nn.Module], groups: ProcessGroups, init=None) -> DataParallelEngine:
    """The engine over `chunks`; chunks built on the meta device come with `init` (model/init.RankInit),
    and the engine materializes what its rank holds: the whole slice (stage 0), the flat buffers
    (stages 1-2), the shards (stage 3)."""
    if cfg.zero.zero_stage == 0:
        return DDPEngine(chunks, groups, cfg.optim, cfg.zero, init)
    return ZeroEngine(chunks, groups, cfg.optim, cfg.zero, init)
