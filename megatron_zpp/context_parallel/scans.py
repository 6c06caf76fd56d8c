"""The state scans over the context-parallel ranks, by name: what GLA (gla.py) and Gated DeltaNet (gdn.py)
share. A slice's entering state is the exclusive scan S_in(p+1) = S_loc(p) + T(p) S_in(p) (transition.py's
T: GLA's decay, GDN's dense M), done by one of

    "all-scan"    ZeCO's pipelined chain (all_scan.py): one state sent per rank, any P
    "all-gather"  LASP-2 / fla's KCP (lasp2.py): every rank gathers every (S_loc, T): (P-1) per rank
    "ring"        LASP-1 (ring.py): the chain with whole states, latency P * tau(state)

`make_scan` builds one (and refuses an unknown name), `check_algo` refuses one before any work. `overlapped`
runs a scan in a background thread while the caller computes what does not need its result (gla.py, gdn.py)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..topology import Group
from .all_scan import AllScan, auto_blocks
from .lasp2 import GatherScan
from .ring import RingScan

ALGOS = ("all-scan", "all-gather", "ring")


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"unknown CP algorithm {algo!r}; choose one of {ALGOS}")


def make_scan(
    algo: str, cp: Group, blocks: int, state_bytes: int, device: torch.device, extent: int
) -> AllScan | GatherScan | RingScan:
    """The state scan of `algo`; all-scan with blocks 0 picks its block count (auto_blocks over `extent`,
    the state dimension its blocks cut: K for GLA, V for GDN)."""
    check_algo(algo)
    if algo == "all-scan":
        return AllScan(cp, blocks or auto_blocks(state_bytes, cp, device, extent))
    return GatherScan(cp) if algo == "all-gather" else RingScan(cp)


class Known:
    """A result already at hand, read like a Background's."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class Background:
    """Run fn(*args) in a thread; result() joins it and re-raises what it raised."""

    def __init__(self, fn, *args):
        self.out, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.out = fn(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            self.error = e

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.out


def overlapped(fn, *args) -> Background | Known:
    """fn(*args) in the background, or at once for fake tensors (a dry run: its FakeTensorMode is the
    caller thread's, and there is no time to overlap)."""
    if any(is_fake(a) for a in args if isinstance(a, Tensor)):
        return Known(fn(*args))
    return Background(fn, *args)
