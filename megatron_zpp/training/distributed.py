"""Start and end the distributed job: the process group on the run's device, every group."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

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
