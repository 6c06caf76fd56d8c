"""The pickles a torch_dist checkpoint holds, read without running pickled code, and its files checked first.

Two pickles are read, ours (`--ckpt-format torch_dist`) and megatron-core's alike:

* DCP's `.metadata` (`torch.distributed.checkpoint.FileSystemReader.read_metadata` would `pickle.load` it):
  `SafeReader` reads it with an unpickler that resolves only DCP's metadata classes and the torch types they
  hold, and the save plans megatron-core keeps there (`METADATA_GLOBALS`); any other global (a function to
  call: `os.system`, `builtins.exec`, ...) is refused by name in one line before it is resolved, so nothing
  of it runs. Then every data file the
  metadata places bytes in must be inside the directory, exist and be long enough (`check_storage`), so a
  missing or truncated `.distcp` is one line naming it, before any tensor is read.
* megatron-core's common state object (`common_state`, or `common.pt`): `torch.load(weights_only=True)` with
  the standard library classes a Megatron-LM args may hold (`COMMON_GLOBALS`), and megatron-core's own list
  (its enums) when it is installed.

The tensor data itself DCP reads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import pathlib
import pickle
import types
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner

from .files import CheckpointError

COMMON_GLOBALS: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO]


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """{(module, name): object} that a DCP `.metadata` may name: DCP's metadata dataclasses and enum, its
    storage info, torch.Size, the dtypes, the layout decoder and the checkpoint id's path."""
    classes = [getattr(dcp_metadata, n) for n in dcp_metadata.__all__ if isinstance(getattr(dcp_metadata, n), type)]
    classes += [dcp_metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size]
    # megatron-core keeps its save plans in the metadata (planner_data): DCP's plan dataclasses, not the planners
    plans = ("WriteItemType", "LoadItemType", "BytesIOWriteData", "TensorWriteData", "WriteItem", "ReadItem")
    classes += [getattr(dcp_planner, n) for n in (*plans, "SavePlan", "LoadPlan")]
    classes += [pathlib.PosixPath, pathlib.PurePosixPath, collections.OrderedDict]
    out: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    dtypes = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    out.update({("torch", n): d for n, d in dtypes.items()})
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    out[("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")] = _MCoreSavePlan
    return out


class _MCoreSavePlan:
    """megatron-core's empty MCoreSavePlan, which its older checkpoints' metadata name (read without megatron)."""


METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None


class _Refused(Exception):
    pass


def read_metadata(path: str) -> dcp_metadata.Metadata:
    """DCP's `.metadata` file `path`, unpickled with `METADATA_GLOBALS` only; one line naming it otherwise."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a torch.distributed.checkpoint directory") from None
    except _Refused as e:
        raise CheckpointError(
            f"{path}: refused: its pickle names {e}, which no torch.distributed.checkpoint metadata holds "
            "(unpickling it could run code); it is not read"
        ) from None
    except Exception as e:  # noqa: BLE001  (a truncated or garbled pickle raises any of several)
        raise CheckpointError(f"{path} is truncated or corrupted: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint metadata")
    return metadata


def check_storage(root: str, metadata: dcp_metadata.Metadata) -> None:
    """Every data file `metadata` places bytes in is a file of `root` (no `../`, no absolute path), there,
    and at least as long as the last byte it is said to hold."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == "..":
            raise CheckpointError(f"{os.path.join(root, '.metadata')}: names a data file outside {root}: {rel!r}")
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(needed.items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing (its .metadata places data there)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(
                f"checkpoint file {path} is truncated: {size} bytes, its .metadata places data up to byte {end}"
            )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, its `.metadata` read by `read_metadata` and its data files checked (`check_storage`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(str(self._get_metadata_path(kwargs.get("rank"))))
        check_storage(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        if not getattr(planner, "keeps_bytes", False):  # DCP's own planners unpickle with weights_only=False
            planner = _WeightsOnlyBytes(planner, str(self.path))
        return super().read_data(plan, planner)


class _WeightsOnlyBytes:
    """A load planner whose pickled objects (DCP's BYTE_IO items, which its default planner unpickles with
    torch.load(weights_only=False)) are first read with weights_only=True: one naming a global that could run
    code is refused by key before the planner unpickles it; the rest goes to the planner as it is."""

    def __init__(self, planner, path: str):
        self._planner, self._path = planner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001  (pickle's errors name the global it refused)
            raise CheckpointError(
                f"{self._path}: {read_item.dest_index.fqn} is a pickled object that would run code when read: "
                f"{_refusal(e)}"
            ) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def dcp_load(state: dict, path: str, planner=None, no_dist: bool = True) -> None:
    """DCP's load of `state` from `path` through `SafeReader`; a file DCP cannot read is one line naming `path`."""
    reader = SafeReader(path)
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointError:
        raise
    except dcp.api.CheckpointException as e:
        error = _first_failure(e)
        if isinstance(error, CheckpointError):  # ours, raised inside DCP's plan (SafeReader): already one line
            raise error from None
        text = str(error).strip().splitlines()
        raise CheckpointError(
            f"{path}: torch.distributed.checkpoint could not read it: {type(error).__name__}: {text[0] if text else ''}"
        ) from None


def _first_failure(e: Exception) -> BaseException:
    """The first rank's exception of DCP's CheckpointException ({rank: (exception, traceback)})."""
    first = next(iter((getattr(e, "failures", None) or {}).values()), e)
    return first[0] if isinstance(first, tuple) else first


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns on every single-process save and load (no process group): that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def unpickle_common(data: str | io.BytesIO, where: str, with_megatron: bool = True) -> Any:
    """torch.load(weights_only=True) with `COMMON_GLOBALS`, and megatron-core's own (its enums) when a first try
    names one and megatron-core is installed; a refusal is one line naming `where` and the global."""
    for extra in (False, True) if with_megatron else (False,):
        if isinstance(data, io.BytesIO):
            data.seek(0)
        try:
            with torch.serialization.safe_globals(_common_globals(extra)):
                return torch.load(data, weights_only=True)
        except Exception as e:  # noqa: BLE001  (pickle's errors name the class it refused)
            error = e
    raise CheckpointError(
        f"{where}: its common state is not read, as that would run pickled code: {_refusal(error)}"
    ) from None


def _refusal(error: Exception) -> str:
    """The line of torch's (several-line) weights_only refusal that names the global."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")


def _common_globals(with_megatron: bool) -> list:
    if not with_megatron:
        return COMMON_GLOBALS
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        return COMMON_GLOBALS
    return COMMON_GLOBALS + list(SAFE_GLOBALS)
