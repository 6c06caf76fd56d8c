"""GPTDataset with Megatron's semantics (data/builder.py assembles the datasets training uses).

A split of an indexed dataset (a contiguous range of its documents) becomes fixed-length samples,
in Megatron-core's order (megatron/core/datasets/gpt_dataset.py, GPTDataset), sample for sample:
  document index  the split's documents repeated once per epoch and shuffled all together; when the
                  last epoch is mostly unused (its samples < 80% of an epoch's), the earlier epochs
                  are shuffled together and the last one apart, so full epochs are consumed first;
  sample index    row i = (position in the document index, token offset) where sample i starts;
                  sample i runs to row i+1 inclusive, so consecutive samples share one token
                  (the last label of one is the first input of the next) and each token of the
                  document index is an input once;
  shuffle index   a permutation of the samples (the samples of a separated last epoch permuted
                  apart, after the others).
One numpy RandomState seeded with the seed draws the document index, then the shuffle index.
The three arrays are cached as .npy named by a hash of everything they depend on, built on one
rank and loaded by the others after a barrier.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import torch

from megatron_zpp.data.indexed_dataset import IndexedDataset, IndexedDatasetError, idx_path

SPLITS = ("train", "valid", "test")
SEPARATE_LAST_EPOCH_BELOW = 0.80  # Megatron's threshold for shuffling a short last epoch on its own
INDEX_FORMAT = 2  # bump when the meaning of the cached arrays changes (2: Megatron's multi-epoch order)


# ---------------------------------------------------------------- cache of index arrays
def config_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def cache_paths(cache_dir: str, description: dict, kind: str, names: tuple[str, ...]) -> dict:
    h = config_hash(description)
    return {n: os.path.join(cache_dir, f"{h}-{kind}-{n}.npy") for n in names}


def _file_stamp(path: str) -> str:
    """sha256 of the file's content, not its size and mtime (a rewrite may keep both): the .idx is
    small (about 24 bytes a document), so this costs about 20 ms per million documents."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def save_arrays(paths: dict, arrays: dict, description: dict) -> None:
    """Write each array under a temporary name and rename: a reader never sees half a file.
    A cache directory that cannot be written is an IndexedDatasetError naming it and the fix."""
    cache_dir = os.path.dirname(next(iter(paths.values())))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            tmp = f"{path}.tmp{os.getpid()}.npy"
            np.save(tmp, arrays[name])
            os.replace(tmp, path)
        with open(next(iter(paths.values())).rsplit("-", 1)[0] + "-description.json", "w") as f:
            json.dump(description, f, indent=1, sort_keys=True)
    except OSError as e:
        raise IndexedDatasetError(
            f"cannot write the dataset index cache in {cache_dir} ({e.strerror or e}): "
            "give a writable --data-cache-path"
        ) from None


def load_arrays(paths: dict) -> dict | None:
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


def missing_cache_error(paths: dict) -> IndexedDatasetError:
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    return IndexedDatasetError(
        f"{missing[0]}: index cache missing on a non-builder rank; the builder rank "
        "failed or writes to a different --data-cache-path (it must be shared)"
    )


# ---------------------------------------------------------------- index construction
def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens make num_samples samples of seq_length + 1 (one shared)."""
    if tokens_per_epoch <= 0:
        raise ValueError("split has no tokens")
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def samples_before_final_epoch(tokens_per_epoch: int, num_epochs: int, seq_length: int) -> int:
    """Samples the first num_epochs - 1 epochs make (each takes seq_length + 1 tokens, one shared)."""
    return ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length


def separate_final_epoch(num_samples: int, tokens_per_epoch: int, num_epochs: int, seq_length: int) -> bool:
    """Megatron's rule: the last epoch is kept apart when it supplies < 80% of an epoch's samples."""
    if num_epochs == 1:
        return False
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - samples_before_final_epoch(tokens_per_epoch, num_epochs, seq_length) < int(
        SEPARATE_LAST_EPOCH_BELOW * per_epoch
    )


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The documents once per epoch, shuffled together; with `separate_final`, the first
    num_epochs - 1 epochs shuffled together, then the last epoch shuffled on its own."""
    if separate_final and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate([head, build_document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Rows (position in document_index, offset); sample i starts at stream token i*seq_length."""
    doc_sizes = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    num_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # skips empty documents
    offset = starts - (ends[position] - doc_sizes[position])
    fits = len(document_index) < 2**31 and doc_sizes.max(initial=0) < 2**31
    return np.stack([position, offset], axis=1).astype(np.int32 if fits else np.int64)


def build_shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of range(total): [0, first) shuffled, then [first, total) shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length + 1` tokens over `documents` (sequence ids) of one indexed dataset."""

    ARRAYS = ("document_index", "sample_index", "shuffle_index")

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        split: str,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str,
        build: bool,
    ):
        self.indexed, self.seq_length = indexed, seq_length
        self.description = {
            "class": "GPTDataset",
            "format": INDEX_FORMAT,
            "prefix": os.path.abspath(indexed.prefix),
            "index_sequences": len(indexed),
            "index_tokens": indexed.num_tokens,
            # the .idx as written: a re-preprocessing into the same prefix never reuses a stale cache
            "index_file": _file_stamp(idx_path(indexed.prefix)),
            "split": split,
            "documents": [int(documents[0]), int(documents[-1]) + 1],
            "seq_length": seq_length,
            "seed": seed,
            "num_samples": int(num_samples),
        }
        paths = cache_paths(cache_dir, self.description, f"GPTDataset-{split}", self.ARRAYS)
        arrays = load_arrays(paths)
        if arrays is None:
            if not build:
                raise missing_cache_error(paths)
            arrays = self._build(documents, num_samples, seed)
            save_arrays(paths, arrays, self.description)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _build(self, documents: np.ndarray, num_samples: int, seed: int) -> dict:
        sizes = self.indexed.sequence_lengths
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        if tokens_per_epoch <= self.seq_length and num_samples == 0:
            num_samples = 1
        epochs = num_epochs_for(tokens_per_epoch, self.seq_length, num_samples)
        separate = separate_final_epoch(num_samples, tokens_per_epoch, epochs, self.seq_length)
        rng = np.random.RandomState(seed)  # as Megatron: one stream, documents first, then samples
        document_index = build_document_index(documents, epochs, rng, separate)
        sample_index = build_sample_index(sizes, document_index, self.seq_length)
        total = len(sample_index) - 1
        first = samples_before_final_epoch(tokens_per_epoch, epochs, self.seq_length) if separate else total
        shuffle_index = build_shuffle_index(first, total, rng)
        return dict(document_index=document_index, sample_index=sample_index, shuffle_index=shuffle_index)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def summary(self) -> str:
        """Its prefix, documents, tokens, samples used of those built, epochs (the start-up data line)."""
        beg, end = self.description["documents"]
        tokens = int(self.indexed.sequence_lengths[beg:end].sum(dtype=np.int64))
        epochs = len(self.document_index) // (end - beg)
        asked = self.description["num_samples"]
        apart = separate_final_epoch(asked, tokens, epochs, self.seq_length)
        return (
            f"{self.indexed.prefix} (documents {beg}:{end} of {len(self.indexed)}, {tokens:,} tokens, "
            f"{asked:,} of {len(self):,} samples, {epochs} epoch{'s' if epochs > 1 else ''}"
            f"{', the last shuffled apart' if apart else ''})"
        )

    def __getitem__(self, i) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        doc = self.document_index
        if d0 == d1:
            return self.indexed.get(int(doc[d0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        parts = [self.indexed.get(int(doc[d0]), int(o0))]
        parts += [self.indexed.get(int(doc[d])) for d in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(doc[d1]), 0, int(o1) + 1))
        return np.concatenate(parts).astype(np.int64)


# ---------------------------------------------------------------- splits
def split_ranges(fractions: list[float], num_documents: int) -> list[tuple[int, int] | None]:
    """Contiguous document ranges per split, bookends rounded as Megatron does; None when empty."""
    bounds = np.concatenate([[0.0], np.cumsum(fractions)])
    out = []
    for i in range(3):
        beg, end = int(round(bounds[i] * num_documents)), int(round(bounds[i + 1] * num_documents))
        out.append((beg, end) if fractions[i] > 0 and end > beg else None)
    return out


def open_indexed(prefix: str, mmap_bin: bool = True) -> IndexedDataset:
    return IndexedDataset(prefix, mmap_bin)
