"""ZeRO's gradient reductions: which unit is reduced when, on which stream, and how many are in flight.

The reduction schedule is fixed by the program, not the data. Before any backward each chunk's units
with a trainable parameter are listed in the order their backward ends (backward_order);
a reducing backward (every one at stages 2-3, the step's last at stage 1 with --overlap-grad-reduce)
issues them in that order only: a unit goes as soon as all its trainable parameters' gradients are in
and every unit before it has gone, and autograd's final callback issues the rest at the backward's end
(a parameter that got no gradient adds zeros). ZeRO-3's module hooks (zero/gather_schedule.py) also
issue the units a backward has moved past, so every rank issues the same collectives in the same order
whichever parameters its data reached (--check-collective-order verifies it); zero_grad clears every
count, accumulator and pointer, so nothing carries into the next step. A unit with no trainable
parameter is never reduced.

Streams: one reduce stream per link tier (zero/grad_reduce.py): a reduction's hop 0 stream waits for an
event on the compute stream (the gradient is written), each later hop's for the previous hop's stream;
each hop runs quantize -> all-to-all -> wait -> dequantize-sum (-> requantize) on its stream, and the
last adds the result into the unit's fp32 shard there. On an accelerator the whole chain is enqueued
when the unit's gradients are ready (enqueue_whole_chain); on CPU gloo's waits block the host, so hops
advance one per later unit. The unit's gradient and every buffer of the chain come from one pool
(zero/reduce_buffers.py) and stay held by the reduction's lease (PendingReduce) until the compute stream
has waited for the chain's last event; they then go back with that event, which any later taker's
stream waits for: both TORCH_NCCL_AVOID_RECORD_STREAMS=1 and the default are safe, and after the first
step no reduction allocates anything (the same buffers, in the same order, every step). The compute
stream never waits on the host: beyond max_in_flight reductions (--zero-reduce-in-flight, never fewer
than the hops) it waits for the oldest one's event (backpressure); the step waits for every reduction's
event, i.e. for all reduce streams.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from ..topology import ProcessGroups, topology_from_config, zero_reduce_tiers
from .grad_reduce import QGZ_BITS, HierarchicalReduceScatter, ReduceScatter
from .reduce_buffers import Lease, ReduceBuffers
from .sharded_params import FlatUnit
from .stage_policy import StagePolicy, UnitGrads


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


def backward_order(chunk, units: list[FlatUnit]) -> list[FlatUnit]:
    """The units of a chunk in the order their backward ends:
    a tied output layer on the last stage (the embedding), the head, the blocks last to
    first, the embedding lookup. Known from the model, not from the data."""
    by_name = {u.name: u for u in units}
    emb = by_name.get("embedding")
    order = [emb] if emb is not None and chunk.post_process and not chunk.pre_process else []
    order += [by_name["head"]] if "head" in by_name else []
    for block in reversed([u for u in units if u.module is not None]):
        # a block's experts go right after it: their backward ends first, but the hooks issue a block's units
        # at the backward of the block before it (issue_before), which must not take them before theirs ends
        order += [block] + block.companions
    order += [emb] if emb is not None and emb not in order else []
    return order + [u for u in units if u not in order]


class ReduceSchedule:
    """The gradient side of a ZeroEngine: each unit's accumulator (the stage policy's UnitGrads), the
    post-accumulate hooks that fill them, the per-chunk schedule and the reductions in flight."""

    def __init__(self, chunks, units: list[FlatUnit], groups: ProcessGroups, policy: StagePolicy, zero_cfg, device):
        self.policy, self.group = policy, groups.dp_cp
        self.per_step = zero_cfg.zero_param_persistence == "step"  # ZeRO-3 keeps the weights until the step
        # stage 1 reduces during the backward only with --overlap-grad-reduce (the schedule then announces
        # each chunk's last micro-batch), stages 2-3 always
        self.overlap = policy.grads.every_backward or zero_cfg.overlap_grad_reduce
        self.last = [False] * len(chunks)  # stage 1: is this the chunk's last micro-batch of the step
        self.reduced_in_backward = 0  # units whose reduction the backward started (this step)
        hierarchical = zero_cfg.zero_quantized_gradients or bool(zero_cfg.zero_hierarchy)
        self.hops = groups.dp_tier_hops() if hierarchical else None
        self.expert_hops = list(groups.edp_tiers) if hierarchical and groups.edp_tiers else None
        self.max_in_flight = in_flight_limit(zero_cfg.zero_reduce_in_flight, len(self.hops) if self.hops else 1)
        # each hop on its link tier's stream (no-ops on CPU); on an accelerator a reduction's whole hop chain
        # is enqueued at once (NCCL waits only order streams), on CPU gloo's waits block: one hop per unit
        self.dev = torch.get_device_module(device)
        self.streams = [self.dev.Stream() for _ in range(len(self.hops) if self.hops else 1)]
        self.enqueue_whole_chain = device.type != "cpu"
        self.buffers = ReduceBuffers(device)  # every reduction's buffers, reused step after step
        self.bits = QGZ_BITS if zero_cfg.zero_quantized_gradients else None
        self.block = zero_cfg.zero_gradient_quantization_block_size
        self.stochastic = zero_cfg.zero_gradient_stochastic_rounding
        self.wire = torch.bfloat16 if zero_cfg.grad_reduce_in_bf16 else torch.float32  # unquantized paths
        self.grads: dict[FlatUnit, UnitGrads] = {u: policy.unit_grads(u, self.buffers) for u in units}
        self._plan(chunks, units)
        self._pending: list[PendingReduce] = []
        self._install_hooks(chunks, units)

    def _plan(self, chunks, units: list[FlatUnit]) -> None:
        """Per chunk, its units with a trainable parameter in the order their backward ends (`schedule`);
        `next[c]`: the next one to issue; `sched_before`: how many scheduled units precede a unit's backward."""
        self.schedule: list[list[FlatUnit]] = []
        self.sched_before: dict[FlatUnit, int] = {}
        for c, chunk in enumerate(chunks):
            order = backward_order(chunk, [u for u in units if u.chunk == c])
            self.schedule.append([u for u in order if self.grads[u].trainable])
            for i, u in enumerate(order):
                self.sched_before[u] = sum(1 for v in order[:i] if self.grads[v].trainable)
        self.next = [0] * len(chunks)

    def _install_hooks(self, chunks, units: list[FlatUnit]) -> None:
        """Each trainable parameter's post-accumulate hook (frozen ones: none, never reduced, never
        stepped), and each chunk's backward pre-hook (start_backward)."""
        for unit in units:
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_hook(unit))
        # the chunk's inputs (token ids) need no grad; its backward pre-hook only needs the output grads
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with "
            "respect to module outputs since no inputs require gradients",
        )
        for c, chunk in enumerate(chunks):
            chunk.register_full_backward_pre_hook(functools.partial(self.start_backward, c))

    def describe(self) -> list[str]:
        parts = []
        wire = "int4" if self.bits else str(self.wire)[6:]
        if self.hops is not None:
            hops = ", ".join(f"{h.size} ranks {h.link}" for h in self.hops)
            sr = " stochastic" if self.stochastic else ""
            what = f"qgZ int4{sr}, blocks of {self.block}" if self.bits else wire
            parts.append(f"hierarchical gradient all-to-all ({what}), hops: {hops}")
        when = "during the backward" if self.overlap else "after the backward"
        parts.append(
            f"gradients accumulated in fp32, reduced in {wire} {self.policy.grads.when} {when}, "
            f"up to {self.max_in_flight} reductions in flight, from buffers reused every step"
        )
        return parts

    # ---- the backward ------------------------------------------------------------------
    def _grad_hook(self, unit: FlatUnit):
        index = {id(p): i for i, p in enumerate(unit.params)}
        grads = self.grads[unit]

        def hook(p):
            complete = grads.add(index[id(p)], p.grad, counting=self.reducing(unit.chunk))
            p.grad = None
            if complete:
                self.issue(unit.chunk)

        return hook

    def reducing(self, chunk: int) -> bool:
        """Whether this backward of `chunk` reduces (stages 2-3: every micro-batch; stage 1: the
        last, when the schedule announced it)."""
        return self.policy.grads.every_backward or self.last[chunk]

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        if self.overlap:
            self.last[chunk] = last

    def start_backward(self, c: int, module=None, grad_output=None) -> None:
        """A backward of chunk c begins: a reducing one issues, at its end, what it did not."""
        if self.reducing(c):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._flush(c))

    def issue(self, c: int, everything: bool = False) -> None:
        """Issue chunk c's reductions in schedule order: those whose gradients are all in, or every one
        left (`everything`: the end of the backward). The order is the schedule's on every rank whatever
        the data; only the moment depends on it."""
        sched = self.schedule[c]
        while self.next[c] < len(sched):
            if not everything and not self.grads[sched[self.next[c]]].complete:
                break
            self._issue_next(c)

    def issue_before(self, c: int, unit: FlatUnit, inclusive: bool = False) -> None:
        """Issue chunk c's scheduled reductions the backward has moved past: those before `unit` (and
        `unit` itself, if `inclusive` and it is scheduled)."""
        k = self.sched_before[unit] + (inclusive and bool(self.grads[unit].trainable))
        while self.next[c] < k:
            self._issue_next(c)

    def _issue_next(self, c: int) -> None:
        self._reduce(self.schedule[c][self.next[c]])
        self.reduced_in_backward += 1
        self.next[c] += 1

    def _flush(self, c: int) -> None:
        """The end of a reducing backward of chunk c (autograd's final callback): issue the rest,
        then count the next micro-batch afresh. A unit that got no gradient sends zeros."""
        self.issue(c, everything=True)
        if self.policy.grads.every_backward:  # the next backward issues the whole schedule again
            self.next[c] = 0
        for u in self.schedule[c]:
            self.grads[u].after_backward()

    # ---- reductions in flight -------------------------------------------------------------
    def _reduce(self, unit: FlatUnit) -> None:
        """Start reducing one unit's gradients into its fp32 shard (summed, not averaged),
        and advance the reductions already in flight. Its buffers come from the pool (a lease)."""
        lease = self.buffers.lease()
        flat = self.grads[unit].hand_over(lease)  # no gradient this micro-batch: zeros
        reduction: HierarchicalReduceScatter | ReduceScatter
        hops = self.hops if unit.group is self.group else self.expert_hops  # a block's experts: over edp
        if hops is not None:
            phase = "qgz_grad" if self.bits else "zero_grad_hierarchical"
            reduction = HierarchicalReduceScatter(
                flat, hops, phase, self.bits, self.block, self.stochastic, self.wire, self.streams[: len(hops)], lease
            )
        else:
            reduction = ReduceScatter(flat, unit.group, "zero_grad_reducescatter", self.wire, self.streams[0], lease)
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

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    # ---- the step ----------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce, in schedule order, what no backward issued (stage 1 without overlap: all; 2-3: a
        backward with no end callback), wait for every reduction, and start the next step afresh."""
        for c, sched in enumerate(self.schedule):
            for unit in sched[self.next[c] :]:
                if self.grads[unit].due_at_step():
                    self._reduce(unit)
            self.next[c] = 0
        self.drain()
        self.last = [False] * len(self.last)
        for grads in self.grads.values():
            grads.end_step()

    def zero_grad(self) -> None:
        """Nothing carries over from the last step: shards, accumulators, counts, the schedule."""
        self.drain()
        for unit, grads in self.grads.items():
            unit.grad_shard.zero_()
            grads.clear()
        self.last = [False] * len(self.last)
        self.next = [0] * len(self.next)
        self.reduced_in_backward = 0
