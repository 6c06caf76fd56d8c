"""Triton kernels, one module per op family; no logic beyond the kernels and their launch wrappers.

Every kernel has a PyTorch reference in megatron_zpp/ops/ that runs on CPU, a test against it under
TRITON_INTERPRET=1 (tests/kernels/), and dispatch in megatron_zpp/ops/ (ops/dispatch.py: --kernels)
that picks the kernel or the reference. Importing a submodule imports triton, so only the dispatch
imports them, and only once it has decided Triton runs.

Here rather than in a top-level kernels/ folder: a top-level package named `kernels` would collide
with the Hugging Face `kernels` distribution and need a second installed package.
"""
