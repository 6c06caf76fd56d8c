"""The order of one step's work on each pipeline stage, taken from the real schedules.

`stage_ops` runs pipeline_parallel/schedules.py's own 1F1B / interleaved functions on a
stand-in stage and link that only record what is asked of them, so the simulator's
sequence of forwards, backwards and p2p sends is the engine's by construction (not a
re-derivation of the warm-up counts).

`pipeline_time` then times those sequences: a forward of virtual stage (chunk c, stage p)
starts when the stage is free and the activation of virtual stage v-1 has arrived (its
forward end + p2p time); a backward when the gradient of virtual stage v+1 has arrived.
With uniform forward/backward times and free p2p this gives 1F1B's bubble (p-1)/(m+p-1)
of the step and the interleaved schedule's (p-1)/(V m + p-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...pipeline_parallel.schedules import (
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
)


@dataclass(frozen=True)
class Op:
    kind: str  # "F" forward, "B" backward of one micro-batch of one chunk
    chunk: int
    micro_batch: int


class _Group:
    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


class _RecordingStage:
    """Stands in for schedules.Stage: records forwards and backwards."""

    def __init__(self, chunks: int, m: int):
        self.chunks, self.m, self.forward_only = list(range(chunks)), m, False
        self.losses: list = []
        self.ops: list[Op] = []
        self._fwd, self._bwd = [0] * chunks, [0] * chunks
        self._pending: list[int] = []  # the chunk of each backward announced

    def forward(self, chunk: int, hidden):
        self.ops.append(Op("F", chunk, self._fwd[chunk]))
        self._fwd[chunk] += 1
        return ("y", chunk)

    def announce_backward(self, chunk: int) -> None:
        self._pending.append(chunk)

    def backward(self, hidden, out, grad):
        chunk = self._pending.pop(0)
        self.ops.append(Op("B", chunk, self._bwd[chunk]))
        self._bwd[chunk] += 1
        return None if hidden is None else ("dx", chunk)  # the first stage has no input gradient


class _RecordingLink:
    """Stands in for p2p.StageLink: counts the sends (what the ledger records)."""

    def __init__(self, pp: int, rank: int):
        self.pp = _Group(pp, rank)
        self.fwd_sends = self.bwd_sends = 0

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        self.fwd_sends += send_next is not None
        self.bwd_sends += send_prev is not None
        return ("x" if recv_prev else None), ("dy" if recv_next else None)


@dataclass
class StageSchedule:
    ops: list[Op]
    fwd_sends: int  # activations sent to the next stage per step
    bwd_sends: int  # gradients sent to the previous stage per step


def stage_ops(pp: int, pp_rank: int, chunks: int, m: int) -> StageSchedule:
    """This stage's forwards/backwards in the order the engine runs them, and its sends."""
    stage, link = _RecordingStage(chunks, m), _RecordingLink(pp, pp_rank)
    if pp == 1:
        forward_backward_no_pipelining(stage)
    elif chunks == 1:
        forward_backward_1f1b(stage, link)
    else:
        forward_backward_interleaved(stage, link)
    return StageSchedule(stage.ops, link.fwd_sends, link.bwd_sends)


def pipeline_time(schedules: list[StageSchedule], run, p2p: float = 0.0) -> list[float]:
    """Each stage's end time. run(stage, op, start) -> end: runs one forward/backward that may
    start at `start` (its stage is free and its input has arrived); p2p: transfer time of an
    activation or gradient between stages (added to each cross-stage dependency)."""
    pp = len(schedules)
    V = max(op.chunk for op in schedules[0].ops) + 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    clock, index = [0.0] * pp, [0] * pp
    remaining = sum(len(s.ops) for s in schedules)
    while remaining:
        progressed = False
        for p in range(pp):
            while index[p] < len(schedules[p].ops):
                op = schedules[p].ops[index[p]]
                v = op.chunk * pp + p
                if op.kind == "F":
                    dep = ("F", v - 1, op.micro_batch) if v > 0 else None
                else:
                    dep = ("B", v + 1, op.micro_batch) if v < pp * V - 1 else ("F", v, op.micro_batch)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p if dep[1] != v else 0.0)
                clock[p] = run(p, op, max(clock[p], ready))
                done[(op.kind, v, op.micro_batch)] = clock[p]
                index[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked in the simulator")
    return clock


def uniform_pipeline(pp: int, chunks: int, m: int, fwd: float, bwd: float) -> float:
    """Step time of uniform forwards/backwards (per chunk) with free p2p: the bubble's reference."""
    schedules = [stage_ops(pp, p, chunks, m) for p in range(pp)]
    return max(pipeline_time(schedules, lambda p, op, start: start + (fwd if op.kind == "F" else bwd)))
