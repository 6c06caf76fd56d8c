"""The one object through which the model knows how it is split over ranks: `ParallelContext`, defined in
topology.py beside `Group` (the MoE layers in moe/ take it too, and moe/ must not import the model package
that builds them: tests/test_imports.py)."""

from __future__ import annotations

from ..topology import ParallelContext

__all__ = ["ParallelContext"]
