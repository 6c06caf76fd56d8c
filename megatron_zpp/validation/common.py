"""What every section's checks share."""

from __future__ import annotations


def failed(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the checks that do not hold, in order."""
    return [msg for ok, msg in checks if not ok]
