"""The one entry point of training's data: the train/valid/test datasets of a --data-path
blend and a --split, built on one rank and loaded by the others (gpt_dataset.py holds
the dataset, blended.py the blend)."""

from __future__ import annotations

import re
from collections.abc import Callable

from .blended import BlendedDataset, build_split_datasets, parse_data_path
from .gpt_dataset import SPLITS
from .token_range import index_cache_dir


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalized [train, valid, test] fractions (missing ones are 0).

    As Megatron (re.findall of the numbers), so "99,1,0", "99/1/0" and the quoted "'99,1,0'" that
    Megatron's own scripts pass all read 99, 1, 0; any other character (a sign, a letter) is refused."""
    if re.search(r"[^0-9.,/\s'\"]", split):
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers like 969,30,1")
    try:
        parts = [float(s) for s in re.findall(r"[.0-9]+", split)]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three numbers like 969,30,1") from None
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers like 969,30,1")
    if sum(parts) <= 0:
        raise ValueError(f"--split {split!r} gives the training set no documents: its first number must be > 0")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_path: str | None,
    is_builder: bool,
    barrier: Callable[[], None],
    mmap_bin: bool = True,
):
    """(train, valid, test) datasets, each None when its split has no documents (their .bin files
    memory-mapped, or read sample by sample without `mmap_bin`: --no-mmap-bin-files).

    The builder rank builds (or finds) every cached index, then calls barrier(); the other ranks
    call barrier() and then load. Every rank calls barrier() exactly once, even on error, so a
    failure raises on all ranks instead of hanging some.
    """
    prefixes, weights = parse_data_path(data_path)
    cache_dir = index_cache_dir(prefixes[0], cache_path)
    fractions = parse_split(split)
    args = (prefixes, weights, fractions, seq_length, seed, tuple(int(n) for n in num_samples), cache_dir)
    result, error = None, None
    if is_builder:
        try:
            result = build_split_datasets(*args, build=True, mmap_bin=mmap_bin)
        except Exception as e:  # re-raised after the barrier so no rank waits forever
            error = e
    barrier()
    if error is not None:
        raise error
    if not is_builder:
        result = build_split_datasets(*args, build=False, mmap_bin=mmap_bin)
    return result


def describe_splits(datasets, split: str, seq_length: int) -> list[str]:
    """One line per split, as the start-up log gives them: its samples, then each dataset of it
    (blend weight, prefix, documents, tokens, samples used of those built, epochs)."""
    lines = []
    for name, ds in zip(SPLITS, datasets):
        if ds is None:
            lines.append(f"data {name}: none (--split {split} leaves it no documents)")
            continue
        members = zip(ds.weights, ds.datasets) if isinstance(ds, BlendedDataset) else [(None, ds)]
        sources = " + ".join(d.summary() if w is None else f"{w:.4g} x {d.summary()}" for w, d in members)
        again = getattr(ds, "repeated", "")  # an unweighted blend past one epoch of it
        lines.append(
            f"data {name}: {len(ds):,} samples{again} of {seq_length}+1 tokens from {sources}; --split {split}"
        )
    return lines
