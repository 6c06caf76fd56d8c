"""Data parallelism: plain (stage 0) now; ZeRO-1/2/3 and ZeRO++ build on the same buffer."""
from .grad_buffer import GradBuffer

__all__ = ["GradBuffer"]
