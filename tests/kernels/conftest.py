"""Every kernel test starts on the Triton kernels (the interpreter: tests/conftest.py sets
TRITON_INTERPRET=1) and leaves the process-wide mode as it found it; a test may switch to the
torch references in between."""

import pytest
import torch

from megatron_zpp.ops import dispatch


@pytest.fixture(autouse=True)
def triton_kernels():
    dispatch.set_kernels("triton", torch.device("cpu"))
    yield
    dispatch.set_kernels("auto", torch.device("cpu"))
