"""--kernels: the mode is refused where Triton cannot run, and auto picks the reference on CPU."""

import pytest
import torch

from megatron_zpp.ops import dispatch


@pytest.fixture(autouse=True)
def restore_mode():
    yield
    dispatch.set_kernels("auto", torch.device("cpu"))


def test_auto_on_cpu_runs_the_reference():
    dispatch.set_kernels("auto", torch.device("cpu"))
    assert not dispatch.use_triton(torch.zeros(1))
    assert "torch references (auto takes Triton on CUDA only)" in dispatch.describe(torch.device("cpu"))


def test_triton_under_the_interpreter_runs_the_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.set_kernels("triton", torch.device("cpu"))
    assert dispatch.use_triton(torch.zeros(1))
    assert "Triton interpreter kernels" in dispatch.describe(torch.device("cpu"))


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(dispatch.KernelUnavailable, match="--kernels triton: device cpu"):
        dispatch.set_kernels("triton", torch.device("cpu"))


def test_triton_missing_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_importable", lambda: "triton is not installed")
    with pytest.raises(dispatch.KernelUnavailable, match="triton is not installed"):
        dispatch.set_kernels("triton", torch.device("cpu"))
    dispatch.set_kernels("auto", torch.device("cpu"))
    assert not dispatch.use_triton(torch.zeros(1))


def test_torch_mode_never_runs_a_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.set_kernels("torch", torch.device("cpu"))
    assert not dispatch.use_triton(torch.zeros(1))
    assert "torch references (--kernels torch)" in dispatch.describe(torch.device("cpu"))
