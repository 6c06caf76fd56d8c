"""What differs between ZeRO stages, as two small pieces the engine picks once at construction.

* Where the weights live (`StagePolicy.sharded_weights`): ZeRO-3 keeps only each unit's shard
  between uses (module hooks gather a unit just before its forward and backward and free it after;
  the fp32 master of an fp32 model is the shard itself); stages 1-2 keep the full weights, which
  the step all-gathers again (--overlap-param-gather leaves that gather in flight until the next
  forward reads them).
* How gradients accumulate and when they are reduced (`StagePolicy.grads`):
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

from dataclasses import dataclass

import torch

from .reduce_buffers import Lease, ReduceBuffers
from .sharded_params import FlatUnit


class ReduceOncePerStep:
    """ZeRO-1's gradients: full fp32 accumulators, reduced once per step."""

    when = "once per step"
    every_backward = False  # one reducing backward per chunk and step: the last, when announced
    late_gradient = "a backward ran after the one the schedule announced as the last micro-batch (set_last_micro_batch)"

    @staticmethod
    def prepare(unit: FlatUnit) -> None:
        unit.grads.flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.device)

    @staticmethod
    def accumulator(unit: FlatUnit, pool: ReduceBuffers) -> torch.Tensor:
        return unit.grads.flat

    @staticmethod
    def hand_over(unit: FlatUnit, lease: Lease) -> torch.Tensor:
        """The buffer the unit's reduction reads: the accumulator itself, which the unit keeps (zero_grad
        clears it once the reduction has landed)."""
        return unit.grads.flat

    @staticmethod
    def after_backward(unit: FlatUnit) -> None:
        """The end of a reducing backward: the unit stays reduced for the rest of the step."""
        unit.grads.ready, unit.grads.reduced = 0, True

    @staticmethod
    def at_step(unit: FlatUnit) -> bool:
        """Whether the step reduces a unit no backward reduced: every one (no overlap)."""
        return True

    @staticmethod
    def clear(unit: FlatUnit, pool: ReduceBuffers) -> None:
        assert unit.grads.flat is not None  # stage 1's accumulator is persistent
        unit.grads.flat.zero_()
        unit.grads.ready, unit.grads.reduced = 0, False


class ReducePerMicroBatch:
    """ZeRO-2/3's gradients: each micro-batch reduce-scattered during its backward into the fp32 shard."""

    when = "every micro-batch"
    every_backward = True  # each backward issues the chunk's whole schedule
    late_gradient = "the backward reached a later block first (the schedule assumes the blocks' order)"

    @staticmethod
    def prepare(unit: FlatUnit) -> None:
        """Nothing persistent per unit: an accumulator comes from the pool for one micro-batch."""

    @staticmethod
    def accumulator(unit: FlatUnit, pool: ReduceBuffers) -> torch.Tensor:
        if unit.grads.flat is None:  # fp32 whatever the parameter dtype
            unit.grads.flat = pool.take(unit.padded, torch.float32).zero_()
        return unit.grads.flat

    @staticmethod
    def hand_over(unit: FlatUnit, lease: Lease) -> torch.Tensor:
        """The unit's accumulator, or zeros when no parameter of it got a gradient this micro-batch; the
        reduction's lease holds it until it has landed and then gives it back to the pool."""
        flat, unit.grads.flat = unit.grads.flat, None
        if flat is None:
            return lease.zeros((unit.padded,), torch.float32)
        lease.adopt(flat)
        return flat

    @staticmethod
    def after_backward(unit: FlatUnit) -> None:
        """The end of a backward: the next micro-batch is counted afresh."""
        unit.grads.ready, unit.grads.reduced = 0, False

    @staticmethod
    def at_step(unit: FlatUnit) -> bool:
        """A backward with no end callback left this unit's gradient unreduced."""
        return bool(unit.grads.ready) or unit.grads.flat is not None

    @staticmethod
    def clear(unit: FlatUnit, pool: ReduceBuffers) -> None:
        if unit.grads.flat is not None:  # a backward the step never reduced: dropped, back to the pool
            pool.give(unit.grads.flat)
        unit.grads.flat, unit.grads.ready, unit.grads.reduced = None, 0, False


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    sharded_weights: bool  # ZeRO-3: weights live as shards, gathered unit by unit before use
    grads: type[ReduceOncePerStep] | type[ReducePerMicroBatch]


def stage_policy(stage: int) -> StagePolicy:
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    return StagePolicy(
        stage, sharded_weights=stage == 3, grads=ReduceOncePerStep if stage == 1 else ReducePerMicroBatch
    )
