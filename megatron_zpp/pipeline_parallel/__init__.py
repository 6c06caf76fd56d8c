"""Pipeline parallelism: schedules (no pipelining now; 1F1B and interleaved to come)."""
from .schedules import forward_backward_no_pipelining

__all__ = ["forward_backward_no_pipelining"]
