"""Activation recompute (Megatron's --recompute-granularity, --recompute-method, --recompute-num-layers).

A recomputed region keeps only its inputs for the backward; when the backward first needs one
of its activations, the region runs again (torch.utils.checkpoint, non-reentrant). `full`
makes groups of transformer blocks such regions (`layer_groups`: uniform = every group of N
consecutive layers of a model chunk, block = each of the chunk's first N layers alone);
`selective` makes the core of each token mixer one (softmax: the attention scores, softmax,
dropout and weighted sum; GLA: the gates, the chunked operator, the head norm and output gate
between the input and output projections).

The rerun must compute what the first run computed, bit for bit:

* random numbers: the default layout-invariant dropout masks are a function of the micro-batch
  (model/dropout.py), which is part of tensor_parallel.random's tracker state restored here; with
  --dropout-masks per-rank, checkpoint restores torch's default generators (hidden dropout, and the
  attention dropout drawn inside `model_parallel_rng`) and the per-TP-rank dropout stream of
  tensor_parallel.random is restored here, and put back afterwards, so that the stream goes on
  as if there had been no rerun.
* communication whose result is already known is not repeated: a layer calls `recall()` before
  it communicates (the rerun gets what the first run received, in call order) and `remember()`
  after (the first run keeps it). The state entering a context-parallel slice of a linear mixer
  (GLA, GDN, KDA; All-Scan, all-gather, ring) goes this way: the rerun neither sends nor receives it.

Collectives the rerun does repeat (the sequence-parallel gathers and scatters inside a block,
the K/V gather of softmax attention under CP in a full recompute, and a ZeRO-3 gather that the
rerun of a group needs before its block's backward would have issued it) are recorded in the
ledger under their phase + ":recompute" (comm.recompute_phase). The rerun stops at the last
tensor the backward needs (checkpoint's early stop), so a region's closing collective with
nothing kept after it (a block's last reduce-scatter) is not repeated; the simulator
(planning/simulator/collectives.py) counts the same.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from . import comm
from .tensor_parallel import random as tp_random


class _Region:
    """One checkpointed call: the tracker state at its start and what its first run received."""

    def __init__(self, fn):
        self.fn, self.runs, self.kept, self.next = fn, 0, [], 0
        self.rng = tp_random.tracker_state()

    @property
    def rerun(self) -> bool:
        return self.runs > 1

    def __call__(self, *args):
        self.runs += 1
        self.next = 0
        outside = None
        if self.rerun:
            outside = tp_random.tracker_state()
            tp_random.set_tracker_state(self.rng)
        _ACTIVE.append(self)
        try:
            with comm.recompute_phase(self.rerun):
                return self.fn(*args)
        finally:  # also when checkpoint stops the rerun early, once it has what the backward needs
            _ACTIVE.pop()
            if self.rerun:
                tp_random.set_tracker_state(outside)


_ACTIVE: list[_Region] = []


def checkpoint(fn, *args):
    """fn(*args), its activations recomputed in the backward. Inside another region (which
    recomputes it anyway) or under no_grad it just runs."""
    if _ACTIVE or not torch.is_grad_enabled():
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(_Region(fn), *args, use_reentrant=False, preserve_rng_state=True)


def recomputing() -> bool:
    """Whether the code running is a rerun (the backward of a recomputed region)."""
    return bool(_ACTIVE) and _ACTIVE[-1].rerun


def recall():
    """In a rerun: the next value the first run remembered; else None (compute it, then `remember`)."""
    if not recomputing():
        return None
    region = _ACTIVE[-1]
    region.next += 1
    return region.kept[region.next - 1]


def remember(value):
    """Inside a region's first run, keep `value` for its rerun's `recall`; returns it."""
    if _ACTIVE and not _ACTIVE[-1].rerun:
        _ACTIVE[-1].kept.append(value)
    return value


def layer_groups(cfg, num_layers: int) -> list[tuple[int, int, bool]]:
    """(start, stop, recomputed) over a chunk's layers 0..num_layers-1, in order (cfg: ModelConfig).

    full + uniform: groups of N layers, each recomputed as one unit (the last may be shorter);
    full + block: each of the first N layers alone, the rest kept; otherwise one kept group."""
    n = cfg.recompute_num_layers
    if cfg.recompute_granularity != "full" or num_layers == 0:
        return [(0, num_layers, False)]
    if cfg.recompute_method == "uniform":
        return [(a, min(a + n, num_layers), True) for a in range(0, num_layers, n)]
    n = min(n, num_layers)
    return [(i, i + 1, True) for i in range(n)] + ([(n, num_layers, False)] if n < num_layers else [])


def run_blocks(blocks, x: torch.Tensor, *args, recompute: bool = False) -> torch.Tensor:
    """x through `blocks` (each called block(x, *args)), as one recomputed region if `recompute`."""
    if recompute:
        return checkpoint(_run_blocks, blocks, x, *args)
    return _run_blocks(blocks, x, *args)


def _run_blocks(blocks, x, *args):
    for block in blocks:
        x = block(x, *args)
    return x
