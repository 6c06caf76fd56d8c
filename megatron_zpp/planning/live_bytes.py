"""Measured memory: the live tensor storage bytes of a run and their peak, on CPU (real tensors) or under
FakeTensorMode (a dry run). megatron_zpp.planning.memory's estimates are checked against these (bench/memory.py,
tests/planning/test_memory.py, the dry run's meter in planning/dry_run.py)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveStorage:
    """Live storage bytes and their peak: each storage counted once, from when it is first seen
    until PyTorch frees it (a finalizer on the storage's Python object, which PyTorch keeps unique
    per storage). Storage resizes (ZeRO-3 frees and refills its full weights that way) are
    followed. `reset_peak()` starts a new peak window. The subclasses say which storages are seen."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _track(self, st) -> None:
        key, n = id(st), st.nbytes()
        old = self.sizes.get(key)
        if old is None:
            weakref.finalize(st, self._free, key)
            old = 0
        self.sizes[key] = n
        self.live += n - old
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def _follow_resizes(self) -> None:
        ledger, resize = self, torch.UntypedStorage.resize_
        self._resize = resize

        def tracked_resize(st, n):  # storage.resize_ bypasses the dispatcher
            out = resize(st, n)
            if id(st) in ledger.sizes:
                ledger._track(st)
            return out

        torch.UntypedStorage.resize_ = tracked_resize

    def _stop_following(self) -> None:
        torch.UntypedStorage.resize_ = self._resize

    def reset_peak(self) -> None:
        self.peak = self.live


class LiveBytes(_LiveStorage, TorchDispatchMode):
    """Live tensor storage bytes while active, and their peak: every op's output storages (a
    dispatch mode, so real CPU tensors and fake ones alike). Enter it before building the model
    so parameters, optimizer states and buffers count too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def __enter__(self):
        self._follow_resizes()
        return super().__enter__()

    def __exit__(self, *exc):
        self._stop_following()
        return super().__exit__(*exc)


class FakeLiveBytes(_LiveStorage):
    """LiveBytes for fake tensors only, at a fraction of its cost: the outputs of every op
    FakeTensorMode dispatches from outside itself (what a dispatch mode above it would see), with
    a counter on FakeTensorMode.dispatch instead of a Python mode on the stack. The ops inside
    (a decomposition's intermediates when its dispatch cache misses: work no device kernel does)
    are not counted, so a rank's figures do not depend on what ran before it in the process.
    The dry run's meter (planning/dry_run.py)."""

    def __enter__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        ledger, dispatch = self, FakeTensorMode.dispatch
        self._dispatch, depth = dispatch, [0]

        def counted_dispatch(mode, func, types, args=(), kwargs=None):
            depth[0] += 1
            try:
                out = dispatch(mode, func, types, args, kwargs or {})
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                for t in tree_flatten(out)[0] if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        ledger._track(t.untyped_storage())
            return out

        FakeTensorMode.dispatch = counted_dispatch
        self._follow_resizes()
        return self

    def __exit__(self, *exc):
        from torch._subclasses.fake_tensor import FakeTensorMode

        FakeTensorMode.dispatch = self._dispatch
        self._stop_following()
        return False
