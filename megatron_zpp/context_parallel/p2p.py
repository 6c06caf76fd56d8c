"""The context-parallel package's point-to-point: one table of tags for every stream between two CP ranks, and
`exchange`, which posts a batch of sends and receives (comm.p2p: receives first) and waits for all of them.

Tags keep the streams between one pair of ranks apart: the All-Scan's blocks (all_scan.py; block i travels
with its phase's base + i, so at most 4096 blocks) and the short convolution's halo (halo.py)."""

from __future__ import annotations

from .. import comm
from ..topology import Group

SCAN_FWD_TAG = 0  # All-Scan forward, block i: SCAN_FWD_TAG + i
SCAN_BWD_TAG = 1 << 12  # All-Scan backward, block i: SCAN_BWD_TAG + i
HALO_TAG = 1 << 13  # the convolution halo, forward and backward (halo.py)


def exchange(ops: list[comm.Send | comm.Recv], cp: Group, phase: str) -> None:
    """Post `ops` on the CP group (recorded under `phase`) and wait until every one is done."""
    for work in comm.p2p(ops, cp, phase):
        work.wait()
