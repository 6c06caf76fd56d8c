"""Context (sequence) parallelism: each CP rank holds a contiguous slice of the sequence.

Gated linear attention (ZeCO, arXiv 2507.01004; gla.py): a slice's output is its local pass
from a zero state plus the correction of the state entering it, and that state is the
exclusive scan over ranks of (S_loc, gamma), done by one of

    "all-scan"    ZeCO's pipelined chain (all_scan.py): one state sent per rank, any P
    "all-gather"  LASP-2 (lasp2.py): every rank gathers all states: (P-1) states per rank
    "ring"        LASP-1 (ring.py): serial chain of whole states, latency P * tau(state)

while the local work runs (forward and backward). Softmax attention under CP
(attention.py) all-gathers K and V.
"""

from .all_scan import auto_blocks
from .attention import attention_context_parallel
from .gla import gla_context_parallel
from .scans import ALGOS, make_scan

__all__ = ["gla_context_parallel", "attention_context_parallel", "auto_blocks", "ALGOS", "make_scan"]
