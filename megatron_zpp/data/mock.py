"""Synthetic but learnable token sequences, for runs without a corpus (--mock-data).

Sample i is a random motif of 4..16 tokens repeated to fill the sequence, drawn from a
generator seeded by (seed, i): identical for every layout and run. Tokens follow a
Zipf law, so a model first learns their frequencies, then to copy the motif (the
induction behaviour real text rewards): the loss keeps falling for a long time.

With `eod` (the packed-document flags are set) a sample is instead a run of documents,
each its own motif repeated over 8..seq/2+8 tokens and ended by the EOD token (the last
one cut at the sample's end), so that the document flags have boundaries to act on."""

from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, eod: int | None = None):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        self.eod = eod

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        n = self.seq_length + 1
        if self.eod is None:
            return self._motif_run(rng, n)
        docs, total = [], 0
        while total < n:
            length = int(rng.integers(8, self.seq_length // 2 + 9))  # with its EOD
            docs.append(np.append(self._motif_run(rng, length - 1), self.eod))
            total += length
        return np.concatenate(docs)[:n].astype(np.int64)

    def _motif_run(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n tokens: a random motif repeated from a random phase (tokens < vocab - 1: never the EOD)."""
        motif = np.minimum(rng.zipf(1.3, size=int(rng.integers(4, 17))) - 1, self.vocab_size - 2)
        reps = n // len(motif) + 1
        start = int(rng.integers(0, len(motif)))
        return np.tile(motif, reps + 1)[start : start + n].astype(np.int64)
