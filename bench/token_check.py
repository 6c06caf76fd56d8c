"""The every-token vocabulary check (data/token_range.py) against the disk and a plain read.

    .venv/bin/python bench/token_check.py FILE.bin [FILE.bin ...]   (uint16 token files)

Per file: the scan of its memory map cold (its pages dropped with posix_fadvise(DONTNEED) first,
so it reads the disk) and warm (in the page cache), and, as the peer, numpy's max of the same
memory map warm: the ratio says what the blocked scan costs over one vectorised pass."""

import os
import sys
import time

import numpy as np

from megatron_zpp.data.token_range import scan_range


def drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(paths: list[str]) -> None:
    for path in paths:
        tokens = np.memmap(path, np.uint16, mode="r")
        gb = os.path.getsize(path) / 1e9
        drop_pages(path)
        cold = timed(lambda: scan_range(tokens))
        warm = min(timed(lambda: scan_range(tokens)) for _ in range(3))
        peer = min(timed(lambda: tokens.max()) for _ in range(3))
        print(
            f"{path}: {gb:.3f} GB, {len(tokens):,} tokens | cold {cold:.3f} s ({gb / cold:.2f} GB/s) | "
            f"warm {warm:.4f} s ({gb / warm:.2f} GB/s) | numpy max warm {peer:.4f} s | ours/peer {warm / peer:.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
