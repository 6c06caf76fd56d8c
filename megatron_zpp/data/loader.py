"""From datasets to this rank's micro-batches.

Sample order is Megatron's: a global batch of G sequences is consumed in rounds of
micro_batch x DP; in each round data-parallel rank d takes the d-th micro-batch. The
position is one number, `consumed_samples`, so a resumed run continues exactly. Within
a model replica: TP ranks read the same samples (each from the memory-mapped files,
which is cheaper than a broadcast), context-parallel rank c keeps the c-th contiguous
slice of every sequence, only the first pipeline stage keeps tokens and only the last
keeps labels.
"""

from __future__ import annotations

import numpy as np
import torch


class MicroBatchSampler:
    """Index lists of one micro-batch for one DP rank, from `consumed_samples` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        round_size = self.mbs * self.dp_size
        start = self.consumed
        while start + round_size <= self.total:
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += round_size


def make_batch(
    samples: list[np.ndarray], cp_rank: int, cp_size: int, keep_tokens: bool, keep_labels: bool, device: torch.device
) -> dict[str, torch.Tensor | None]:
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1], data[:, 1:]
    T = tokens.shape[1] // cp_size
    sl = slice(cp_rank * T, (cp_rank + 1) * T)
    return {
        "tokens": tokens[:, sl].contiguous().to(device) if keep_tokens else None,
        "labels": labels[:, sl].contiguous().to(device) if keep_labels else None,
        "position_offset": cp_rank * T,
    }


class BatchIterator:
    """Yields this rank's micro-batches forever (until the dataset runs out)."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, groups, device: torch.device):
        self.dataset, self.groups, self.device = dataset, groups, device
        self.sampler = MicroBatchSampler(
            len(dataset), consumed_samples, micro_batch_size, groups.dp_rank, groups.dp.size
        )
        self._it = iter(self.sampler)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        indices = next(self._it)
        g = self.groups
        keep_tokens, keep_labels = g.is_first_stage, g.is_last_stage
        samples = (
            [self.dataset[i] for i in indices]
            if (keep_tokens or keep_labels)
            else [np.zeros(1, dtype=np.int64)] * len(indices)
        )
        if not (keep_tokens or keep_labels):
            return {"tokens": None, "labels": None, "position_offset": 0}
        return make_batch(samples, g.cp_rank, g.cp.size, keep_tokens, keep_labels, self.device)
