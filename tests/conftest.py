"""Make the repository root importable (the package is not installed in the venv).

Spawned ranks (tests/dist.py) inherit this sys.path, so they import the same code."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
