"""Set for every test and every rank it spawns (megatron_zpp/testing/dist.py: ranks take the caller's
environment). The repository root is on sys.path through pytest's `pythonpath` option (pyproject.toml),
which the spawned ranks inherit, so they import the same code."""

import os

# Triton kernels run in Triton's CPU interpreter in tests (tests/kernels/): the variable must be set
# before triton is imported (fla imports it too), so it is set here, first, for every test and rank.
os.environ.setdefault("TRITON_INTERPRET", "1")
