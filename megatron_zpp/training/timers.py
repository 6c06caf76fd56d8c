"""Timers of a step's phases, as Megatron-LM's --timing-log-level and --timing-log-option.

Level 0 times nothing but the iteration (the log line's own figure); level 1 adds the phases that
run once per step (forward-backward, optimizer: the gradient reduction, clipping and AdamW), level
2 those that run per micro-batch (batch-generator: the time blocked on the data loader). A level-1
phase starts after a barrier over all ranks (unless --no-barrier-with-level-1-timing); a timed
phase ends with a device synchronize, so that its time is the device's and not the launch's (this
costs some overlap: Megatron says the same of levels 1 and 2). At each log line the times summed
over the interval are divided by its iterations and reduced over every rank: the max (option max),
the min and the max (minmax), or every rank's (all); a collective on every rank at every log line
while the level is >= 1, never depending on the data."""

from __future__ import annotations

import time

import torch

from .. import comm

# the phases of each level, in the order they are printed
LEVELS = {1: ["forward-backward", "optimizer"], 2: ["batch-generator"]}


def timer_names(level: int) -> list[str]:
    return [name for lvl in sorted(LEVELS) if lvl <= level for name in LEVELS[lvl]]


class Timers:
    def __init__(self, level: int, option: str, device: torch.device, barrier=None):
        """`barrier` (--barrier-with-level-1-timing): the group to barrier over before each level-1 phase."""
        self.names = timer_names(level)
        self.option, self.device, self.barrier = option, device, barrier
        self.total = dict.fromkeys(self.names, 0.0)
        self.started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if name in self.total:
            self._sync()
            if self.barrier is not None and name in LEVELS[1]:
                comm.barrier(self.barrier)
            self.started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if name in self.started:
            self._sync()
            self.total[name] += time.perf_counter() - self.started.pop(name)

    def add(self, name: str, seconds: float) -> None:
        """A phase measured elsewhere (the data loader's wait)."""
        if name in self.total:
            self.total[name] += seconds

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device).synchronize(self.device)

    def report(self, world, normalizer: int, reset: bool = True) -> dict[str, list[float]]:
        """Collective over `world` (every rank calls it): each timer's milliseconds per iteration
        (the interval's sum / `normalizer`, its iterations), [max], [min, max] or every rank's; the
        sums restart unless not `reset` (the early line after a run's first step)."""
        if not self.names:
            return {}
        mine = torch.tensor([self.total[n] for n in self.names], dtype=torch.float64, device=self.device)
        mine *= 1e3 / max(normalizer, 1)
        if reset:
            self.total = dict.fromkeys(self.names, 0.0)
        if self.option == "all":
            out = torch.zeros(world.size * len(self.names), dtype=torch.float64, device=self.device)
            comm.all_gather(out, mine, world, "timers")
            per_rank = out.reshape(world.size, len(self.names)).t().tolist()
            return dict(zip(self.names, per_rank))
        high = mine.clone()
        comm.all_reduce(high, world, "timers", op=torch.distributed.ReduceOp.MAX)
        if self.option == "max":
            return {n: [h] for n, h in zip(self.names, high.tolist())}
        low = mine.clone()
        comm.all_reduce(low, world, "timers", op=torch.distributed.ReduceOp.MIN)
        return {n: [lo, h] for n, lo, h in zip(self.names, low.tolist(), high.tolist())}


def format_timers(times: dict[str, list[float]], option: str) -> str:
    """The lines Megatron prints under its log line."""
    if not times:
        return ""
    head = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):"}
    lines = [head.get(option, "times across ranks (ms):")]
    width = max(len(n) for n in times)
    for name, values in times.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"    {name:.<{width + 4}}: {shown if len(values) == 1 else f'({shown})'}")
    return "\n".join(lines)
