"""What a run may do to its --save directory, decided at set-up before any step:

* one live writer: rank 0 holds an exclusive lock (flock) on DIR/.lock for the run's life (the
  operating system drops it when the process dies, so a crashed run leaves no stale lock); a
  second run saving into DIR is refused, naming the holder;
* never backwards: a run that did not --load from DIR refuses a DIR that already holds
  checkpoints (its saves would overwrite them and move `latest` back) unless --override-checkpoint.

Every rank learns rank 0's verdict (one broadcast that each rank issues), so all of them fail alike."""

from __future__ import annotations

import fcntl
import os
import socket
from typing import IO

import torch

from .. import comm
from .files import CheckpointError, saved_iterations

LOCK_FILE = ".lock"
_held: dict[str, IO[str]] = {}  # directory -> its open lock file, kept for the process's life


def lock_save_dir(directory: str) -> str | None:
    """Take DIR's writer lock; why not (None when taken)."""
    path = os.path.join(directory, LOCK_FILE)
    if directory in _held:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        return f"--save {directory}: cannot be written ({e.strerror or e}): give a writable --save"
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return f"--save {directory}: another run is saving into it ({holder} holds {path}); give another --save"
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _held[directory] = f
    return None


def release_save_dirs() -> None:
    """Drop every lock this process holds (at shutdown; a process's end drops them too)."""
    while _held:
        _held.popitem()[1].close()


def overwrite_problem(save: str, loaded_root: str | None, override: bool) -> str | None:
    """Why this run may not save into `save` (None when it may): it holds checkpoints and this run
    did not load from it. With --override-checkpoint: None (setup logs what it writes over)."""
    have = saved_iterations(save)
    if not have or override or (loaded_root and os.path.realpath(loaded_root) == os.path.realpath(save)):
        return None
    return (
        f"--save {save} already holds checkpoints up to iteration {have[-1]} and this run did not --load from it: "
        f"its saves would overwrite them and move 'latest' back; resume with --load {save}, give another --save, "
        "or pass --override-checkpoint"
    )


def guard_save_dir(save: str, loaded_root: str | None, override: bool, rank: int, groups, device) -> None:
    """Rank 0 locks `save` and checks overwrite_problem; every rank raises CheckpointError alike."""
    problem = None
    if rank == 0:
        problem = lock_save_dir(save) or overwrite_problem(save, loaded_root, override)
    flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=device)
    comm.broadcast(flag, 0, groups.world, "checkpoint_guard")
    if flag.item():
        raise CheckpointError(problem or f"--save {save}: refused by rank 0 (its line says why)")
