"""ZeRO-1/2/3 with ZeRO++ over the ZeRO group (DP x CP: the ranks that replicate weights):

* stage 1: full fp32 gradients accumulate over the micro-batches and are
  reduce-scattered once per step; each rank updates its shard of the fp32 master
  weights and optimizer state, then the weights are all-gathered;
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

from .. import comm
from ..optim import build_adamw, clip_by_global_norm, counted_once, finalize_model_grads, set_lr
from ..topology import ProcessGroups
from .engine import DataParallelEngine, check_keys, copy_checked
from .grad_reduce import hierarchical_reduce_scatter
from .sharded_params import FlatUnit, model_units


@dataclass
class PendingReduce:
    """A unit's reduce-scatter in flight: `out` is added to its gradient shard when done."""

    unit: FlatUnit
    out: torch.Tensor
    work: object
    source: torch.Tensor  # the full gradient, kept alive until the wire is done with it


class ZeroEngine(DataParallelEngine):
    def __init__(self, chunks, groups: ProcessGroups, optim_cfg, zero_cfg):
        self.chunks, self.groups, self.stage = chunks, groups, zero_cfg.zero_stage
        self.group = groups.dp_cp
        self.per_step = zero_cfg.zero_param_persistence == "step"  # keep gathered weights until the step
        self.clip = optim_cfg.clip_grad
        self.qgz_hops = groups.dp_tier_hops() if zero_cfg.zero_quantized_gradients else None
        self.block = block = zero_cfg.zero_quantization_block_size
        hpz = groups.dp_hpz if zero_cfg.zero_hpz_partition_size > 1 else None
        qwz = block if zero_cfg.zero_quantized_weights else None
        self.units: list[FlatUnit] = []
        self.roots, self.blocks = [], []  # per chunk: units used by the chunk's own code / by blocks
        for chunk in chunks:
            roots, blocks = [], []
            for name, params, module in model_units(chunk):
                unit = FlatUnit(name, params, self.group, self.stage, block, hpz=hpz, qwz_block=qwz)
                unit.tied = name == "embedding" and chunk.tied  # its twin on the other end stage
                self.units.append(unit)
                (blocks if module is not None else roots).append((unit, module))
            self.roots.append([u for u, _ in roots])
            self.blocks.append(blocks)
            if self.stage == 3:
                self._install_gather_hooks(chunk, self.roots[-1], blocks)

        for unit in self.units:  # fp32 master shard, fp32 gradient shard
            unit.master = unit.shard if unit.dtype == torch.float32 and self.stage == 3 else unit.shard.float().clone()
            unit.grad_shard = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.device)
            unit.flat_grad, unit.ready = None, 0
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
        self.optimizer = build_adamw([v for *_, v in self.opt_segments], ndims, optim_cfg)

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
        if self.qgz_hops is not None:
            hops = ", ".join(f"{h.size} ranks {h.link}" for h in self.qgz_hops)
            parts.append(f"qgZ int4 hierarchical gradient all-to-all, blocks of {self.block}, hops: {hops}")
        return "; ".join(parts)

    def gather_parameters(self) -> None:
        for unit in self.units:
            unit.gather()

    def release_parameters(self) -> None:
        for unit in self.units:
            unit.release()

    # ---- stage 3: gather before use, free after ----------------------------------------
    def _install_gather_hooks(self, chunk, roots: list[FlatUnit], blocks: list[tuple[FlatUnit, torch.nn.Module]]):
        units = [u for u, _ in blocks]

        def chunk_forward(module, args, kwargs):
            for u in roots:
                u.gather()
            if units:
                units[0].start_gather(backward=False)

        def chunk_backward(module, grad_output):
            for u in roots:
                u.gather(backward=True)
            if units:
                units[-1].start_gather(backward=True)

        # the chunk's inputs (token ids) need no grad; the pre-hook only needs the output grads
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with "
            "respect to module outputs since no inputs require gradients",
        )
        chunk.register_forward_pre_hook(chunk_forward, with_kwargs=True)
        chunk.register_full_backward_pre_hook(chunk_backward)
        for i, (unit, block) in enumerate(blocks):
            nxt = units[i + 1] if i + 1 < len(units) else None
            prev = units[i - 1] if i > 0 else None
            block.register_forward_pre_hook(self._before_forward(unit, nxt))
            if not self.per_step:
                block.register_forward_hook(lambda m, a, o, unit=unit: unit.release())
            block.register_full_backward_pre_hook(self._before_backward(unit, prev))

    @staticmethod
    def _before_forward(unit: FlatUnit, nxt: FlatUnit | None):
        def hook(module, args):
            unit.gather()
            if nxt is not None:  # prefetch: the next block's gather runs while this one computes
                nxt.start_gather(backward=False)

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
            if unit.flat_grad is None:
                unit.flat_grad = torch.zeros(unit.padded, dtype=unit.dtype, device=unit.device)
            unit.flat_grad[off : off + n].add_(p.grad.reshape(-1))
            p.grad = None
            if self.stage >= 2:
                unit.ready += 1
                if unit.ready == len(unit.params):
                    self._reduce(unit)

        return hook

    def _reduce(self, unit: FlatUnit) -> None:
        """Reduce-scatter one unit's gradients into its fp32 shard (summed, not averaged)."""
        flat, unit.flat_grad, unit.ready = unit.flat_grad, (None if self.stage >= 2 else unit.flat_grad), 0
        if self.qgz_hops is not None:
            unit.grad_shard.add_(hierarchical_reduce_scatter(flat, self.qgz_hops, "qgz_grad", bits=4, block=self.block))
        else:
            out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
            work = comm.reduce_scatter(out, flat, self.group, "zero_grad_reducescatter", async_op=True)
            self._pending.append(PendingReduce(unit, out, work, flat))
            while len(self._pending) > 2:  # overlap with the backward, but hold at most two full gradients
                self._finish_oldest()
        if not self.per_step:
            unit.release()  # stage 3: this micro-batch's backward of the unit is over

    def _finish_oldest(self) -> None:
        done = self._pending.pop(0)
        done.work.wait()
        done.unit.grad_shard.add_(done.out)

    def _drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_shard.zero_()
            if self.stage == 1:
                unit.flat_grad.zero_()

    def _finish_grads(self) -> None:
        if self.stage == 1:
            for unit in self.units:
                self._reduce(unit)
        for unit in self.units:  # a unit whose backward did not touch every parameter
            if self.stage >= 2 and unit.ready:
                self._reduce(unit)
        self._drain()
        partial = [
            u.grad_shard[a:b] for u in self.units for p, a, b, _ in u.segments() if getattr(p, "tp_partial_grad", False)
        ]
        finalize_model_grads(partial, [u.grad_shard for u in self.units if u.tied], self.groups)
        for unit in self.units:
            unit.grad_shard.div_(self.group.size)

    def step(self, lr: float) -> float:
        self._finish_grads()
        g = self.groups
        counted = [
            u.grad_shard[a:b]
            for u in self.units
            for p, a, b, _ in u.segments()
            if counted_once(p, g.tp_rank, g.is_first_stage)
        ]
        norm = clip_by_global_norm(counted, [u.grad_shard for u in self.units], [self.group, g.mp], self.clip)
        set_lr(self.optimizer, lr)
        for unit, a, b, view in self.opt_segments:
            view.grad = unit.grad_shard[a:b]
        self.optimizer.step()
        for *_, view in self.opt_segments:
            view.grad = None
        for unit in self.units:
            unit.set_shard(unit.master)
        return norm

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
