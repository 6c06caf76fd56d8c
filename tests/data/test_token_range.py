"""The token-id range of a .bin: the blocked scan against numpy's own min/max, and its cache
(hit while the file's size and mtime hold, rescanned after a rewrite, skipped when unwritable)."""

import os

import numpy as np

from megatron_zpp.data import token_range as tr


def test_blocked_scan_matches_numpy(monkeypatch):
    monkeypatch.setattr(tr, "SCAN_TOKENS", 1000)  # many blocks, the extremes in different ones
    rng = np.random.default_rng(0)
    signed = rng.integers(-5, 70_000, 10_001).astype(np.int32)
    assert tr.scan_range(signed) == (int(signed.min()), int(signed.max()))
    unsigned = rng.integers(3, 60_000, 4_321).astype(np.uint16)
    assert tr.scan_range(unsigned) == (0, int(unsigned.max()))  # an unsigned min is never below 0


def _bin(path, ids):
    np.asarray(ids, np.uint16).tofile(path)
    return str(path), np.memmap(path, np.uint16, mode="r")


def test_cached_by_size_and_mtime_rescanned_after_a_rewrite(tmp_path, monkeypatch):
    path, tokens = _bin(tmp_path / "a.bin", [1, 9, 4])
    cache = str(tmp_path / "cache")
    assert tr.token_range(path, tokens, cache) == (0, 9)
    monkeypatch.setattr(tr, "scan_range", lambda t: (_ for _ in ()).throw(AssertionError("scanned again")))
    assert tr.token_range(path, tokens, cache) == (0, 9)  # from the cache
    monkeypatch.undo()
    path, tokens = _bin(tmp_path / "a.bin", [1, 700, 4])  # same size, new contents
    os.utime(path, ns=(1, 1))  # a different mtime (the rewrite may fall in the same clock tick)
    assert tr.token_range(path, tokens, cache) == (0, 700)


def test_unwritable_cache_directory_still_scans(tmp_path):
    path, tokens = _bin(tmp_path / "a.bin", [3, 2])
    blocker = tmp_path / "file"
    blocker.write_text("")  # a cache directory that cannot be created
    assert tr.token_range(path, tokens, str(blocker / "cache")) == (0, 3)
