"""Which part of the sequence a context-parallel rank holds: one contiguous slice (ZeCO's layout,
not Megatron's zigzag). The data loader cuts the batch with it and the model's positions start
at its first token; nothing else computes it."""

from __future__ import annotations


def sequence_slice(seq_length: int, cp_rank: int, cp_size: int) -> slice:
    """Positions [start, stop) of the sequence CP rank `cp_rank` of `cp_size` holds."""
    length = seq_length // cp_size
    return slice(cp_rank * length, (cp_rank + 1) * length)
