"""The one object through which the model knows how it is split over ranks."""

from __future__ import annotations

from dataclasses import dataclass

from ..topology import Group


@dataclass(frozen=True)
class ParallelContext:
    """tp: the tensor-parallel group (None or size 1: no TP); sequence_parallel: Megatron's
    norm/dropout regions sharded on the sequence over TP; cp: the context-parallel group
    (each rank holds a contiguous slice of every sequence) with the GLA state-passing
    algorithm and its All-Scan block count. The default is a single rank."""

    tp: Group | None = None
    sequence_parallel: bool = False
    cp: Group | None = None
    cp_algo: str = "all-scan"
    all_scan_blocks: int = 0  # 0: chosen from the state size and the link

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

    @property
    def cp_rank(self) -> int:
        """This rank's slice of the sequence: slices are contiguous and equal, in CP-rank order."""
        return 0 if self.cp is None else self.cp.rank
