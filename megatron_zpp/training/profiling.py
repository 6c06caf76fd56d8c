"""Profiling a run, with Megatron-LM's flags: --profile traces a window of steps (a torch.profiler
chrome trace with --use-pytorch-profiler, else an nsys capture range), --record-memory-history
writes CUDA memory snapshots. Only the ranks of --profile-ranks do either."""

from __future__ import annotations

import os

import torch

from ..config import Config, ConfigError
from ..logging_utils import log
from ..validation.log import check_device_needs


def check_device(cfg: Config, device: torch.device) -> None:
    """What needs CUDA, refused by name on another device before the model is built (validate refused it
    already for the device a launch expects; this is for the device it got)."""
    problems = check_device_needs(cfg, device.type)
    if problems:
        raise ConfigError("\n".join(problems))


def profile_dir(cfg: Config) -> str:
    """Where the chrome traces go: --profile-dir, else beside --tensorboard-dir as Megatron does."""
    g = cfg.log
    if g.profile_dir:
        return g.profile_dir
    if g.tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(g.tensorboard_dir)), "torch_profile")
    return "torch_profile"


class StepProfiler:
    """--profile on this rank: iterations start..end-1 (numbered from 1) are recorded.

    torch.profiler starts one step early (a warm-up step, as Megatron's schedule has, so the
    profiler's own start-up cost is not in the trace) and writes rank-R.json.gz after the
    window; without --use-pytorch-profiler the window is a cudaProfilerStart/Stop range for
    `nsys profile --capture-range=cudaProfilerApi`. A run resumed inside the window records
    the rest of it; a run that stops inside it (signal, end of training) writes what it has."""

    def __init__(self, cfg: Config, rank: int, device: torch.device, done_iterations: int):
        g = cfg.log
        self.rank, self.device = rank, device
        self.start, self.end = max(g.profile_step_start, done_iterations + 1), g.profile_step_end
        self.enabled = g.profile and rank in g.profile_ranks and self.start < self.end
        self.use_torch = g.use_pytorch_profiler
        warmup = 1 if self.use_torch and self.start - 1 > done_iterations else 0
        self.begin = self.start - warmup
        self.trace = os.path.join(profile_dir(cfg), f"rank-{rank}.json.gz")
        self.prof = None
        if self.enabled and self.use_torch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.end - self.start, repeat=1),
                on_trace_ready=self._write,
            )
        self.running = False

    def _write(self, prof) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.trace)), exist_ok=True)
        prof.export_chrome_trace(self.trace)
        log(f"rank {self.rank}: profile of iterations {self.start}..{self.end - 1} written to {self.trace}", 0)

    def before_step(self, iteration: int) -> None:
        """`iteration`: the number of the step about to run."""
        if not self.enabled or iteration != self.begin:
            return
        self.running = True
        if self.prof is not None:
            self.prof.start()
        else:  # nsys: no warm-up step
            torch.cuda.profiler.start()

    def after_step(self, iteration: int) -> None:
        """`iteration`: the number of the step that has just run."""
        if not self.running:
            return
        if self.prof is not None:
            self.prof.step()  # after the window's last step this writes the trace
        if iteration == self.end - 1:
            self.close()

    def close(self) -> None:
        if not self.running:
            return
        self.running = False
        if self.prof is not None:
            self.prof.stop()  # inside the window: writes what was recorded
        else:
            torch.cuda.profiler.stop()


class MemorySnapshots:
    """--record-memory-history on the ranks of --profile-ranks: the CUDA caching allocator's
    history from set-up on, dumped (overwritten) at every log interval and at the end, as
    Megatron does, to BASE_R.EXT of --memory-snapshot-path."""

    MAX_ENTRIES = 100_000  # Megatron's: the newest allocation events kept

    def __init__(self, cfg: Config, rank: int, device: torch.device):
        g = cfg.log
        self.enabled = g.record_memory_history and rank in g.profile_ranks
        base, ext = os.path.splitext(g.memory_snapshot_path)
        self.path = f"{base}_{rank}{ext}"
        if self.enabled:  # check_device made sure this is CUDA
            torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES, device=device)

    def dump(self) -> None:
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            torch.cuda.memory._dump_snapshot(self.path)
