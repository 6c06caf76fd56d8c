"""Every kernel test starts on the Triton kernels (the interpreter: tests/conftest.py sets
TRITON_INTERPRET=1) and leaves the process-wide mode as it found it; a test may switch to the
torch references in between. `count_calls` counts a kernel module's wrapper calls (which path ran)."""

import pytest
import torch

from megatron_zpp.ops import dispatch


@pytest.fixture(autouse=True)
def triton_kernels():
    dispatch.set_kernels("triton", torch.device("cpu"))
    yield
    dispatch.set_kernels("auto", torch.device("cpu"))


@pytest.fixture
def count_calls(monkeypatch):
    """count(module, names) -> {name: 0, ...}, each entry counting the calls of module.<name> from then on."""

    def count(module, names):
        calls = dict.fromkeys(names, 0)
        for name in names:
            original = getattr(module, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
        return calls

    return count
