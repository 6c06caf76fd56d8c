"""The one harness for multi-rank tests and benches: run a function on N gloo ranks as processes.

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, world_size, arg1, arg2)

fn must be a module-level function (it is pickled into the rank processes). Ranks are
forked from a forkserver that imported torch and the package once per test session, so
a rank starts in milliseconds instead of re-importing torch (about 2 s of CPU each on
this machine's 2 cores); each rank takes the caller's current environment, working
directory, stdout and stderr. Each rank gets torch.distributed initialized on gloo over loopback and a
share of the cores, so N ranks do not oversubscribe the machine. A failing rank's traceback is re-raised here;
a hang is killed after `timeout` seconds and reported as such.

Fault tests: init_group=False leaves creating the process group to fn (e.g. through
training.setup, with its --distributed-timeout-minutes); keep_failures=True waits for
every rank and returns a RankFailure in place of each failed rank's result.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_lib
import socket
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankFailure:
    """In place of a failed rank's result (keep_failures=True): its traceback, or how its
    process ended."""

    message: str


# Imported once by the forkserver, before any rank forks from it: none of them starts threads on import.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron_zpp.training",
    "megatron_zpp.checkpoint",
    "megatron_zpp.testing.dist",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run)
    return ctx


class _CallerStdio:
    """The caller's stdout and stderr, sent with a rank as file descriptors: a forked rank would write to
    the forkserver's, those of whichever test started it (pytest's capfd must see each test's ranks)."""

    def __reduce__(self):  # pickled while the rank starts: the descriptors travel with it
        return (_inherited_fds, (reduction.DupFd(1), reduction.DupFd(2)))


def _inherited_fds(*dups) -> list[int]:
    return [d.detach() for d in dups]


def _worker(rank, world_size, port, env, cwd, stdio, fn, args, queue, init_group):
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()  # the caller's environment now, not the forkserver's from its start
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    faulthandler.enable()  # a crash in native code prints its Python stack instead of vanishing
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors into the message; the queue's own pickler would pass them as
        # shared-memory handles that the parent can no longer open once this process has exited.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (report any failure to the parent)
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 180,
    env: dict | None = None,
    init_group: bool = True,
    keep_failures: bool = False,
) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    rank_env = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, rank_env, os.getcwd(), _CallerStdio(), fn, args, queue, init_group),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    finished: dict[int, tuple[bool, object]] = {}  # rank -> (ok, result or failure text)
    deadline = time.monotonic() + timeout

    def failed() -> bool:
        return not all(ok for ok, _ in finished.values())

    try:
        while len(finished) < world_size and (keep_failures or not failed()):
            # a rank's report is in the queue before its process ends, so one that had
            # ended before this wait and still sent nothing during it never will
            ended = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in finished]
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_lib.Empty:
                for r, code in ended:  # killed, or crashed in native code
                    finished[r] = (False, f"process exited with code {code} without a result (see its stderr above)")
                if not ended and time.monotonic() > deadline:
                    done = sorted(r for r, (ok, _) in finished.items() if ok)
                    raise TimeoutError(
                        f"{world_size}-rank run of {fn.__name__} did not finish in {timeout} s (ranks done: {done})"
                    ) from None
                continue
            # a failure after the result (the final barrier) is moot
            finished.setdefault(rank, (ok, pickle.loads(value) if ok else value))
    finally:
        for p in procs:
            p.join(timeout=5 if not failed() else 0.5)
            if p.is_alive():
                p.kill()
    if keep_failures:  # the loop ended with every rank finished
        return [value if ok else RankFailure(value) for ok, value in (finished[r] for r in range(world_size))]
    failures = [(r, value) for r, (ok, value) in sorted(finished.items()) if not ok]
    if failures:
        rank, tb = failures[0]
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [finished[r][1] for r in range(world_size)]
