"""What differs between ZeRO stages, as two small pieces the engine picks once at construction.

* Where the weights live (`StagePolicy.sharded_weights`): ZeRO-3 keeps only each unit's shard
  between uses (module hooks gather a unit just before its forward and backward and free it after;
  the fp32 master of an fp32 model is the shard itself); stages 1-2 keep the full weights, which
  the step all-gathers again (--overlap-param-gather leaves that gather in flight until the next
  forward reads them).
* How gradients accumulate and when they are reduced (`StagePolicy.grads`, one `UnitGrads` per unit,
  the only writer of its counts and its accumulator):
  - `ReduceOncePerStep` (ZeRO-1): each unit keeps one persistent full fp32 accumulator; the
    micro-batches add into it and it is reduce-scattered once per step, during the backward of the
    step's last micro-batch with --overlap-grad-reduce (the schedule says which is last), else at the
    step.
  - `ReducePerMicroBatch` (ZeRO-2/3): every backward reduce-scatters each unit's gradient into its
    fp32 shard as soon as it is complete; the accumulator is a pool buffer (zero/reduce_buffers.py)
    held for one micro-batch and handed to the reduction, which gives it back once it has landed.

Optimizer state is sharded at every stage (each rank steps only its shard of the fp32 masters).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .reduce_buffers import Lease, ReduceBuffers
from .sharded_params import FlatUnit


class UnitGrads(ABC):
    """A unit's gradients within a step, read by the reduction schedule (zero/reduce_schedule.py) and
    written only here: `trainable`, its parameters with requires_grad (frozen ones get no hook; a unit
    with none is never reduced); `ready`, how many of them delivered this backward's gradient; `reduced`,
    its reduction started (stage 1: once per step; 2-3: once per micro-batch); `flat`, the fp32
    accumulator of the unit's padded flat gradient (fp32 whatever the parameter dtype: micro-batches sum
    without rounding)."""

    when: str  # for the log: how often a unit is reduced
    every_backward: bool  # whether every backward reduces (else only the step's last, when announced)
    late_gradient: str  # why a gradient can arrive after its unit's reduction started

    def __init__(self, unit: FlatUnit, stage: int, pool: ReduceBuffers):
        self.unit, self.stage, self.pool = unit, stage, pool
        self.trainable = sum(p.requires_grad for p in unit.params)
        self.ready, self.reduced = 0, False
        self.flat: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        """Every trainable parameter delivered this backward's gradient."""
        return self.ready >= self.trainable

    def add(self, index: int, grad: torch.Tensor, counting: bool) -> bool:
        """Add parameter `index`'s gradient into the accumulator; `counting` (a reducing backward) counts
        it in. Returns whether that completed the unit."""
        if self.reduced:  # the wire reads the accumulator (stage 1), or this micro-batch's sum is on its way
            raise RuntimeError(
                f"ZeRO-{self.stage} unit {self.unit.name}: a gradient arrived after its reduction started: "
                + self.late_gradient
            )
        off, n = self.unit.offsets[index], self.unit.numels[index]
        self._accumulator()[off : off + n].add_(grad.reshape(-1))
        if not counting:
            return False
        self.ready += 1
        return self.ready == self.trainable

    def hand_over(self, lease: Lease) -> torch.Tensor:
        """The buffer the unit's reduction reads; the unit is reduced from now on (stage 1: for the step;
        2-3: for this micro-batch, until after_backward)."""
        self.ready, self.reduced = 0, True
        return self._wire_source(lease)

    def end_step(self) -> None:
        """The step has reduced everything: nothing counted, nothing reduced."""
        self.ready, self.reduced = 0, False

    @abstractmethod
    def _accumulator(self) -> torch.Tensor: ...

    @abstractmethod
    def _wire_source(self, lease: Lease) -> torch.Tensor: ...

    @abstractmethod
    def after_backward(self) -> None: ...

    @abstractmethod
    def due_at_step(self) -> bool: ...

    @abstractmethod
    def clear(self) -> None: ...


class ReduceOncePerStep(UnitGrads):
    """ZeRO-1's gradients: full fp32 accumulators, reduced once per step."""

    when = "once per step"
    every_backward = False  # one reducing backward per chunk and step: the last, when announced
    late_gradient = "a backward ran after the one the schedule announced as the last micro-batch (set_last_micro_batch)"

    def __init__(self, unit: FlatUnit, stage: int, pool: ReduceBuffers):
        super().__init__(unit, stage, pool)
        self.flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.device)

    def _accumulator(self) -> torch.Tensor:
        assert self.flat is not None  # stage 1's accumulator is persistent
        return self.flat

    def _wire_source(self, lease: Lease) -> torch.Tensor:
        """The accumulator itself, which the unit keeps (zero_grad clears it once the reduction has landed)."""
        return self._accumulator()

    def after_backward(self) -> None:
        """The end of a reducing backward: the unit stays reduced for the rest of the step."""
        self.ready, self.reduced = 0, True

    def due_at_step(self) -> bool:
        """Whether the step reduces a unit no backward reduced: every one (no overlap)."""
        return True

    def clear(self) -> None:
        self._accumulator().zero_()
        self.ready, self.reduced = 0, False


class ReducePerMicroBatch(UnitGrads):
    """ZeRO-2/3's gradients: each micro-batch reduce-scattered during its backward into the fp32 shard."""

    when = "every micro-batch"
    every_backward = True  # each backward issues the chunk's whole schedule
    late_gradient = "the backward reached a later block first (the schedule assumes the blocks' order)"

    def _accumulator(self) -> torch.Tensor:
        """Taken from the pool at the micro-batch's first gradient of the unit."""
        if self.flat is None:
            self.flat = self.pool.take(self.unit.padded, torch.float32).zero_()
        return self.flat

    def _wire_source(self, lease: Lease) -> torch.Tensor:
        """The accumulator, or zeros when no parameter of the unit got a gradient this micro-batch; the
        reduction's lease holds it until it has landed and then gives it back to the pool."""
        flat, self.flat = self.flat, None
        if flat is None:
            return lease.zeros((self.unit.padded,), torch.float32)
        lease.adopt(flat)
        return flat

    def after_backward(self) -> None:
        """The end of a backward: the next micro-batch is counted afresh."""
        self.ready, self.reduced = 0, False

    def due_at_step(self) -> bool:
        """A backward with no end callback left this unit's gradient unreduced."""
        return bool(self.ready) or self.flat is not None

    def clear(self) -> None:
        if self.flat is not None:  # a backward the step never reduced: dropped, back to the pool
            self.pool.give(self.flat)
        self.flat, self.ready, self.reduced = None, 0, False


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    sharded_weights: bool  # ZeRO-3: weights live as shards, gathered unit by unit before use
    grads: type[UnitGrads]  # how a unit's gradients accumulate and when they are reduced

    def unit_grads(self, unit: FlatUnit, pool: ReduceBuffers) -> UnitGrads:
        """The gradient accumulator of `unit` (its buffers, at stages 2-3, from `pool`)."""
        return self.grads(unit, self.stage, pool)


def stage_policy(stage: int) -> StagePolicy:
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    return StagePolicy(
        stage, sharded_weights=stage == 3, grads=ReduceOncePerStep if stage == 1 else ReducePerMicroBatch
    )
