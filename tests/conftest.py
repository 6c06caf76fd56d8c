"""Set for every test and every rank it spawns (megatron_zpp/testing/dist.py: ranks take the caller's
environment). The repository root is on sys.path through pytest's `pythonpath` option (pyproject.toml),
which the spawned ranks inherit, so they import the same code."""

import os

# Triton kernels run in Triton's CPU interpreter in tests (tests/kernels/): the variable must be set
# before triton is imported (fla imports it too), so it is set here, first, for every test and rank.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _denormals_as_torch_starts():
    """A CPU training run flushes subnormal floats for its whole process (training/distributed.py); tests that
    set one up in pytest's process must not leave it so for the next test (torch starts with them kept)."""
    yield
    torch.set_flush_denormal(False)
