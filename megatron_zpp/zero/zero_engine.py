"""ZeRO-1/2/3 with ZeRO++ over the ZeRO group (DP x CP: the ranks that replicate weights):

* stage 1: full fp32 gradients accumulate over the micro-batches and are
  reduce-scattered once per step, unit by unit during the backward of the step's last
  micro-batch with --overlap-grad-reduce (the schedule says which is last), else after
  it; each rank updates its shard of the fp32 master weights and optimizer state, then
  the weights are all-gathered (with --overlap-param-gather, stages 1-2: started at the
  end of the step and waited for unit by unit just before the unit's next forward);
* stage 2: each unit's gradients are reduce-scattered as soon as its backward is done
  (overlapping the rest of the backward) and accumulate in an fp32 shard;
* stage 3: as stage 2, and the weights themselves live as shards, gathered unit by unit
  just before use (the next unit's gather is issued while the current one computes) and
  freed after; with qwZ, hpZ and qgZ (ZeRO++) as configured.

The reduced shards then get the finalize syncs every engine shares (optim/finalize.py),
are divided by the ZeRO group size exactly once, clipped by the global norm (each
parameter counted once over TP, PP and DP) and stepped by AdamW on the fp32 masters.

State dict ("model"): {"unit{u}.{unit name}.master": fp32 master shard}. The training-
dtype shard is its rounding, and ZeRO-3's full weights and hpZ's secondary shards are
rebuilt by the next gather, so none of them is saved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..model.init import materialize
from ..optim import build_adamw, check_step, clip_by_global_norm, counted_once, finalize_model_grads, set_lr
from ..recompute import recomputing
from ..topology import ProcessGroups
from .engine import DataParallelEngine, check_keys, copy_checked
from .grad_reduce import HierarchicalReduceScatter, ReduceScatter
from .sharded_params import FlatUnit, model_units, pad_block


def _gather(units: list[FlatUnit], backward: bool = False) -> None:
    for u in units:
        u.start_gather(backward)
    for u in units:
        u.wait_gather()


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight; its result is added to the unit's fp32 shard."""

    unit: FlatUnit
    reduction: ReduceScatter | HierarchicalReduceScatter


class ZeroEngine(DataParallelEngine):
    MAX_IN_FLIGHT = 2  # gradient reductions overlapping the backward (each holds one unit's full fp32 gradient)

    def __init__(self, chunks, groups: ProcessGroups, optim_cfg, zero_cfg, init=None):
        """`chunks` built on the meta device come with `init` (model/init.RankInit): each unit then
        allocates and fills only what this rank keeps (sharded_params.FlatUnit)."""
        self.chunks, self.groups, self.stage = chunks, groups, zero_cfg.zero_stage
        self.group = groups.dp_cp
        self.per_step = zero_cfg.zero_param_persistence == "step"  # keep gathered weights until the step
        self.overlap_grads = self.stage == 1 and zero_cfg.overlap_grad_reduce  # stages 2-3 always overlap
        self.overlap_gather = zero_cfg.overlap_param_gather and self.stage < 3
        self.last = [False] * len(chunks)  # stage 1: is this the chunk's last micro-batch of the step
        self.reduced_in_backward = 0  # units whose reduction the backward started (this step)
        self.clip = optim_cfg.clip_grad
        hierarchical = zero_cfg.zero_quantized_gradients or bool(zero_cfg.zero_hierarchy)
        self.reduce_hops = groups.dp_tier_hops() if hierarchical else None
        self.grad_bits = 4 if zero_cfg.zero_quantized_gradients else None
        self.grad_block = zero_cfg.zero_gradient_quantization_block_size
        self.stochastic = zero_cfg.zero_gradient_stochastic_rounding
        hpz = groups.dp_hpz if zero_cfg.zero_hpz_partition_size > 1 else None
        self.qwz_block = qwz = zero_cfg.zero_quantization_block_size if zero_cfg.zero_quantized_weights else None
        self.units: list[FlatUnit] = []
        for c, chunk in enumerate(chunks):
            units = {}
            for name, params, module in model_units(chunk):
                unit = FlatUnit(
                    name, params, self.group, self.stage, pad_block(zero_cfg), hpz=hpz, qwz_block=qwz, init=init
                )
                unit.tied = name == "embedding" and chunk.tied  # its twin on the other end stage
                unit.module, unit.chunk = module, c
                units[name] = unit
                self.units.append(unit)
            if self.stage >= 2:
                self._install_hooks(chunk, units)
            if self.overlap_gather:
                self._install_gather_waits(chunk, units)
        if init is not None:  # buffers, and any parameter outside the units (none today), whole
            materialize(chunks, init)
        for unit in self.units:  # fp32 master shard, fp32 gradient shard
            unit.master = unit.shard if unit.dtype == torch.float32 and self.stage == 3 else unit.shard.float().clone()
            unit.grad_shard = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
            unit.flat_grad, unit.ready, unit.reduced = None, 0, False
            if self.stage == 1:
                unit.flat_grad = torch.zeros(unit.padded, dtype=torch.float32, device=unit.device)
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._grad_hook(unit))
        self._pending: list[PendingReduce] = []

        self.opt_segments = []  # (unit, a, b, fp32 master view): AdamW steps these views of the shards
        ndims = []
        for unit in self.units:
            for p, a, b, _ in unit.segments():
                self.opt_segments.append((unit, a, b, torch.nn.Parameter(unit.master[a:b])))
                ndims.append(unit.ndims[id(p)])
        self.optimizer, self.optimizer_name = build_adamw([v for *_, v in self.opt_segments], ndims, optim_cfg)

    def describe(self) -> str:
        mib = 2**-20
        numel = sum(u.numel for u in self.units)
        padded = sum(u.padded for u in self.units)
        size = self.units[0].full.element_size() if self.units else 4
        parts = [
            f"ZeRO-{self.stage}{' (weights kept gathered until the step)' if self.per_step else ''} over DP x CP "
            f"({self.group.size} ranks, {self.group.link}): {len(self.units)} "
            f"units, shard {sum(u.shard_numel for u in self.units) / 1e6:.3f}M of {numel / 1e6:.3f}M parameters "
            f"(padding {100 * (padded / max(numel, 1) - 1):.1f}%)"
        ]
        u0 = self.units[0] if self.units else None
        if u0 is not None and u0.qwz_block:
            parts.append(f"qwZ int8 weight gathers, blocks of {u0.qwz_block}")
        if u0 is not None and u0.hpz is not None:
            extra = sum(u.secondary_numel for u in self.units) * size * mib
            parts.append(
                f"hpZ secondary shard over {u0.hpz.size} ranks ({u0.hpz.link}): {extra:.2f} MiB extra per rank"
            )
        if self.reduce_hops is not None:
            hops = ", ".join(f"{h.size} ranks {h.link}" for h in self.reduce_hops)
            sr = " stochastic" if self.stochastic else ""
            what = f"qgZ int4{sr}, blocks of {self.grad_block}" if self.grad_bits else "fp32"
            parts.append(f"hierarchical gradient all-to-all ({what}), hops: {hops}")
        when = "during the backward" if self.stage >= 2 or self.overlap_grads else "after the backward"
        parts.append(
            f"gradients accumulated and reduced in fp32 {when}, up to {self.MAX_IN_FLIGHT} reductions in flight"
        )
        if self.overlap_gather:
            parts.append("updated weights all-gathered during the next step's forward (--overlap-param-gather)")
        return "; ".join(parts)

    def gather_parameters(self) -> None:
        for unit in self.units:
            unit.gather()

    def release_parameters(self) -> None:
        for unit in self.units:
            unit.release()

    # ---- hooks: stage 3 gathers before use and frees after; stages 2-3 count gradients ----
    def _install_hooks(self, chunk, units: dict[str, FlatUnit]) -> None:
        """Forward order: the embedding lookup (first stage), the blocks, then the end units
        (final norm and output layer: the head, and a tied embedding on the last stage).
        Each item prefetches the next. Blocks free their weights after their forward and
        gather them again for their backward; the end units keep theirs through the
        backward, which starts right after them; the lookup keeps its weights until its
        gradient is reduced (its backward reads none, but PyTorch accumulates a parameter's
        gradient only while the parameter has its shape), as FSDP keeps its root's. Both are
        gathered again at the chunk's backward if the backward of another micro-batch (1F1B)
        freed them in between."""
        blocks = [u for u in units.values() if u.module is not None]
        start = [units["embedding"]] if chunk.pre_process else []
        end = [units[n] for n in ("head", "embedding") if n in units and chunk.post_process]
        order = start + blocks + [end]  # the end units are gathered together
        mine = list(units.values())

        def chunk_backward(module, grad_output):
            for u in mine:  # a new micro-batch's gradients: count them afresh
                u.ready = 0
            if self.stage == 3:  # under 1F1B another micro-batch's backward may have freed them
                _gather(start + [u for u in end if u not in start], backward=True)
                if blocks:
                    blocks[-1].start_gather(backward=True)

        # the chunk's inputs (token ids) need no grad; the pre-hook only needs the output grads
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with "
            "respect to module outputs since no inputs require gradients",
        )
        chunk.register_full_backward_pre_hook(chunk_backward)
        if self.stage < 3:
            return
        chunk.register_forward_pre_hook(lambda m, a, kw: self._gather_and_prefetch(start, order), with_kwargs=True)
        if end:
            chunk.final_norm.register_forward_pre_hook(lambda m, a: _gather(end))
        for i, unit in enumerate(blocks):
            unit.module.register_forward_pre_hook(self._before_forward(unit, order))
            if not self.per_step:
                unit.module.register_forward_hook(self._after_forward(unit))
            prev = blocks[i - 1] if i > 0 else None
            unit.module.register_full_backward_pre_hook(self._before_backward(unit, prev))

    @staticmethod
    def _install_gather_waits(chunk, units: dict[str, FlatUnit]) -> None:
        """--overlap-param-gather (stages 1-2): the step leaves each unit's all-gather in
        flight; a unit's weights are waited for just before their first reader: the chunk's
        forward (the embedding lookup), each block's forward, the final norm (the head, and a
        tied embedding used as the output layer)."""
        start = [units["embedding"]] if "embedding" in units and chunk.pre_process else []
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

    @staticmethod
    def _gather_and_prefetch(now: list[FlatUnit], order: list, after: FlatUnit | None = None) -> None:
        """Gather `now`; start the gather of what comes after it in `order` (the first item
        when `after` is None), which then runs while `now` computes."""
        _gather(now)
        i = order.index(after) + 1 if after is not None else len(now)
        if i < len(order):
            for u in order[i] if isinstance(order[i], list) else [order[i]]:
                u.start_gather(backward=False)

    @classmethod
    def _before_forward(cls, unit: FlatUnit, order: list):
        """Gather the block and prefetch the next; in an activation-recompute rerun (inside the
        backward of its group, before the block's own backward) gather it for that backward."""

        def hook(module, args):
            if recomputing():
                unit.gather(backward=True)
            else:
                cls._gather_and_prefetch([unit], order, after=unit)

        return hook

    @staticmethod
    def _after_forward(unit: FlatUnit):
        def hook(module, args, output):
            if not recomputing():  # a rerun runs inside the backward, which still needs the weights
                unit.release()

        return hook

    @staticmethod
    def _before_backward(unit: FlatUnit, prev: FlatUnit | None):
        def hook(module, grad_output):
            unit.gather(backward=True)
            if prev is not None:
                prev.start_gather(backward=True)

        return hook

    # ---- gradients -----------------------------------------------------------------------
    def _grad_hook(self, unit: FlatUnit):
        index = {id(p): i for i, p in enumerate(unit.params)}

        def hook(p):
            i = index[id(p)]
            off, n = unit.offsets[i], unit.numels[i]
            if unit.flat_grad is None:  # fp32 whatever the parameter dtype: micro-batches sum without rounding
                unit.flat_grad = torch.zeros(unit.padded, dtype=torch.float32, device=unit.device)
            if self.stage == 1 and unit.reduced:  # the wire reads flat_grad: adding to it would corrupt the sum
                raise RuntimeError(
                    f"ZeRO-1 unit {unit.name}: a gradient arrived after its reduction started: a backward ran "
                    "after the one the schedule announced as the last micro-batch (set_last_micro_batch)"
                )
            unit.flat_grad[off : off + n].add_(p.grad.reshape(-1))
            p.grad = None
            if self.stage >= 2 or self.last[unit.chunk]:
                unit.ready += 1
                if unit.ready == len(unit.params):
                    self._reduce(unit)
                    self.reduced_in_backward += 1

        return hook

    def _reduce(self, unit: FlatUnit) -> None:
        """Start reducing one unit's gradients into its fp32 shard (summed, not averaged),
        and advance the reductions already in flight."""
        flat, unit.flat_grad, unit.ready = unit.flat_grad, (None if self.stage >= 2 else unit.flat_grad), 0
        unit.reduced = self.stage == 1  # stage 1 reduces once per step
        if self.reduce_hops is not None:
            phase = "qgz_grad" if self.grad_bits else "zero_grad_hierarchical"
            reduction = HierarchicalReduceScatter(
                flat, self.reduce_hops, phase, self.grad_bits, self.grad_block, self.stochastic
            )
        else:
            reduction = ReduceScatter(flat, self.group, "zero_grad_reducescatter")
        for pending in self._pending:  # one hop further: each hop's transfer overlapped a unit's backward
            pending.reduction.advance()
        self._pending.append(PendingReduce(unit, reduction))
        while len(self._pending) > self.MAX_IN_FLIGHT:  # hold at most this many full gradients
            self._finish_oldest()
        if not self.per_step:
            unit.release()  # stage 3: this micro-batch's backward of the unit is over

    def _finish_oldest(self) -> None:
        done = self._pending.pop(0)
        done.unit.grad_shard.add_(done.reduction.result())

    def _drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_shard.zero_()
            if self.stage == 1:
                unit.flat_grad.zero_()
                unit.ready, unit.reduced = 0, False
        self.last = [False] * len(self.last)
        self.reduced_in_backward = 0

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        if self.overlap_grads:
            self.last[chunk] = last

    def _finish_grads(self) -> None:
        if self.stage == 1:
            for unit in self.units:  # all of them without overlap; else those the backward did not finish
                if not unit.reduced:
                    self._reduce(unit)
        for unit in self.units:  # a unit whose backward did not touch every parameter
            if self.stage >= 2 and unit.ready:
                self._reduce(unit)
        self._drain()
        self.last = [False] * len(self.last)
        for unit in self.units:
            unit.ready, unit.reduced = 0, False
        partial = [
            u.grad_shard[a:b] for u in self.units for p, a, b, _ in u.segments() if getattr(p, "tp_partial_grad", False)
        ]
        finalize_model_grads(partial, [u.grad_shard for u in self.units if u.tied], self.groups)
        for unit in self.units:
            unit.grad_shard.div_(self.group.size)

    def step(self, lr: float, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
        self._finish_grads()
        g = self.groups
        counted = [
            u.grad_shard[a:b]
            for u in self.units
            for p, a, b, _ in u.segments()
            if counted_once(p, g.tp_rank, g.is_first_stage)
        ]
        shards = [u.grad_shard for u in self.units]
        norm = clip_by_global_norm(counted, shards, [self.group, g.mp], self.clip, loss_scale)
        set_lr(self.optimizer, lr)
        for unit, a, b, view in self.opt_segments:
            view.grad = unit.grad_shard[a:b]
        check = check_step(loss, norm, g.world, shards[0].device, loss_scale, skip_nonfinite)
        if check.applied:  # not applied: the shards are re-set alike below
            self.optimizer.step()
        for *_, view in self.opt_segments:
            view.grad = None
        for unit in self.units:  # --overlap-param-gather: the next forward waits for each unit's gather
            unit.set_shard(unit.master, wait=not self.overlap_gather)
        return check

    # ---- state -------------------------------------------------------------------------
    def _masters(self) -> dict[str, FlatUnit]:
        return {f"unit{i}.{u.name}.master": u for i, u in enumerate(self.units)}

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {key: u.master for key, u in self._masters().items()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = self._masters()
        check_keys(set(state), set(mine))
        for key, u in mine.items():
            # in place: the optimizer's segment views alias unit.master (and ZeRO-3 fp32 shard == master)
            copy_checked(key, u.master, state[key])
            u.set_shard(u.master)  # the rounded shard; stages 1-2 all-gather the full weights, 3 stay released
