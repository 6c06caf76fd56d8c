"""When each ZeRO unit's weights are gathered, prefetched and freed: the module hooks of a chunk.

* --overlap-param-gather (stages 1-2, `install_gather_waits`): the step leaves each unit's all-gather in
  flight; the forward waits for it just before the unit's first reader.
* ZeRO-3 (`GatherSchedule`): the weights live as shards and are gathered unit by unit just before use,
  the next unit's gather issued while the current one computes, and freed after (unless
  --zero-param-persistence step keeps them until the step). The forward order is the embedding lookup
  (first stage), the blocks, then the end units (final norm and output layer: the head, and a tied
  embedding on the last stage), gathered together. Blocks free their weights after their forward and
  gather them again for their backward, prefetching the block before; the end units keep theirs through
  the backward, which starts right after them; the lookup keeps its weights until its gradient is
  reduced (its backward reads none, but PyTorch accumulates a parameter's gradient only while the
  parameter has its shape), as FSDP keeps its root's. Both are gathered again at the chunk's backward if
  the backward of another micro-batch (1F1B) freed them in between. A recomputed block (its rerun inside
  its backward) gathers for that backward and frees nothing.
* A block the data skips fires no hook, so each hook first plays the hooks of the blocks skipped since
  the last one (gather, prefetch, free; in the backward also issue the reductions the backward moved
  past, zero/reduce_schedule.py): every rank issues the same gathers and reductions in the same order
  whatever it skipped.
* hpZ (FlatUnit.start_gather, gather.SecondaryShard): the step's first forward gather of a unit reads
  the primary shards over the whole ZeRO group and leaves each rank its secondary shard; every later
  gather until the next step (the backward's, recomputation's, the next micro-batches' forwards) reads
  the secondaries inside the node.
"""

from __future__ import annotations

import functools

from ..recompute import recomputing
from .reduce_schedule import ReduceSchedule
from .sharded_params import START_UNITS, FlatUnit


def gather_all(units: list[FlatUnit], backward: bool = False) -> None:
    """Issue every unit's gather, then wait for them all (the transfers overlap each other)."""
    for u in units:
        u.start_gather(backward)
    for u in units:
        u.wait_gather()


def install_gather_waits(chunk, units: dict[str, FlatUnit]) -> None:
    """--overlap-param-gather (stages 1-2): the step leaves each unit's all-gather in
    flight; a unit's weights are waited for just before their first reader: the chunk's
    forward (the embedding lookup), each block's forward, the final norm (the head, and a
    tied embedding used as the output layer)."""
    start = [units[n] for n in START_UNITS if n in units] if chunk.pre_process else []
    end = [units[n] for n in ("head", "embedding") if n in units and n not in [u.name for u in start]]

    def wait(now: list[FlatUnit]) -> None:
        for u in now:
            u.wait_gather()

    chunk.register_forward_pre_hook(lambda m, a, kw: wait(start), with_kwargs=True)
    for unit in units.values():
        if unit.module is not None:
            unit.module.register_forward_pre_hook(lambda m, a, unit=unit: unit.wait_gather())
    if end:
        chunk.final_norm.register_forward_pre_hook(lambda m, a: wait(end))


class GatherSchedule:
    """ZeRO-3's gathers and releases of one model chunk, issued from its module hooks (`install`)."""

    def __init__(self, chunk, units: dict[str, FlatUnit], reduce: ReduceSchedule, per_step: bool):
        self.blocks = [u for u in units.values() if u.module is not None]
        self.start = [units[n] for n in START_UNITS if n in units] if chunk.pre_process else []
        self.end = [units[n] for n in ("head", "embedding") if n in units and chunk.post_process]
        self.order: list = self.start + self.blocks + [self.end]  # the end units are gathered together
        self.c = next(iter(units.values())).chunk
        self.reduce, self.per_step = reduce, per_step
        self.fwd = self.bwd = 0  # blocks the forward (in order) / backward (reversed) has passed

    def install(self, chunk) -> None:
        chunk.register_full_backward_pre_hook(self.chunk_backward)
        chunk.register_forward_pre_hook(self.chunk_forward, with_kwargs=True)
        chunk.register_forward_hook(self.end_forward)  # a middle stage's skipped last blocks
        if self.end:
            chunk.final_norm.register_forward_pre_hook(self.end_units)
        for i, unit in enumerate(self.blocks):
            assert unit.module is not None  # a block's unit is made with its module
            unit.module.register_forward_pre_hook(functools.partial(self.before_forward, i))
            if not self.per_step:
                unit.module.register_forward_hook(functools.partial(self.after_forward, i))
            unit.module.register_full_backward_pre_hook(functools.partial(self.before_backward, i))

    def _gather_and_prefetch(self, now: list[FlatUnit], after: FlatUnit | None = None) -> None:
        """Gather `now`; start the gather of what comes after it in the forward order (the first item
        when `after` is None), which then runs while `now` computes."""
        gather_all(now)
        i = self.order.index(after) + 1 if after is not None else len(now)
        if i < len(self.order):
            for u in self.order[i] if isinstance(self.order[i], list) else [self.order[i]]:
                u.start_gather(backward=False)

    def _catch_up_forward(self, upto: int) -> None:
        while self.fwd < upto:
            u = self.blocks[self.fwd]
            self.fwd += 1
            self._gather_and_prefetch([u], after=u)
            if not self.per_step:
                u.release()

    def _catch_up_backward(self, upto: int) -> None:
        while self.bwd < upto:
            i = len(self.blocks) - 1 - self.bwd
            self.bwd += 1
            self.blocks[i].gather(backward=True)
            if i > 0:
                self.blocks[i - 1].start_gather(backward=True)
            self.reduce.issue_before(self.c, self.blocks[i], inclusive=True)
            if not self.per_step:
                self.blocks[i].release()

    # ---- the hooks ------------------------------------------------------------------------
    def chunk_forward(self, module, args, kwargs) -> None:
        self.fwd = 0
        self._gather_and_prefetch(self.start)

    def end_forward(self, *_) -> None:
        self._catch_up_forward(len(self.blocks))

    def end_units(self, module, args) -> None:
        self.end_forward()
        gather_all(self.end)

    def chunk_backward(self, module, grad_output) -> None:
        """Under 1F1B another micro-batch's backward may have freed the start and end units."""
        self.bwd = 0
        gather_all(self.start + [u for u in self.end if u not in self.start], backward=True)
        if self.blocks:
            self.blocks[-1].start_gather(backward=True)

    def before_forward(self, i: int, module, args) -> None:
        unit = self.blocks[i]
        if recomputing():  # a rerun inside the backward of its group: gather it for that backward
            unit.gather(backward=True)
            return
        self._catch_up_forward(i)
        self.fwd = i + 1
        self._gather_and_prefetch([unit], after=unit)

    def after_forward(self, i: int, module, args, output) -> None:
        if not recomputing():  # a rerun runs inside the backward, which still needs the weights
            self.blocks[i].release()

    def before_backward(self, i: int, module, grad_output) -> None:
        j = len(self.blocks) - 1 - i
        self._catch_up_backward(j)
        self.bwd = j + 1
        self.reduce.issue_before(self.c, self.blocks[i])  # what the backward has moved past
        self.blocks[i].gather(backward=True)
        if i > 0:
            self.blocks[i - 1].start_gather(backward=True)
