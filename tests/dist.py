"""The one harness for multi-rank tests: run a function on N gloo ranks as processes.

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, world_size, arg1, arg2)

fn must be a module-level function (it is pickled into spawned processes). Each rank
gets torch.distributed initialized on gloo over loopback and a share of the cores, so N
ranks do not oversubscribe the machine. A failing rank's traceback is re-raised here;
a hang is killed after `timeout` seconds and reported as such.
"""
from __future__ import annotations

import faulthandler
import os
import queue as queue_lib
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, env, fn, args, queue):
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    faulthandler.enable()  # a crash in native code prints its Python stack instead of vanishing
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (report any failure to the parent)
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 180, env: dict | None = None) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, env or {}, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    failures = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_lib.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:  # exited without reporting: killed, or crashed in native code
                    failures.append((dead[0][0], f"process exited with code {dead[0][1]} without a result "
                                                  f"(see its stderr above)"))
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size}-rank run of {fn.__name__} did not finish in {timeout} s "
                                       f"(ranks done: {sorted(results)})") from None
                continue
            if ok:
                results[rank] = value
            else:
                failures.append((rank, value))
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
    if failures:
        rank, tb = failures[0]
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]
