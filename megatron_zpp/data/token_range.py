"""The smallest and largest token id of a `.bin`, by one vectorised pass over its memory map,
cached by the file's size and mtime in the index cache directory (--data-cache-path, else
`cache/` beside the first --data-path prefix, as the dataset indices): the check that every
token of the corpus fits the vocabulary (inputs.py) costs one read of the data, once.

A cache that cannot be written (a read-only mount) is not an error: the scan then runs each time."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

SCAN_TOKENS = 1 << 26  # tokens per vectorised min/max (128 MiB of uint16): bounded memory, full speed


def index_cache_dir(first_prefix: str, cache_path: str | None) -> str:
    """Where the dataset indices (and the token ranges) are cached: --data-cache-path, else
    `cache/` beside the first --data-path prefix."""
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


def _cache_file(bin_file: str, cache_dir: str) -> str:
    tag = hashlib.sha1(os.path.abspath(bin_file).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"token_range-{os.path.basename(bin_file)}-{tag}.json")


def _stamp(bin_file: str, tokens: np.ndarray) -> dict:
    st = os.stat(bin_file)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": tokens.dtype.name, "tokens": len(tokens)}


def token_range(bin_file: str, tokens: np.ndarray, cache_dir: str | None) -> tuple[int, int]:
    """(min, max) token id of `tokens` (the memory map of `bin_file`): from the cache when the file's
    size and mtime still match, else scanned (and cached when `cache_dir` is writable)."""
    stamp = _stamp(bin_file, tokens)
    path = _cache_file(bin_file, cache_dir) if cache_dir else None
    cached = _read_cached(path, stamp) if path else None
    if cached is not None:
        return cached
    low, high = scan_range(tokens)
    if path:
        _write_cached(path, {**stamp, "min": low, "max": high})
    return low, high


def _read_cached(path: str, stamp: dict) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            entry = json.load(f)
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()):
            return int(entry["min"]), int(entry["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, damaged or stale: scan again
    return None


def _write_cached(path: str, entry: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks check their inputs at once: each renames its own
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the next run scans again
