"""The GPT model (softmax, GLA and hybrid layers) and its layout-independent init."""

from .context import ParallelContext
from .gpt import GPT, Block, GPTParts, describe_block
from .init import count_parameters, init_weights

__all__ = ["GPT", "GPTParts", "Block", "describe_block", "ParallelContext", "init_weights", "count_parameters"]
