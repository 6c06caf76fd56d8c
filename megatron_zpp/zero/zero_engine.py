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

The reduction schedule is fixed by the program, not the data. Before any backward each
chunk's units with a trainable parameter are listed in the order their backward ends
(backward_order); a reducing backward (every one at stages 2-3, the step's last at stage 1
with overlap) issues them in that order only: a unit goes as soon as all its trainable
parameters' gradients are in and every unit before it has gone, and autograd's final
callback issues the rest at the backward's end (a parameter that got no gradient adds
zeros). ZeRO-3's gathers are issued from module hooks, and a block the data skips fires
none, so each hook first replays the hooks of the blocks skipped since the last one.
Every rank therefore issues the same collectives in the same order whichever parameters
its data reached (--check-collective-order verifies it); zero_grad clears every count,
accumulator and pointer, so nothing carries into the next step. Frozen parameters
(requires_grad=False) keep their place in a unit (ZeRO-3 still gathers them) but get no
hook and no AdamW segment; a unit with none trainable is never reduced.

Streams (torch.get_device_module(device): no-ops on CPU, so one code path runs there too):

* all-gather stream (zero/gather.py): waits for an event recorded on the compute stream
  (the shard's update, the full buffer's allocation), then qwZ quantize -> all-gather;
  at the unit's wait: the collective's wait -> qwZ decode -> hpZ secondary copy, then an
  event the compute stream waits on before it reads the weights. The wire buffers live
  on the gather stream and are dropped after its wait.
* one reduce stream per link tier (zero/grad_reduce.py): a reduction's hop 0 stream waits
  for an event on the compute stream (the gradient is written), each later hop's for the
  previous hop's stream; each hop runs quantize -> all-to-all -> wait -> dequantize-sum
  (-> requantize) on its stream, and the last adds the result into the unit's fp32 shard
  there. On an accelerator the whole chain is enqueued when the unit's gradients are
  ready (enqueue_whole_chain); on CPU gloo's waits block the host, so hops advance one per
  later unit as before. The unit's gradient and every buffer of the chain come from one
  pool (zero/reduce_buffers.py) and stay held by the reduction's lease (PendingReduce)
  until the compute stream has waited for the chain's last event; they then go back with
  that event, which any later taker's stream waits for: both TORCH_NCCL_AVOID_RECORD_STREAMS=1
  and the default are safe, and after the first step no reduction allocates anything (the
  same buffers, in the same order, every step).
* the compute stream never waits on the host: beyond max_in_flight reductions
  (--zero-reduce-in-flight, never fewer than the hops) it waits for the oldest one's
  event (backpressure); the finalize (and so the clip and the step) waits for every
  reduction's event, i.e. for all reduce streams.

State dict ("model"): {"unit{u}.{unit name}.master": fp32 master shard}. The training-
dtype shard is its rounding, and ZeRO-3's full weights and hpZ's secondary shards are
rebuilt by the next gather, so none of them is saved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..model.init import materialize
from ..optim import build_adamw, check_step, clip_by_global_norm, counted_once, finalize_model_grads, set_rates
from ..optim.optimizer import decoupled_lr_params, qk_norm_params
from ..recompute import recomputing
from ..topology import ProcessGroups, topology_from_config, zero_reduce_tiers
from .engine import DataParallelEngine, RankLayout, check_keys, copy_checked
from .grad_reduce import QGZ_BITS, HierarchicalReduceScatter, ReduceScatter
from .reduce_buffers import Lease, ReduceBuffers
from .sharded_params import START_UNITS, FlatUnit, model_units, pad_block, shard_layout
from .stage_policy import stage_policy
from .unit_hooks import backward_order, gather_all, gather_and_prefetch, install_gather_waits, release_after_forward


def unit_key(index: int, name: str) -> str:
    """The state dict key of unit number `index` (named `name`) of this rank: its fp32 master shard."""
    return f"unit{index}.{name}.master"


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight; its result is added to the unit's fp32 shard on
    the reduce stream, and `done` (once the chain is enqueued) is the event that says so. The
    lease keeps every buffer of the chain alive until the compute stream has waited for it, then
    gives them back to the engine's pool for the next reduction."""

    unit: FlatUnit
    reduction: ReduceScatter | HierarchicalReduceScatter
    lease: Lease
    done: object = None


def in_flight_limit(requested: int | None, hops: int) -> int:
    """Reductions in flight (each holds its unit's gradient until it lands): --zero-reduce-in-flight
    (default 2), at least one per hop, so that a reduction's outermost hop is never issued and waited
    for in the same call."""
    return max(requested or 2, hops)


def reductions_in_flight(cfg) -> int:
    """The engine's in-flight limit for a configuration (the estimator and the simulator: no groups)."""
    z = cfg.zero
    hierarchical = z.zero_quantized_gradients or bool(z.zero_hierarchy)
    hops = len(zero_reduce_tiers(cfg, topology_from_config(cfg))) + 1 if hierarchical else 1
    return in_flight_limit(z.zero_reduce_in_flight, hops)


class ZeroEngine(DataParallelEngine):
    def __init__(self, chunks, groups: ProcessGroups, optim_cfg, zero_cfg, init=None):
        """`chunks` built on the meta device come with `init` (model/init.RankInit): each unit then
        allocates and fills only what this rank keeps (sharded_params.FlatUnit)."""
        self.chunks, self.groups = chunks, groups
        self.policy = policy = stage_policy(zero_cfg.zero_stage)  # what the stage shards, when it reduces
        self.group = groups.dp_cp
        self.per_step = zero_cfg.zero_param_persistence == "step"  # keep gathered weights until the step
        # whether gradients are reduced during the backward: stage 1 only with --overlap-grad-reduce
        # (then the schedule announces each chunk's last micro-batch), stages 2-3 always
        self.overlap_grads = policy.grads.every_backward or zero_cfg.overlap_grad_reduce
        self.overlap_gather = zero_cfg.overlap_param_gather and not policy.sharded_weights
        self.last = [False] * len(chunks)  # stage 1: is this the chunk's last micro-batch of the step
        self.reduced_in_backward = 0  # units whose reduction the backward started (this step)
        self.clip = optim_cfg.clip_grad
        hierarchical = zero_cfg.zero_quantized_gradients or bool(zero_cfg.zero_hierarchy)
        self.reduce_hops = groups.dp_tier_hops() if hierarchical else None
        hops = len(self.reduce_hops) if self.reduce_hops else 1
        self.max_in_flight = in_flight_limit(zero_cfg.zero_reduce_in_flight, hops)
        # side streams (no-ops on CPU: the same code runs everywhere): weight gathers on one, each
        # reduction hop on its link tier's; on an accelerator a reduction's whole hop chain is enqueued
        # at once (NCCL waits only order streams), on CPU gloo's waits block, so hops advance one per unit
        device = init.device if init is not None else next(p.device for c in chunks for p in c.parameters())
        self.dev = torch.get_device_module(device)
        self.gather_stream = self.dev.Stream()
        self.reduce_streams = [self.dev.Stream() for _ in range(hops)]
        self.buffers = ReduceBuffers(device)  # every reduction's buffers, reused step after step
        self.enqueue_whole_chain = device.type != "cpu"
        self.grad_bits = QGZ_BITS if zero_cfg.zero_quantized_gradients else None
        self.grad_block = zero_cfg.zero_gradient_quantization_block_size
        self.stochastic = zero_cfg.zero_gradient_stochastic_rounding
        self.wire = torch.bfloat16 if zero_cfg.grad_reduce_in_bf16 else torch.float32  # unquantized paths
        hpz = groups.dp_hpz if zero_cfg.zero_hpz_partition_size > 1 else None
        self.qwz_block = qwz = zero_cfg.zero_quantization_block_size if zero_cfg.zero_quantized_weights else None
        self.units: list[FlatUnit] = []
        for c, chunk in enumerate(chunks):
            units = {}
            for name, params, module in model_units(chunk):
                unit = FlatUnit(
                    name,
                    params,
                    self.group,
                    policy.sharded_weights,
                    pad_block(zero_cfg),
                    hpz=hpz,
                    qwz_block=qwz,
                    init=init,
                    module=module,
                    chunk=c,
                    tied=name == "embedding" and chunk.tied,  # its twin on the other end stage
                    gather_stream=self.gather_stream,
                )
                policy.grads.prepare(unit)
                units[name] = unit
                self.units.append(unit)
            self._install_hooks(chunk, units)
            if self.overlap_gather:
                install_gather_waits(chunk, units)
        if init is not None:  # buffers, and any parameter outside the units (none today), whole
            materialize(chunks, init)
        for unit in self.units:  # frozen parameters: no hook, no reduce, no step
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_hook(unit))
        # the reduction schedule, fixed by the program: per chunk, its units with a trainable
        # parameter in the order their backward ends; self.next[c]: the next one to issue
        self.schedule, self.sched_before = [], {}  # sched_before: scheduled units before it in the backward
        for c, chunk in enumerate(chunks):
            order = backward_order(chunk, [u for u in self.units if u.chunk == c])
            self.schedule.append([u for u in order if u.grads.trainable])
            for u in order:
                self.sched_before[id(u)] = sum(1 for v in order[: order.index(u)] if v.grads.trainable)
        self.next = [0] * len(chunks)
        self._pending: list[PendingReduce] = []

        self.opt_segments = []  # (unit, a, b, fp32 master view): AdamW steps these views of the shards
        ndims, decoupled, qk = [], [], []  # per segment: its parameter's ndim, --decoupled-lr, a query/key norm
        decoupled_ids = set().union(*(decoupled_lr_params(c) for c in chunks))
        qk_ids = set().union(*(qk_norm_params(c) for c in chunks))
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

    def describe(self) -> str:
        mib = 2**-20
        numel = sum(u.numel for u in self.units)
        padded = sum(u.padded for u in self.units)
        size = self.units[0].full.element_size() if self.units else 4
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
            extra = sum(u.secondary_numel for u in self.units) * size * mib
            parts.append(
                f"hpZ secondary shard over {u0.hpz.size} ranks ({u0.hpz.link}): {extra:.2f} MiB extra per rank"
            )
        if self.reduce_hops is not None:
            hops = ", ".join(f"{h.size} ranks {h.link}" for h in self.reduce_hops)
            sr = " stochastic" if self.stochastic else ""
            what = f"qgZ int4{sr}, blocks of {self.grad_block}" if self.grad_bits else str(self.wire)[6:]
            parts.append(f"hierarchical gradient all-to-all ({what}), hops: {hops}")
        when = "during the backward" if self.overlap_grads else "after the backward"
        parts.append(
            f"gradients accumulated in fp32, reduced in {str(self.wire)[6:] if not self.grad_bits else 'int4'} "
            f"{self.policy.grads.when} {when}, up to {self.max_in_flight} reductions in flight, "
            "from buffers reused every step"
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
        start = [units[n] for n in START_UNITS if n in units] if chunk.pre_process else []
        end = [units[n] for n in ("head", "embedding") if n in units and chunk.post_process]
        order = start + blocks + [end]  # the end units are gathered together
        c = next(iter(units.values())).chunk

        # Stage 3 issues its gathers at module hooks, and a block the data skips fires none: each
        # hook first plays the hooks of the blocks skipped since the last one (gather, prefetch,
        # free; in the backward also issue the reductions the backward moved past), so every
        # rank issues the same gathers and reductions in the same order whatever it skipped.
        pos = {"fwd": 0, "bwd": 0}  # blocks the forward (in order) / backward (reversed) has passed

        def catch_up_forward(upto: int) -> None:
            while pos["fwd"] < upto:
                u = blocks[pos["fwd"]]
                pos["fwd"] += 1
                gather_and_prefetch([u], order, after=u)
                if not self.per_step:
                    u.release()

        def catch_up_backward(upto: int) -> None:
            while pos["bwd"] < upto:
                i = len(blocks) - 1 - pos["bwd"]
                pos["bwd"] += 1
                blocks[i].gather(backward=True)
                if i > 0:
                    blocks[i - 1].start_gather(backward=True)
                self._issue_before(c, self.sched_before[id(blocks[i])] + bool(blocks[i].grads.trainable))
                if not self.per_step:
                    blocks[i].release()

        def chunk_forward(module, args, kwargs):
            pos["fwd"] = 0
            gather_and_prefetch(start, order)

        def end_forward(*_):
            catch_up_forward(len(blocks))

        def chunk_backward(module, grad_output):
            pos["bwd"] = 0
            if self._reducing(c):  # at the end of this backward, issue what it did not (no gradient: zeros)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._flush(c))
            if self.policy.sharded_weights:  # under 1F1B another micro-batch's backward may have freed them
                gather_all(start + [u for u in end if u not in start], backward=True)
                if blocks:
                    blocks[-1].start_gather(backward=True)

        def before_forward(i: int, unit: FlatUnit):
            def hook(module, args):
                if recomputing():  # a rerun inside the backward of its group: gather it for that backward
                    unit.gather(backward=True)
                    return
                catch_up_forward(i)
                pos["fwd"] = i + 1
                gather_and_prefetch([unit], order, after=unit)

            return hook

        def before_backward(i: int, unit: FlatUnit):
            def hook(module, grad_output):
                j = len(blocks) - 1 - i
                catch_up_backward(j)
                pos["bwd"] = j + 1
                self._issue_before(c, self.sched_before[id(unit)])  # what the backward has moved past
                unit.gather(backward=True)
                if i > 0:
                    blocks[i - 1].start_gather(backward=True)

            return hook

        # the chunk's inputs (token ids) need no grad; the pre-hook only needs the output grads
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with "
            "respect to module outputs since no inputs require gradients",
        )
        chunk.register_full_backward_pre_hook(chunk_backward)
        if not self.policy.sharded_weights:  # stages 1-2: the weights stay whole, nothing to gather
            return
        chunk.register_forward_pre_hook(chunk_forward, with_kwargs=True)
        chunk.register_forward_hook(end_forward)  # a middle stage's skipped last blocks
        if end:

            def end_units(module, args):
                end_forward()
                gather_all(end)

            chunk.final_norm.register_forward_pre_hook(end_units)
        for i, unit in enumerate(blocks):
            assert unit.module is not None  # a block's unit is made with its module
            unit.module.register_forward_pre_hook(before_forward(i, unit))
            if not self.per_step:
                unit.module.register_forward_hook(release_after_forward(unit))
            unit.module.register_full_backward_pre_hook(before_backward(i, unit))

    # ---- gradients -----------------------------------------------------------------------
    def _grad_hook(self, unit: FlatUnit):
        index = {id(p): i for i, p in enumerate(unit.params)}

        def hook(p):
            i = index[id(p)]
            off, n = unit.offsets[i], unit.numels[i]
            g = unit.grads
            if g.reduced:  # the wire reads the accumulator (stage 1), or this micro-batch's sum is on its way
                raise RuntimeError(
                    f"ZeRO-{self.policy.stage} unit {unit.name}: a gradient arrived after its reduction started: "
                    + self.policy.grads.late_gradient
                )
            # fp32 whatever the parameter dtype: micro-batches sum without rounding
            self.policy.grads.accumulator(unit, self.buffers)[off : off + n].add_(p.grad.reshape(-1))
            p.grad = None
            if self._reducing(unit.chunk):
                g.ready += 1
                if g.ready == g.trainable:
                    self._issue(unit.chunk, upto=None)

        return hook

    def _reducing(self, chunk: int) -> bool:
        """Whether this backward of `chunk` reduces (stages 2-3: every micro-batch; stage 1: the
        last, when the schedule announced it)."""
        return self.policy.grads.every_backward or self.last[chunk]

    def _issue(self, c: int, upto: int | None) -> None:
        """Issue chunk c's reductions in schedule order: those whose gradients are all in
        (upto=None), or every one left (upto=len: the end of the backward). The order is the
        schedule's on every rank whatever the data; only the moment depends on it."""
        sched = self.schedule[c]
        while self.next[c] < len(sched):
            unit = sched[self.next[c]]
            if upto is None and unit.grads.ready < unit.grads.trainable:
                break
            self._reduce(unit)
            self.reduced_in_backward += 1
            self.next[c] += 1

    def _issue_before(self, c: int, k: int) -> None:
        """Issue chunk c's first k scheduled reductions (those the backward has moved past)."""
        while self.next[c] < k:
            self._reduce(self.schedule[c][self.next[c]])
            self.reduced_in_backward += 1
            self.next[c] += 1

    def _flush(self, c: int) -> None:
        """The end of a reducing backward of chunk c (autograd's final callback): issue the rest,
        then count the next micro-batch afresh. A unit that got no gradient sends zeros."""
        self._issue(c, upto=len(self.schedule[c]))
        if self.policy.grads.every_backward:  # the next backward issues the whole schedule again
            self.next[c] = 0
        for u in self.schedule[c]:
            self.policy.grads.after_backward(u)

    def _reduce(self, unit: FlatUnit) -> None:
        """Start reducing one unit's gradients into its fp32 shard (summed, not averaged),
        and advance the reductions already in flight. Its buffers come from the pool (a lease)."""
        lease = self.buffers.lease()
        flat = self.policy.grads.hand_over(unit, lease)  # no gradient this micro-batch: zeros
        unit.grads.ready = 0
        unit.grads.reduced = True  # stage 1: once per step; 2-3: once per micro-batch (_flush resets it)
        reduction: HierarchicalReduceScatter | ReduceScatter
        if self.reduce_hops is not None:
            phase = "qgz_grad" if self.grad_bits else "zero_grad_hierarchical"
            reduction = HierarchicalReduceScatter(
                flat,
                self.reduce_hops,
                phase,
                self.grad_bits,
                self.grad_block,
                self.stochastic,
                self.wire,
                self.reduce_streams,
                lease,
            )
        else:
            stream = self.reduce_streams[0]
            reduction = ReduceScatter(flat, self.group, "zero_grad_reducescatter", self.wire, stream, lease)
        pending = PendingReduce(unit, reduction, lease)
        if self.enqueue_whole_chain:  # every hop enqueued now, on its stream; the host moves on
            pending.done = reduction.finish(unit.grad_shard)
        else:
            for p in self._pending:  # one hop further: each hop's transfer overlapped a unit's backward
                p.reduction.advance()
        self._pending.append(pending)
        while len(self._pending) > self.max_in_flight:  # hold at most this many gradients (backpressure)
            self._finish_oldest()
        if not self.per_step:
            unit.release()  # stage 3: this micro-batch's backward of the unit is over

    def _finish_oldest(self) -> None:
        """The compute stream waits (an event, not the host) for the oldest reduction; its
        buffers (the unit's gradient among them) go back to the pool only then."""
        oldest = self._pending.pop(0)
        if oldest.done is None:
            oldest.done = oldest.reduction.finish(oldest.unit.grad_shard)
        self.dev.current_stream().wait_event(oldest.done)
        oldest.lease.give_back(oldest.done)

    def _drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def zero_grad(self) -> None:
        """Nothing carries over from the last step: shards, accumulators, counts, the schedule."""
        self._drain()
        for unit in self.units:
            unit.grad_shard.zero_()
            self.policy.grads.clear(unit, self.buffers)
        self.last = [False] * len(self.last)
        self.next = [0] * len(self.next)
        self.reduced_in_backward = 0

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        if self.overlap_grads:
            self.last[chunk] = last

    def _finish_grads(self) -> None:
        for c, sched in enumerate(self.schedule):  # in schedule order: what no backward issued
            for unit in sched[self.next[c] :]:
                if self.policy.grads.at_step(unit):
                    self._reduce(unit)  # stage 1 without overlap: all; 2-3: a backward with no end callback
            self.next[c] = 0
        self._drain()
        self.last = [False] * len(self.last)
        for unit in self.units:
            unit.grads.ready, unit.grads.reduced = 0, False
        partial = [
            u.grad_shard[a:b] for u in self.units for p, a, b, _ in u.segments() if getattr(p, "tp_partial_grad", False)
        ]
        finalize_model_grads(partial, [u.grad_shard for u in self.units if u.tied], self.groups)
        for unit in self.units:
            unit.grad_shard.div_(self.group.size)

    def step(self, lr, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
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
        set_rates(self.optimizer, lr)  # optim.Rates (or one float lr)
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

    def counted_tensors(self, kind: str) -> tuple[list[torch.Tensor], list]:
        g = self.groups
        tensors = [
            (u.master if kind == "params" else u.grad_shard)[a:b]
            for u in self.units
            for p, a, b, _ in u.segments()
            if counted_once(p, g.tp_rank, g.is_first_stage)
        ]
        return tensors, [self.group, g.mp]

    # ---- state -------------------------------------------------------------------------
    @staticmethod
    def layout_key(cfg) -> dict:
        # the block the flat buffers are padded to (lcm of the qwZ and qgZ blocks; the key predates qgZ's own)
        return {"zero_stage": cfg.zero.zero_stage, "zero_quantization_block_size": pad_block(cfg.zero)}

    @classmethod
    def slots(cls, cfg, chunks, group_rank: int, group_size: int) -> RankLayout:
        return shard_layout(chunks, group_rank, group_size, pad_block(cfg.zero), unit_key)

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
