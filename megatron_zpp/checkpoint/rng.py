"""Random-number state of one rank, as tensors, numbers and lists (a checkpoint holds no
pickled objects): torch CPU and device generators, the tensor-parallel
dropout stream (tensor_parallel.random._STATE), numpy's and Python's global generators."""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import torch

from ..tensor_parallel import random as tp_random


def _accelerator():
    """The run's accelerator device (seeded by tensor_parallel.random), or None on CPU."""
    device = tp_random._STATE.get("device")
    return device if device is not None and device.type != "cpu" else None


def get_rng_state() -> dict:
    """Every random stream of this process, as tensors, lists and numbers."""
    st = tp_random._STATE
    np_state = cast(tuple, np.random.get_state())  # legacy=True (the default): the tuple form
    py_state = random.getstate()
    out = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss_next": py_state[2]},
    }
    device = _accelerator()
    if device is not None:
        out["device"] = torch.get_device_module(device).get_rng_state(device)
    if st:
        out["tp_cpu"] = st["cpu"]
        if st.get("dev") is not None:
            out["tp_device"] = st["dev"]
    return out


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch_cpu"])
    n = s["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    py = s["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    device = _accelerator()
    if "device" in s and device is not None:
        torch.get_device_module(device).set_rng_state(s["device"], device)
    if "tp_cpu" in s:
        tp_random._STATE["cpu"] = s["tp_cpu"]
        tp_random._STATE["dev"] = s.get("tp_device")
