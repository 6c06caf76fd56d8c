"""What the launch wrappers tune for: the device of their tensors, or a GPU named by the ahead-of-time
compile check (megatron_zpp/testing/triton_aot.py), which drives the real wrappers with meta tensors on
a machine with no GPU and must see the block sizes, warps and stages that a CUDA launch would get."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    """The facts a wrapper's tuning reads from a GPU."""

    capability: tuple[int, int]
    sm_count: int


# A compile check's stand-in device, by compute capability: SM counts of an A100 SXM and an H100/H200 SXM.
STAND_INS = {80: GPU((8, 0), 108), 90: GPU((9, 0), 132)}
_stand_in: GPU | None = None


def gpu(device: torch.device) -> GPU | None:
    """The GPU a launch on `device` is tuned for; None on a CPU (the interpreter's tuning)."""
    if _stand_in is not None:
        return _stand_in
    if device.type != "cuda":
        return None
    props = torch.get_device_module(device).get_device_properties(device)
    return GPU((props.major, props.minor), props.multi_processor_count)


@contextlib.contextmanager
def tuned_for(arch: int) -> Iterator[GPU]:
    """Within the block, every wrapper tunes as on a GPU of compute capability `arch` (80, 90)."""
    global _stand_in
    previous, _stand_in = _stand_in, STAND_INS[arch]
    try:
        yield _stand_in
    finally:
        _stand_in = previous
