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

The engine is four parts, each in its module:

* the units (sharded_params.FlatUnit): a transformer block, the embedding or the head as one flat
  buffer padded and sharded over the group: its fp32 master and gradient shards, its weight gathers;
* the stage policy (stage_policy.py): where the weights live, and each unit's gradient accumulator
  (UnitGrads), the only writer of its counts;
* the reduction schedule (reduce_schedule.py): the order, fixed by the program, in which each chunk's
  units are reduced, the gradient hooks that trigger them and the reductions in flight;
* the gather schedule (gather_schedule.py): ZeRO-3's module hooks, which gather, prefetch and free
  each unit's weights (and replay the hooks of blocks the data skipped, so that every rank issues the
  same collectives in the same order).

Streams (torch.get_device_module(device): no-ops on CPU, so one code path runs there too): the
weight gathers run on one all-gather stream (zero/gather.py: it waits for an event recorded on the
compute stream, then qwZ quantize -> all-gather; at the unit's wait: the collective's wait -> qwZ
decode -> hpZ secondary copy, then an event the compute stream waits on before it reads the
weights); the gradient reductions on one reduce stream per link tier (reduce_schedule.py says how);
the compute stream never waits on the host, and the step waits for every reduction's event.

State dict ("model"): {"unit{u}.{unit name}.master": fp32 master shard}. The training-
dtype shard is its rounding, and ZeRO-3's full weights and hpZ's secondary shards are
rebuilt by the next gather, so none of them is saved.
"""

from __future__ import annotations

import torch

from ..model.init import materialize
from ..optim import build_adamw, check_step, clip_by_global_norm, counted_once, finalize_model_grads, set_rates
from ..optim.optimizer import decoupled_lr_params, qk_norm_params
from ..tensor_parallel.layers import is_expert
from ..topology import ProcessGroups
from .engine import DataParallelEngine, RankLayout, check_keys, copy_checked, model_has_experts
from .gather_schedule import GatherSchedule, install_gather_waits
from .reduce_buffers import ReduceBuffers
from .reduce_schedule import ReduceSchedule
from .sharded_params import FlatUnit, is_expert_unit, model_units, pad_block, shard_layout
from .stage_policy import stage_policy


def unit_key(index: int, name: str) -> str:
    """The state dict key of unit number `index` (named `name`) of this rank: its fp32 master shard."""
    return f"unit{index}.{name}.master"


class ZeroEngine(DataParallelEngine):
    def __init__(self, chunks, groups: ProcessGroups, optim_cfg, zero_cfg, init=None):
        """`chunks` built on the meta device come with `init` (model/init.RankInit): each unit then
        allocates and fills only what this rank keeps (sharded_params.FlatUnit)."""
        self.chunks, self.groups = chunks, groups
        self.policy = stage_policy(zero_cfg.zero_stage)  # what the stage shards, when it reduces
        self.group = groups.dp_cp
        self.moe = model_has_experts(chunks)  # alike on every rank: the norm's collectives
        self.per_step = zero_cfg.zero_param_persistence == "step"  # keep gathered weights until the step
        self.overlap_gather = zero_cfg.overlap_param_gather and not self.policy.sharded_weights
        self.clip = optim_cfg.clip_grad
        device = init.device if init is not None else next(p.device for c in chunks for p in c.parameters())
        self.gather_stream = torch.get_device_module(device).Stream()  # every weight gather (no-op on CPU)
        by_chunk = [self._build_units(c, chunk, zero_cfg, init) for c, chunk in enumerate(chunks)]
        self.units: list[FlatUnit] = [u for units in by_chunk for u in units.values()]
        if init is not None:  # buffers, and any parameter outside the units (none today), whole
            materialize(chunks, init)
        self.reduce = ReduceSchedule(chunks, self.units, groups, self.policy, zero_cfg, device)
        for chunk, units in zip(chunks, by_chunk):
            if self.policy.sharded_weights:
                GatherSchedule(chunk, units, self.reduce, self.per_step).install(chunk)
            elif self.overlap_gather:
                install_gather_waits(chunk, units)
        self._build_optimizer(optim_cfg)

    def _build_units(self, c: int, chunk, zero_cfg, init) -> dict[str, FlatUnit]:
        """Chunk number `c`'s units by name, in model order. A block's routed experts are a unit of their own
        over the expert-data-parallel group, gathered and freed with the block (its companion)."""
        hpz_on = zero_cfg.zero_hpz_partition_size > 1
        hpz, expert_hpz = (self.groups.dp_hpz, self.groups.edp_hpz) if hpz_on else (None, None)
        qwz = zero_cfg.zero_quantization_block_size if zero_cfg.zero_quantized_weights else None
        units: dict[str, FlatUnit] = {}
        for name, params, module in model_units(chunk):
            expert = is_expert_unit(name)
            units[name] = FlatUnit(
                name,
                params,
                self.groups.edp if expert else self.group,
                self.policy.sharded_weights,
                pad_block(zero_cfg),
                hpz=expert_hpz if expert else hpz,
                qwz_block=qwz,
                init=init,
                module=module,
                chunk=c,
                tied=name == "embedding" and chunk.tied,  # its twin on the other end stage
                gather_stream=self.gather_stream,
            )
            if expert:
                units[name.rsplit(".", 1)[0]].companions.append(units[name])
        return units

    def _build_optimizer(self, optim_cfg) -> None:
        """AdamW over views of the fp32 master shards, one per trainable parameter piece in the shard."""
        self.opt_segments = []  # (unit, a, b, fp32 master view): AdamW steps these views of the shards
        ndims, decoupled, qk = [], [], []  # per segment: its parameter's ndim, --decoupled-lr, a query/key norm
        decoupled_ids = set().union(*(decoupled_lr_params(c) for c in self.chunks))
        qk_ids = set().union(*(qk_norm_params(c) for c in self.chunks))
        for unit in self.units:
            for p, a, b, _ in unit.segments():
                if p.requires_grad:
                    self.opt_segments.append((unit, a, b, torch.nn.Parameter(unit.master[a:b])))
                    ndims.append(unit.ndims[id(p)])
                    decoupled.append(id(p) in decoupled_ids)
                    qk.append(id(p) in qk_ids)
        self.optimizer, self.optimizer_name = build_adamw(
            [v for *_, v in self.opt_segments], ndims, optim_cfg, decoupled=decoupled, qk_norm=qk
        )

    # what the tests and the benches look at: the reductions' pool, schedule and mode
    @property
    def buffers(self) -> ReduceBuffers:
        return self.reduce.buffers

    @property
    def reduced_in_backward(self) -> int:
        return self.reduce.reduced_in_backward

    @property
    def enqueue_whole_chain(self) -> bool:
        return self.reduce.enqueue_whole_chain

    @enqueue_whole_chain.setter
    def enqueue_whole_chain(self, whole: bool) -> None:
        self.reduce.enqueue_whole_chain = whole

    def describe(self) -> str:
        numel = sum(u.numel for u in self.units)
        padded = sum(u.padded for u in self.units)
        kept = " (weights kept gathered until the step)" if self.per_step else ""
        parts = [
            f"ZeRO-{self.policy.stage}{kept} over DP x CP "
            f"({self.group.size} ranks, {self.group.link}): {len(self.units)} "
            f"units, shard {sum(u.shard_numel for u in self.units) / 1e6:.3f}M of {numel / 1e6:.3f}M parameters "
            f"(padding {100 * (padded / max(numel, 1) - 1):.1f}%)"
        ]
        u0 = self.units[0] if self.units else None
        if u0 is not None and u0.qwz_block:
            parts.append(f"qwZ int8 weight gathers, blocks of {u0.qwz_block}")
        if u0 is not None and u0.hpz is not None:
            extra = sum(u.hpz.numel for u in self.units if u.hpz) * u0.full.element_size() * 2**-20
            hpz = u0.hpz.group
            parts.append(f"hpZ secondary shard over {hpz.size} ranks ({hpz.link}): {extra:.2f} MiB extra per rank")
        parts += self.reduce.describe()
        if self.overlap_gather:
            parts.append("updated weights all-gathered during the next step's forward (--overlap-param-gather)")
        return "; ".join(parts)

    def gather_parameters(self) -> None:
        for unit in self.units:
            unit.gather()

    def release_parameters(self) -> None:
        for unit in self.units:
            unit.release()

    # ---- the step --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Nothing carries over from the last step: shards, accumulators, counts, the schedule."""
        self.reduce.zero_grad()

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        self.reduce.set_last_micro_batch(chunk, last)

    def _finish_grads(self) -> None:
        self.reduce.finish()
        partial = [
            u.grad_shard[a:b] for u in self.units for p, a, b, _ in u.segments() if getattr(p, "tp_partial_grad", False)
        ]
        finalize_model_grads(partial, [u.grad_shard for u in self.units if u.tied], self.groups)
        for unit in self.units:  # the mean over the model replicas (routed experts: summed over their group)
            unit.grad_shard.div_(self.group.size)

    def step(self, lr, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
        self._finish_grads()
        shards = [u.grad_shard for u in self.units]
        norm = clip_by_global_norm(self.counted_parts("grads"), shards, self.clip, loss_scale)
        set_rates(self.optimizer, lr)  # optim.Rates (or one float lr)
        for unit, a, b, view in self.opt_segments:
            view.grad = unit.grad_shard[a:b]
        check = check_step(loss, norm, self.groups.world, shards[0].device, loss_scale, skip_nonfinite)
        if check.applied:  # not applied: the shards are re-set alike below
            self.optimizer.step()
        for *_, view in self.opt_segments:
            view.grad = None
        for unit in self.units:  # --overlap-param-gather: the next forward waits for each unit's gather
            unit.set_shard(unit.master, wait=not self.overlap_gather)
        return check

    def counted_parts(self, kind: str) -> list[tuple[list[torch.Tensor], list]]:
        g = self.groups
        parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for u in self.units:
            for p, a, b, _ in u.segments():
                if counted_once(p, g.tp_rank, g.is_first_stage):
                    parts[is_expert(p)].append((u.master if kind == "params" else u.grad_shard)[a:b])
        dense = (parts[False], [self.group, g.mp])
        return [dense, (parts[True], [g.edp, g.expert_mp])] if self.moe else [dense]

    # ---- state -------------------------------------------------------------------------
    @staticmethod
    def layout_key(cfg) -> dict:
        # the block the flat buffers are padded to (lcm of the qwZ and qgZ blocks; the key predates qgZ's own)
        return {"zero_stage": cfg.zero.zero_stage, "zero_quantization_block_size": pad_block(cfg.zero)}

    @classmethod
    def slots(cls, cfg, chunks, group_rank: int, group_size: int, edp: tuple[int, int] | None = None) -> RankLayout:
        return shard_layout(chunks, (group_rank, group_size), edp, pad_block(cfg.zero), unit_key)

    def _masters(self) -> dict[str, FlatUnit]:
        return {unit_key(i, u.name): u for i, u in enumerate(self.units)}

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
