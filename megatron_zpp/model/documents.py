"""Packed documents: which tokens of a micro-batch belong together (--reset-position-ids,
--reset-attention-mask; built from the EOD tokens by data/documents.py).

One small object goes through the model's forward: RoPE reads `positions`, softmax
attention masks keys of other documents (`doc_ids`: the block-diagonal causal mask is
built in context_parallel/attention.py), GLA resets its state at each document start
(`starts`). `doc_ids` covers the whole sequence, every CP slice, so a CP
rank knows the documents of the keys it gathers and whether a document starts inside
its own slice; it is [B, T] integers, never a [T, T] mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """positions [B, T_local]: RoPE positions of this rank's tokens (None: absolute, from `offset`);
    doc_ids [B, T]: per token of the whole sequence, its document's index in the sample (None:
    attention and state cross documents); offset: this rank's first token (its CP slice's start)."""

    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    offset: int = 0

    def to(self, device: torch.device, non_blocking: bool = False) -> Documents:
        """The same documents with their tensors on `device`."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Documents(move(self.positions), move(self.doc_ids), self.offset)

    @property
    def separate(self) -> bool:
        """Whether tokens see only their own document (--reset-attention-mask)."""
        return self.doc_ids is not None

    def starts(self, length: int) -> torch.Tensor:
        """[B, length] bool: this rank's tokens that begin a document after another one (the sequence's
        first token is not marked: nothing comes before it). A start on a CP slice's first token is
        marked too: the state arriving from the previous rank belongs to another document."""
        ids = self.doc_ids[:, max(self.offset - 1, 0) : self.offset + length]
        starts = ids[:, 1:] != ids[:, :-1]
        return starts if self.offset > 0 else torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1)
