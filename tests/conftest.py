"""Make the repository root importable (the package is not installed in the venv).

Spawned ranks (tests/dist.py) inherit this sys.path, so they import the same code."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Triton kernels run in Triton's CPU interpreter in tests (tests/kernels/): the variable must be set
# before triton is imported (fla imports it too), so it is set here, first, for every test and rank.
os.environ.setdefault("TRITON_INTERPRET", "1")
