"""Our checkpoint (any format, any saved layout) as full single-rank tensors, read in this one process.

    s = full_state("ckpt")                   # s.weights: {param name: fp32 tensor}, as GPT(cfg.model, V) names them
    s = full_state("ckpt", optimizer=True)   # + s.moments {name: {"exp_avg", "exp_avg_sq"}} and s.step (or None)

The one reader behind consolidation (consolidate.py), the megatron-core export (formats/mcore.py) and the
HF exports. The zpp format: every rank file is checked against meta.json's sha256 and read as safetensors
(nothing unpickled); `reshard.SavedCheckpoint` reassembles each parameter (the reader that reshards a
checkpoint on load) from the fp32 masters. torch_dist: the DCP files are checked the same way; the full
tensors are allocated from DCP's metadata (their global shapes) and filled by DCP's public `load`, which
reads each from the boxes the ranks wrote (`.metadata` unpickled by pickled.SafeReader, which also refuses
a pickled object that would run code, by key).
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..progress import progress
from .dcp import check_files, saved_keys
from .files import DCP_FORMAT, find_checkpoint, legacy_warning
from .pickled import dcp_load
from .reshard import SavedCheckpoint

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class FullState:
    """Full fp32 tensors by single-rank name; `moments`/`step` None without the optimizer (or not asked)."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] | None
    step: float | None
    meta: dict  # meta.json: config, iteration, consumed_samples, format
    path: str  # the iteration directory read

    @property
    def config(self) -> dict:
        return self.meta["config"]


def full_state(ckpt_dir: str, optimizer: bool = False) -> FullState:
    """The checkpoint `ckpt_dir/latest` names (or an iteration directory itself) as full tensors:
    the fp32 master weights and, with `optimizer`, AdamW's moments and step where it saved them."""
    path, meta = find_checkpoint(ckpt_dir)
    if legacy_warning(meta):  # saved before meta.json.sha256: read, meta.json unverified
        print(f"warning: {legacy_warning(meta)}", file=sys.stderr)
    if meta["format"] == DCP_FORMAT:
        weights, moments, step = _dcp_full(path, meta, optimizer)
        return FullState(dict(sorted(weights.items())), moments, step, meta, path)
    saved = SavedCheckpoint(path, meta)
    with_moments = optimizer and saved.step is not None
    full = {n: saved.full(n, moments=with_moments) for n in progress(saved.names(), "consolidating", unit=" tensors")}
    weights = {n: f["param"] for n, f in full.items()}
    if not with_moments:
        return FullState(weights, None, None, meta, path)
    moments = {n: {k: f[k] for k in MOMENTS} for n, f in full.items()}
    return FullState(weights, moments, float(saved.step), meta, path)


def _placeholder(item) -> torch.Tensor | io.BytesIO:
    """What DCP loads a saved item into: a tensor of its full shape, or (an object) bytes to unpickle."""
    if isinstance(item, TensorStorageMetadata):
        return torch.empty(item.size, dtype=item.properties.dtype)
    return io.BytesIO()


def _dcp_full(path: str, meta: dict, optimizer: bool) -> tuple[dict, dict | None, float | None]:
    """(weights, moments or None, step or None) of a torch_dist directory (dcp.py's state dict layout:
    model.<name>, optimizer.step, optimizer.state.<name>.<moment>), loaded into full-shaped tensors."""
    check_files(path, meta)
    model: dict = {}
    moments: dict[str, dict] = {}
    opt: dict = {"state": moments}
    for key, item in saved_keys(path).items():
        # an object (not a tensor) under model or optimizer is read too, so SafeReader refuses a crafted one
        # by key; the RNG streams are read back at the same layout only, by load.py
        empty = _placeholder(item)
        if key.startswith("model."):
            model[key[len("model.") :]] = empty
        elif optimizer and key == "optimizer.step":
            opt["step"] = empty
        elif optimizer and key.startswith("optimizer.state."):
            name, _, kind = key[len("optimizer.state.") :].rpartition(".")
            moments.setdefault(name, {})[kind] = empty
    state: dict = {"model": model, "optimizer": opt} if "step" in opt else {"model": model}
    dcp_load(state, path)
    if "step" not in opt:
        return model, None, None
    return model, moments, float(opt["step"])
