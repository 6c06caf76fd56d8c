"""Megatron tensor parallelism: sharded linears and embedding, vocab-parallel loss."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, enter_tp_region, shard, unshard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "enter_tp_region",
    "shard",
    "unshard",
]
