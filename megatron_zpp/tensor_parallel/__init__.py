"""Megatron tensor parallelism: sharded linears and embedding, vocab-parallel loss."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_product,
    shard,
    unshard,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "column_parallel_product",
    "shard",
    "unshard",
]
