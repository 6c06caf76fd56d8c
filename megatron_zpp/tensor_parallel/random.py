"""RNG streams for dropout under tensor parallelism (Megatron's RNG tracker), and the micro-batch whose
sample positions key the default layout-invariant dropout masks (model/dropout.py; these streams serve
--dropout-masks per-rank and layers run outside the training schedule).

Activations replicated over TP (the residual stream without sequence parallelism) must
drop the same elements on every TP rank: they use the default generator, seeded alike
on all TP ranks. Activations split over TP (attention heads, sequence-parallel shards)
must drop independent elements: they run inside `model_parallel_rng()`, a generator
seeded differently per TP rank."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

_STATE: dict = {}
# the micro-batch the model runs now: its samples' positions in the sample stream, keys of the layout-invariant
# dropout masks (model/dropout.py); part of the tracker state, so a recompute rerun sees its own micro-batch
_MICRO_BATCH: dict = {"samples": None, "seed": 0}


def seed_parallel_rng(seed: int, tp_rank: int, pp_rank: int, cp_rank: int, device: torch.device) -> None:
    """Default stream: same on the TP ranks of a stage; model-parallel stream: per TP rank."""
    default_seed = seed + 100 * pp_rank + 1000 * cp_rank
    _MICRO_BATCH["seed"] = seed
    torch.manual_seed(default_seed)
    random.seed(default_seed)  # Python's and numpy's global generators too: identical runs, identical checkpoints
    np.random.seed(default_seed % 2**32)
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        torch.manual_seed(default_seed + 2718 + tp_rank)
        _STATE.update(device=device, cpu=torch.get_rng_state(), dev=_device_state(device))


def _device_state(device: torch.device):
    return None if device.type == "cpu" else torch.get_device_module(device).get_rng_state(device)


@contextlib.contextmanager
def model_parallel_rng():
    """Run the body on the per-TP-rank stream (a no-op before seed_parallel_rng)."""
    if not _STATE:
        yield
        return
    device = _STATE["device"]
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        torch.set_rng_state(_STATE["cpu"])
        if device.type != "cpu":
            torch.get_device_module(device).set_rng_state(_STATE["dev"], device)
        try:
            yield
        finally:
            _STATE["cpu"], _STATE["dev"] = torch.get_rng_state(), _device_state(device)


def tracker_state() -> dict:
    """A copy of the per-TP-rank stream's state and the micro-batch (activation recompute replays from it)."""
    return {"streams": dict(_STATE), "micro_batch": dict(_MICRO_BATCH)}


def set_tracker_state(state: dict) -> None:
    _STATE.clear()
    _STATE.update(state["streams"])
    _MICRO_BATCH.update(state["micro_batch"])


@contextlib.contextmanager
def micro_batch(samples: torch.Tensor | None):
    """Run the body (one micro-batch's forward) with its samples' positions [B] as the dropout masks' keys."""
    outside = _MICRO_BATCH["samples"]
    _MICRO_BATCH["samples"] = samples
    try:
        yield
    finally:
        _MICRO_BATCH["samples"] = outside


def micro_batch_samples() -> torch.Tensor | None:
    return _MICRO_BATCH["samples"]


def dropout_seed() -> int:
    """--seed (0 before seed_parallel_rng)."""
    return _MICRO_BATCH["seed"]


class ShardedDropout(torch.nn.Dropout):
    """Dropout on activations that differ across TP ranks (e.g. sequence-parallel shards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with model_parallel_rng():
            return super().forward(x)
