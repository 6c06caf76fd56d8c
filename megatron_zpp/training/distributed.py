"""Start and end the distributed job: the process group on the run's device, every group, and
the exit signal the ranks agree on."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from .. import comm
from ..checkpoint.guard import release_save_dirs
from ..config import Config
from ..optim.nonfinite import set_stop_source
from ..topology import ProcessGroups, build_groups_from_config
from ..validation.common import launch_device_type


def init_distributed(cfg: Config) -> tuple[ProcessGroups, torch.device]:
    """Start torch.distributed (torchrun env, or a single process) and build all groups."""
    use_cuda = launch_device_type(cfg.train.device) == "cuda"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.accelerator.set_device_index(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        # x86 FTZ/DAZ: a subnormal float costs ~100x a normal one there (GPUs run them at full speed); a decaying
        # linear-attention state passes through them (GDN's CP map M: the whole operator ran 5x slower). Set before
        # the intra-op threads start, which inherit it. Values below 1.2e-38 become 0: far below fp32 round-off.
        torch.set_flush_denormal(True)
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
    """Why a run stops early, agreed by every rank after the same step. --exit-signal-handler: the
    signals of --exit-signal only set a flag. Ctrl-C (SIGINT, when --exit-signal does not list it)
    is always caught the same way: the step finishes, the run saves when --save is given and exits
    130; a second SIGINT interrupts at once (no save). --exit-duration-in-mins: past the time
    (counted from `started`, time.time() at set-up; Megatron's rule: a rank past it stops them all).
    With the handler or a duration, the ranks agree right after each step (a MAX all-reduce over
    the world, as Megatron), so a request that reached any rank before it stops every rank after
    that step. Without them (a Ctrl-C only), no collective is added: the flag rides on the step's
    finiteness check (optim/nonfinite.py), so a Ctrl-C that comes after a step's check (during its
    optimizer step, evaluation or save) stops the run one step later. Installed at set-up, so a
    signal that comes while the run loads is kept too (instead of killing the rank)."""

    def __init__(
        self,
        enabled: bool,
        signal_names: list[str],
        device: torch.device,
        minutes: float | None = None,
        started: float = 0.0,
    ):
        self.enabled, self.device, self.received, self.interrupted = enabled, device, False, False
        self.names = list(signal_names)
        self.deadline = started + 60 * minutes if minutes else None
        self.previous: dict[int, object] = {}  # installed: signal -> the handler it replaced

    def install(self) -> ExitSignal:
        if not self.previous and threading.current_thread() is threading.main_thread():
            for name in self.names if self.enabled else []:
                self.previous[getattr(signal, name)] = signal.signal(getattr(signal, name), self._handle)
            if signal.SIGINT not in self.previous:
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        set_stop_source(self.lanes)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def _interrupt(self, signum, frame) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt now

    def lanes(self) -> tuple[int, int, int]:
        """This rank's (signal, duration, interrupt) requests, for the step's agreement."""
        late = self.deadline is not None and time.time() >= self.deadline
        return int(self.received), int(late), int(self.interrupted)

    def anywhere(self, groups: ProcessGroups, checked: tuple[int, ...]) -> str | None:
        """'signal', 'interrupt', 'duration' or None, the same on every rank: from the post-step
        all-reduce with the handler or a duration, else from `checked` (the step check's lanes)."""
        if self.enabled or self.deadline is not None:
            flag = torch.tensor([float(v) for v in self.lanes()], device=self.device)
            comm.all_reduce(flag, groups.world, "exit_signal", op=dist.ReduceOp.MAX)
            checked = tuple(int(v) for v in flag.tolist())
        signalled, late, interrupted = checked
        return "signal" if signalled else "interrupt" if interrupted else "duration" if late else None

    def close(self) -> None:
        set_stop_source(None)
        for signum, previous in self.previous.items():  # None: a handler not set from Python
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous = {}
