"""Mixture of experts: the top-k router, token permutation with capacity dropping, the experts (one parameter
per expert) over a grouped GEMM, the shared expert, the token dispatchers across expert-parallel ranks and the
MoE layer (docs/moe.md)."""
