"""Blends of several datasets (`--data-path 0.3 a 0.7 b`) and the per-split assembly.

Semantics follow Megatron: weights are normalized; each dataset of a blend is built with its
share of the requested samples plus 0.5%; sample t of the blend comes from the dataset whose
count lags its weight the most (greedy largest deficit), so after any N samples each dataset's
fraction is within 1/N of its weight. Without weights, one epoch of each dataset is blended in
proportion to its samples (Megatron's rule, sample for sample); asked for more, megatron-core's blend
falls short, and here that epoch's samples follow again, each further pass in its own order.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from megatron_zpp.data.gpt_dataset import (
    INDEX_FORMAT,
    SPLITS,
    GPTDataset,
    cache_paths,
    load_arrays,
    missing_cache_error,
    open_indexed,
    save_arrays,
    split_ranges,
)
from megatron_zpp.progress import progress

SURPLUS = 0.005  # Megatron's margin of extra samples built per blended dataset


def normalize(weights) -> list[float]:
    """Weights over their numpy float64 sum, as Megatron's: the greedy blend's ties hang on the last bit."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """['p'] or ['0.3', 'a', '0.7', 'b'] or ['a', 'b'] -> (prefixes, normalized weights or None)."""
    items = [s for s in (data_path or []) if s.strip()]
    if not items:
        raise ValueError("--data-path is empty: give PREFIX or W1 PREFIX1 W2 PREFIX2 ...")

    def number(s):
        try:
            return float(s)
        except ValueError:
            return None

    if number(items[0]) is not None:  # a weighted blend: every other item must be a weight
        bad = [w for w in items[::2] if number(w) is None or not math.isfinite(number(w))]
        if bad:
            raise ValueError(
                f"--data-path: weight {bad[0]!r} is not a finite number: weights and prefixes must alternate "
                "(W1 PREFIX1 W2 PREFIX2 ...)"
            )
        if len(items) % 2:
            raise ValueError(f"--data-path: weight {items[-1]!r} has no prefix after it (W1 PREFIX1 W2 PREFIX2 ...)")
    if len(items) % 2 == 0 and all(number(w) is not None for w in items[::2]):
        weights = [number(w) for w in items[::2]]
        prefixes = [p.strip() for p in items[1::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights {weights} must be non-negative with a positive sum")
        if not math.isfinite(sum(weights)):
            raise ValueError(
                f"--data-path weights {weights}: their sum overflows to inf (the blend normalizes by it); "
                "scale them down (only their ratios count)"
            )
        if any(number(p) is not None for p in prefixes):
            raise ValueError(f"--data-path {data_path}: expected W1 PREFIX1 W2 PREFIX2 ..., found a number as a prefix")
        return prefixes, normalize(weights)
    if any(number(s) is not None for s in items):
        raise ValueError(f"--data-path {data_path}: weights and prefixes must alternate (W1 PREFIX1 W2 PREFIX2 ...)")
    return [p.strip() for p in items], None


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy largest deficit: sample t goes to argmax_i (w_i * max(t, 1) - count_i).
    Returns (dataset id per sample, sample number within that dataset)."""
    n = len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * n
    w = [float(x) for x in weights]
    r = range(1, n)
    for t in progress(range(size), "blending index", unit=" samples", miniters=1 << 14):  # ~1 s per million
        tt = t if t > 0 else 1
        best, best_err = 0, w[0] * tt - counts[0]
        for i in r:
            err = w[i] * tt - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[t] = best
        sample_index[t] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in the proportions `weights` (normalized)."""

    ARRAYS = ("dataset_index", "dataset_sample_index")

    def __init__(self, datasets: list, weights: list[float], size: int, split: str, cache_dir: str, build: bool):
        self.datasets = datasets
        self.weights = normalize(weights)
        self.description = {
            "class": "BlendedDataset",
            "format": INDEX_FORMAT,
            "split": split,
            "size": int(size),
            "weights": self.weights,
            "datasets": [d.description for d in datasets],
        }
        paths = cache_paths(cache_dir, self.description, f"BlendedDataset-{split}", self.ARRAYS)
        arrays = load_arrays(paths)
        if arrays is None:
            if not build:
                raise missing_cache_error(paths)
            ids, samples = build_blending_indices(self.weights, size)
            counts = np.bincount(ids, minlength=len(datasets))
            for d, c in zip(datasets, counts):
                if c > len(d):
                    raise ValueError(f"blend needs {c} samples of {d.description['prefix']} but it has {len(d)}")
            arrays = {"dataset_index": ids, "dataset_sample_index": samples}
            save_arrays(paths, arrays, self.description)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self.repeated = ""  # how repeat_passes extended it, for the start-up line

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _split_dataset(prefix: str, split_id: int, fractions, num_samples, seq_length, seed, cache_dir, build, mmap_bin):
    indexed = open_indexed(prefix, mmap_bin)
    rng = split_ranges(fractions, len(indexed))[split_id]
    if rng is None:
        return None
    documents = np.arange(*rng, dtype=np.int64)
    if int(indexed.sequence_lengths[documents].sum(dtype=np.int64)) == 0:
        return None
    return GPTDataset(indexed, documents, SPLITS[split_id], num_samples, seq_length, seed, cache_dir, build)


def split_tokens(prefix: str, split_id: int, fractions) -> int:
    indexed = open_indexed(prefix)
    rng = split_ranges(fractions, len(indexed))[split_id]
    return 0 if rng is None else int(indexed.sequence_lengths[rng[0] : rng[1]].sum(dtype=np.int64))


def epoch_samples(prefix: str, split_id: int, fractions, seq_length: int) -> int:
    """Samples one epoch of the split makes (seq_length + 1 tokens each, one shared): Megatron's size of a dataset."""
    return max(0, split_tokens(prefix, split_id, fractions) - 1) // seq_length


def _blended_split(prefixes, weights, s, want, fractions, seq_length, seed, cache_dir, build, mmap_bin):
    """Split `s` of a blend, as Megatron's BlendedMegatronDatasetBuilder: weighted, each dataset built
    with ceil(ceil(want x weight) x (1 + SURPLUS)) samples and the blend `sum(ceil(want x weight))`
    long; unweighted, one epoch of each, blended in proportion to their samples (where `want` asks for
    more, Megatron's blend falls short; here that stream is followed by reshuffled passes of itself)."""
    raw = weights if weights is not None else [epoch_samples(p, s, fractions, seq_length) for p in prefixes]
    # A dataset with no documents in this split drops out and the others are renormalized.
    members = [(p, wi) for p, wi in zip(prefixes, raw) if wi > 0 and split_tokens(p, s, fractions) > 0]
    if not members:
        return None
    raw = [wi for _, wi in members]
    # Megatron normalizes a weighted blend's weights once more in BlendedDataset, not here.
    shares = raw if weights is not None and len(members) == len(prefixes) else normalize(raw)
    if weights is None and want > 0:  # Megatron's one epoch of each
        per, size = raw, min(want, sum(raw))
    else:
        used = [math.ceil(want * sh) for sh in shares]
        per = [math.ceil(n * (1 + SURPLUS)) for n in used]
        # Nothing requested: as many as fit without exhausting a dataset (greedy overshoots by < 1).
        size = sum(used) if want else None
    datasets = [
        _split_dataset(p, s, fractions, n, seq_length, seed, cache_dir, build, mmap_bin)
        for (p, _), n in zip(members, per)
    ]
    if size is None:
        size = max(0, int(min((len(d) - 1) / sh for d, sh in zip(datasets, shares))))
    blend_weights = raw if weights is None else shares  # Megatron's BlendedDataset gets the sizes themselves
    blend = BlendedDataset(datasets, blend_weights, size, SPLITS[s], cache_dir, build)
    if weights is None and want > size:
        repeat_passes(blend, want, seed)
    return blend


def repeat_passes(blend: BlendedDataset, want: int, seed: int) -> None:
    """An unweighted blend asked for more than its one epoch of each dataset (megatron-core's builder
    stops there): `blend`'s samples drawn again, each pass after the first in its own order (a permutation
    seeded by `seed` and the pass), until it holds `want`; the first pass stays megatron-core's stream."""
    n = len(blend)
    order = [np.arange(n)]
    for k in range(1, -(-want // n)):
        order.append(np.random.RandomState((seed + k) % 2**32).permutation(n))
    pick = np.concatenate(order)[:want]
    blend.dataset_index = blend.dataset_index[pick]
    blend.dataset_sample_index = blend.dataset_sample_index[pick]
    blend.repeated = f" ({want / n:.3g} passes of megatron-core's {n:,}-sample blend, reshuffled after the first)"


def build_split_datasets(prefixes, weights, fractions, seq_length, seed, num_samples, cache_dir, build, mmap_bin=True):
    """[train, valid, test] for one prefix or a blend; a split is None when no dataset has documents in it
    (`mmap_bin`: whether the .bin files are memory-mapped, IndexedDataset)."""
    for p in prefixes:
        for ext in (".idx", ".bin"):
            if not os.path.isfile(p + ext):
                from megatron_zpp.data.indexed_dataset import IndexedDatasetError

                raise IndexedDatasetError(f"{p + ext}: missing (from --data-path {p})")
    out = []
    for s in range(3):
        want = num_samples[s]
        if len(prefixes) == 1:
            out.append(_split_dataset(prefixes[0], s, fractions, want, seq_length, seed, cache_dir, build, mmap_bin))
            continue
        out.append(_blended_split(prefixes, weights, s, want, fractions, seq_length, seed, cache_dir, build, mmap_bin))
    return tuple(out)
