"""Progress bars for long tools: one line each, `progress(items, "merging", total, unit)`.

A tqdm bar (count, rate, elapsed and remaining time) on rank 0 when its stream (stderr) is a
terminal; otherwise the iterable itself, untouched, so logs and CI output stay clean and the
other ranks stay silent. Without an iterable it returns a bar to `update()` by hand (a
disabled one when off: the same calls do nothing).
"""

from __future__ import annotations

import os
import sys


def enabled(file=None) -> bool:
    """Whether bars are shown: rank 0 (RANK unset counts as 0), and `file` (stderr) is a TTY."""
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return int(os.environ.get("RANK", "0")) == 0 and bool(isatty and isatty())


def progress(iterable=None, desc: str = "", total: float | None = None, unit: str = "it", file=None, **kw):
    """`iterable` wrapped in a tqdm bar when `enabled(file)`, else `iterable` itself.

    unit="B" scales the counts (kB, MB, ...); kw go to tqdm (e.g. unit_scale, mininterval)."""
    off = kw.pop("disable", False)  # the caller's own switch (e.g. --quiet)
    on = enabled(file) and not off
    if iterable is not None and not on:
        return iterable
    from tqdm import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    kw.setdefault("unit_scale", unit == "B")
    kw.setdefault("mininterval", 0.5)
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        file=file if file is not None else sys.stderr,
        disable=not on,
        dynamic_ncols=True,
        **kw,
    )
