"""Start and end the distributed job: the process group on the run's device, every group, and
the exit signal the ranks agree on."""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist

from .. import comm
from ..checkpoint.guard import release_save_dirs
from ..config import Config
from ..topology import ProcessGroups, build_groups_from_config


def init_distributed(cfg: Config) -> tuple[ProcessGroups, torch.device]:
    """Start torch.distributed (torchrun env, or a single process) and build all groups."""
    want = cfg.train.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.accelerator.set_device_index(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # a rank waiting on a dead or hung peer fails after this instead of hanging the job
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timeout)
    return build_groups_from_config(cfg, rank, timeout=timeout), device


def shutdown() -> None:
    """Leave together: a rank exiting while a peer still talks to it aborts the peer."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    release_save_dirs()  # --save's writer lock


class ExitSignal:
    """--exit-signal-handler: the signals of --exit-signal only set a flag; after each step the
    ranks agree on it (a MAX all-reduce over the world), so a signal that reached any rank stops
    every rank at the same step boundary, after a checkpoint. Installed at set-up, so a signal
    that comes while the run loads is kept too (instead of killing the rank).
    --exit-duration-in-mins rides on the same all-reduce (Megatron's rule: a rank past the time
    stops them all), counted from `started` (time.time() at set-up)."""

    def __init__(
        self,
        enabled: bool,
        signal_names: list[str],
        device: torch.device,
        minutes: float | None = None,
        started: float = 0.0,
    ):
        self.enabled, self.device, self.received = enabled, device, False
        self.names = list(signal_names)
        self.deadline = started + 60 * minutes if minutes else None
        self.previous: dict[int, object] = {}  # installed: signal -> the handler it replaced

    def install(self) -> ExitSignal:
        if self.enabled and not self.previous:
            for name in self.names:
                signum = getattr(signal, name)
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def anywhere(self, groups: ProcessGroups) -> str | None:
        """'signal', 'duration' or None, the same on every rank."""
        if not self.enabled and self.deadline is None:
            return None
        late = self.deadline is not None and time.time() >= self.deadline
        flag = torch.tensor([float(self.received), float(late)], device=self.device)
        comm.all_reduce(flag, groups.world, "exit_signal", op=dist.ReduceOp.MAX)
        return "signal" if flag[0].item() else "duration" if flag[1].item() else None

    def close(self) -> None:
        for signum, previous in self.previous.items():  # None: a handler not set from Python
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous = {}
