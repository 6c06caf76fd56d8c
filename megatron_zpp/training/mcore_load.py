"""--load of a megatron-core torch_dist checkpoint (Megatron-LM's `--ckpt-format torch_dist`), as Megatron-LM
loads it: converted on the fly by checkpoint.mcore.import_checkpoint (what `tools/convert_checkpoint.py --from
megatron` does once) into a temporary directory of ours, which load_checkpoint then reads at this run's
layout (any TP/PP/DP: DCP reshards) and which is removed once the run is set up.

One rank per node converts (every rank of the node reads the directory it wrote; nodes need not share a
file system); a conversion that fails on any node stops every rank with one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch

from .. import comm
from ..checkpoint import CheckpointError, LoadTarget
from ..checkpoint.files import iter_name
from ..checkpoint.mcore import import_checkpoint, iteration_dir
from ..logging_utils import log


def mcore_source(load: str, step: int | None) -> str:
    """The megatron-core directory --load (and --ckpt-step) name: a root with its tracker file, or an iter dir."""
    return os.path.join(load, iter_name(step)) if step is not None else load


@contextlib.contextmanager
def converted(target: LoadTarget, load: str) -> Iterator[tuple[str, str]]:
    """(our checkpoint root converted from the megatron-core checkpoint `load`, the megatron-core iteration
    dir it came from) for the duration of the block; the conversion is removed after it."""
    t, groups, rank = target.cfg.train, target.groups, target.rank
    source = mcore_source(load, t.ckpt_step)
    local = int(os.environ.get("LOCAL_RANK", rank % groups.topo.ranks_per_node))
    token = torch.tensor([os.getpid() if rank == 0 else 0], dtype=torch.int64, device=target.device)
    comm.broadcast(token, 0, groups.world, "checkpoint_load")  # one name per run: rank 0's pid, and the node
    root = os.path.join(tempfile.gettempdir(), f"megatron_zpp_mcore_{int(token.item())}_{rank - local}")
    error = None
    if local == 0:
        error = _convert(source, root, with_optimizer=t.load_optim and not t.finetune, load=load, rank=rank)
    flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=target.device)
    comm.all_reduce(flag, groups.world, "checkpoint_load", op=torch.distributed.ReduceOp.MAX)
    try:
        if flag.item():
            raise error or CheckpointError(f"--load {load}: another node could not convert it (its line says why)")
        yield root, iteration_dir(source)
    except BaseException:
        if local == 0:
            shutil.rmtree(root, ignore_errors=True)
        raise
    comm.barrier()  # every rank of the node is done reading it
    if local == 0:
        shutil.rmtree(root, ignore_errors=True)


def _convert(source: str, root: str, with_optimizer: bool, load: str, rank: int) -> CheckpointError | None:
    """Convert `source` into `root` (None), or why it cannot be (the error every rank of this node raises)."""
    shutil.rmtree(root, ignore_errors=True)  # a leftover of a killed run with the same pid
    try:
        _, done = import_checkpoint(source, root, with_optimizer=with_optimizer)
    except CheckpointError as e:
        return CheckpointError(f"--load {load}: a megatron-core torch_dist checkpoint that cannot be read here: {e}")
    except Exception as e:  # noqa: BLE001  (any failure: the other ranks wait on this one's word)
        return CheckpointError(
            f"--load {load}: converting its megatron-core checkpoint failed: {type(e).__name__}: {e}"
        )
    log(
        f"--load {load}: a megatron-core torch_dist checkpoint (iteration {done['iteration']}, "
        f"{done['consumed_samples']} samples, {done['tensors']} tensors{', Adam state' if done['optimizer'] else ''}"
        "): converted to ours on the fly (tools/convert_checkpoint.py --from megatron does it once)",
        rank,
    )
    return None
