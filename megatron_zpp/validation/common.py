"""What every section's checks share."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def failed(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the checks that do not hold, in order."""
    return [msg for ok, msg in checks if not ok]


def derived(value: T | None) -> T:
    """A setting that derive() has filled (global batch, train iterations, max positions, GLA chunk)."""
    assert value is not None, "read before validation.derive filled it"
    return value


def launch_device_type(device: str) -> str:
    """--device as a launch resolves it (training/distributed.py): auto is cuda when CUDA is available."""
    if device != "auto":
        return device
    import torch  # only a launch's checks read the machine

    return "cuda" if torch.cuda.is_available() else "cpu"
