"""The tests' name for the one multi-rank harness, megatron_zpp/testing/dist.py (the benches use it too,
and a script can import only the package)."""

from megatron_zpp.testing.dist import RankFailure, free_port, run_distributed

__all__ = ["RankFailure", "free_port", "run_distributed"]
