"""The token-id range of a .bin: the blocked scan against numpy's own min/max, and the start-up
check reading the content each time (a rewrite that keeps the size and mtime is still caught)."""

import os

import numpy as np

from megatron_zpp.data import token_range as tr
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter
from megatron_zpp.data.inputs import check_data_path


def test_blocked_scan_matches_numpy(monkeypatch):
    monkeypatch.setattr(tr, "SCAN_TOKENS", 1000)  # many blocks, the extremes in different ones
    rng = np.random.default_rng(0)
    signed = rng.integers(-5, 70_000, 10_001).astype(np.int32)
    assert tr.scan_range(signed) == (int(signed.min()), int(signed.max()))
    unsigned = rng.integers(3, 60_000, 4_321).astype(np.uint16)
    assert tr.scan_range(unsigned) == (0, int(unsigned.max()))  # an unsigned min is never below 0


def _pair(prefix, ids):
    w = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    w.add_document(ids)
    w.finalize(prefix + ".idx")


def test_a_rewrite_with_the_same_size_and_mtime_is_read_again(tmp_path):
    prefix = str(tmp_path / "a")
    _pair(prefix, [1, 9, 4, 99])
    assert check_data_path([prefix], 100) == []
    st = os.stat(prefix + ".bin")
    _pair(prefix, [1, 9, 4, 127])  # ids 100-127 sit in the padding rows of a 100-token vocabulary
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(prefix + ".bin").st_size == st.st_size
    (error,) = check_data_path([prefix], 100)
    assert f"token id 127 in {prefix}.bin is past the tokenizer's vocabulary of 100" in error
