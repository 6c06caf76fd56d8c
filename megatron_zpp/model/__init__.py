"""The GPT model (softmax, GLA and hybrid layers) and its layout-independent init."""

from .context import ParallelContext
from .gpt import GPT, Block
from .init import count_parameters, init_weights

__all__ = ["GPT", "Block", "ParallelContext", "init_weights", "count_parameters"]
