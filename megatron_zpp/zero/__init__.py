"""Data parallelism: plain (stage 0) and ZeRO-1/2/3 with ZeRO++ (qwZ, hpZ, qgZ) and
multi-level hierarchical partitioning, over the DP x CP group of the topology."""
from .grad_buffer import GradBuffer
from .grad_reduce import hierarchical_reduce_scatter
from .optimizer import PlainDP, ZeroDP
from .quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

__all__ = ["GradBuffer", "PlainDP", "ZeroDP", "hierarchical_reduce_scatter", "quantize_int8", "dequantize_int8",
           "quantize_int4", "dequantize_int4"]
