"""Synthetic but learnable token sequences, for runs without a corpus (--mock-data).

Sample i is a random motif of 4..16 tokens repeated to fill the sequence, drawn from a
generator seeded by (seed, i): identical for every layout and run. Tokens follow a
Zipf law, so a model first learns their frequencies, then to copy the motif (the
induction behaviour real text rewards): the loss keeps falling for a long time."""

from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        motif = np.minimum(rng.zipf(1.3, size=int(rng.integers(4, 17))) - 1, self.vocab_size - 2)
        reps = (self.seq_length + 1) // len(motif) + 1
        start = int(rng.integers(0, len(motif)))
        return np.tile(motif, reps + 1)[start : start + self.seq_length + 1].astype(np.int64)
