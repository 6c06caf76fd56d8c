"""The smallest and largest token id of a `.bin`, by one vectorised pass over its memory map on
every start: the check that every token of the corpus fits the vocabulary (inputs.py) reads the
content itself, never a cache keyed by the file's size and mtime (a file rewritten with the same
size and mtime would pass on a stale range).

Why no content-keyed cache either: validating one costs a full read plus a hash, and the hash is
the slower part. On a 100 MB uint16 file in the page cache (docs/data.md): the min/max scan takes
7 ms, sha256 of the same bytes 75 ms, crc32 26 ms; from the disk both are bound by the same read."""

from __future__ import annotations

import os

import numpy as np

SCAN_TOKENS = 1 << 26  # tokens per vectorised min/max (128 MiB of uint16): bounded memory, full speed


def index_cache_dir(first_prefix: str, cache_path: str | None) -> str:
    """Where the dataset indices are cached: --data-cache-path, else `cache/` beside the first
    --data-path prefix."""
    return cache_path or os.path.join(os.path.dirname(os.path.abspath(first_prefix)), "cache")


def scan_range(tokens: np.ndarray) -> tuple[int, int]:
    """(min, max) of `tokens` (non-empty), SCAN_TOKENS at a time; the min of an unsigned dtype is not read."""
    low, high = (0 if tokens.dtype.kind == "u" else None), None
    for start in range(0, len(tokens), SCAN_TOKENS):
        block = tokens[start : start + SCAN_TOKENS]
        high = int(block.max()) if high is None else max(high, int(block.max()))
        if tokens.dtype.kind != "u":
            low = int(block.min()) if low is None else min(low, int(block.min()))
    return low, high
