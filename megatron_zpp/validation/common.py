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
