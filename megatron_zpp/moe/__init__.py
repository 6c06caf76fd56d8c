"""Mixture of experts on one rank: the top-k router, token permutation with capacity dropping, the
experts as stacked weights over a grouped GEMM, the shared expert and the MoE layer (docs/moe.md)."""
