"""Data parallelism: plain (stage 0) and ZeRO-1/2/3 with ZeRO++ (qwZ, hpZ, qgZ) and
multi-level hierarchical partitioning, over the DP x CP group of the topology. Both
engines implement `DataParallelEngine` (engine.py); `build_engine` picks one."""

from __future__ import annotations

import torch

from ..config import Config
from ..topology import ProcessGroups
from .ddp_engine import DDPEngine
from .engine import DataParallelEngine, RankLayout, Slot, persistent_buffers
from .zero_engine import ZeroEngine

__all__ = [
    "DataParallelEngine",
    "DDPEngine",
    "ZeroEngine",
    "RankLayout",
    "Slot",
    "build_engine",
    "engine_class",
    "persistent_buffers",
]


def engine_class(cfg: Config) -> type[DDPEngine] | type[ZeroEngine]:
    """The engine a run of `cfg` uses: what its ranks hold (`slots`) is asked of it."""
    return DDPEngine if cfg.zero.zero_stage == 0 else ZeroEngine


def build_engine(cfg: Config, chunks: list[torch.nn.Module], groups: ProcessGroups, init=None) -> DataParallelEngine:
    """The engine over `chunks`; chunks built on the meta device come with `init` (model/init.RankInit),
    and the engine materializes what its rank holds: the whole slice (stage 0), the flat buffers
    (stages 1-2), the shards (stage 3)."""
    return engine_class(cfg)(chunks, groups, cfg.optim, cfg.zero, init)
