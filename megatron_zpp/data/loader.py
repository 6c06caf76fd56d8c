"""From datasets to this rank's micro-batches.

Sample order is Megatron's: a global batch of G sequences is consumed in rounds of
micro_batch x DP; in each round data-parallel rank d takes the d-th micro-batch. The
position is one number, `consumed_samples`, so a resumed run continues exactly. Within
a model replica: TP ranks read the same samples (each from the memory-mapped files,
which is cheaper than a broadcast), context-parallel rank c keeps the c-th contiguous
slice of every sequence, only the first pipeline stage keeps tokens and only the last
keeps labels. With packed documents (`Packing`: --reset-position-ids, --reset-attention-mask)
every stage reads its samples, since every layer needs the documents; each rank builds them,
and the --eod-mask-loss mask, from the whole sequence on its device (data/documents.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .documents import build_documents, eod_loss_mask


@dataclass(frozen=True)
class Packing:
    """Megatron's packed-document flags and the tokenizer's EOD id."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def every_stage(self) -> bool:
        """Whether every pipeline stage needs the batch (the documents), not only the ends."""
        return self.reset_position_ids or self.reset_attention_mask


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
    samples: list[np.ndarray],
    cp_rank: int,
    cp_size: int,
    keep_tokens: bool,
    keep_labels: bool,
    device: torch.device,
    packing: Packing | None = None,
) -> dict[str, torch.Tensor | None]:
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1], data[:, 1:]
    T = tokens.shape[1] // cp_size
    sl = slice(cp_rank * T, (cp_rank + 1) * T)
    batch = {
        "tokens": tokens[:, sl].contiguous().to(device) if keep_tokens else None,
        "labels": labels[:, sl].contiguous().to(device) if keep_labels else None,
        "position_offset": cp_rank * T,
    }
    if packing is not None:
        batch.update(packed_fields(tokens.to(device), packing, cp_rank * T, T, keep_labels))
    return batch


def packed_fields(tokens: torch.Tensor, packing: Packing, offset: int, length: int, keep_labels: bool) -> dict:
    """documents (for the model), and on the last stage the loss mask of this CP slice with
    loss_tokens, the micro-batch's unmasked tokens per CP rank: each rank's loss is its masked
    sum over loss_tokens, so their mean over CP is the masked mean of the whole micro-batch
    (Megatron's), with no communication: every rank sees every token's mask."""
    p = packing
    out = {"documents": build_documents(tokens, p.eod, p.reset_position_ids, p.reset_attention_mask, offset, length)}
    if p.eod_mask_loss and keep_labels:
        mask = eod_loss_mask(tokens, p.eod)
        out["loss_mask"] = mask[:, offset : offset + length].contiguous()
        out["loss_tokens"] = mask.sum().clamp_min(1.0) * length / tokens.shape[1]
    return out


class BatchIterator:
    """Yields this rank's micro-batches forever (until the dataset runs out)."""

    def __init__(
        self,
        dataset,
        consumed_samples: int,
        micro_batch_size: int,
        groups,
        device: torch.device,
        packing: Packing | None = None,
    ):
        self.dataset, self.groups, self.device, self.packing = dataset, groups, device, packing
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
        if not (keep_tokens or keep_labels or (self.packing is not None and self.packing.every_stage)):
            return {"tokens": None, "labels": None, "position_offset": 0}
        samples = [self.dataset[i] for i in indices]
        return make_batch(samples, g.cp_rank, g.cp.size, keep_tokens, keep_labels, self.device, self.packing)
