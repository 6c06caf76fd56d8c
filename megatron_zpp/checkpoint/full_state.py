"""Our checkpoint (any format, any saved layout) as full single-rank tensors, read in this one process.

    s = full_state("ckpt")                   # s.weights: {param name: fp32 tensor}, as GPT(cfg.model, V) names them
    s = full_state("ckpt", optimizer=True)   # + s.moments {name: {"exp_avg", "exp_avg_sq"}} and s.step (or None)
    s.buffers                                # {name: tensor}: the persistent buffers saved (the routers' expert bias)
    s.model_state()                          # weights and buffers: what GPT(cfg.model, V).load_state_dict takes

The one reader behind consolidation (consolidate.py), the megatron-core export (formats/mcore.py) and the
HF exports. The zpp format: every rank file is checked against meta.json's sha256 and read as safetensors
(nothing unpickled); `reshard.SavedCheckpoint` reassembles each parameter (the reader that reshards a
checkpoint on load) from the fp32 masters. torch_dist: the DCP files are checked the same way; the full
tensors are allocated from DCP's metadata (their global shapes) and filled by DCP's public `load`, which
reads each from the boxes the ranks wrote (`.metadata` unpickled by pickled.SafeReader, which also refuses
a pickled object that would run code, by key). The persistent buffers (the routers' expert bias,
--moe-router-enable-expert-bias) are read as saved, whole: zpp's `/buffers/<name>` from a rank of their stage,
torch_dist's `buffers.<name>`; a checkpoint saved before buffers were saved has none.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field

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
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # persistent buffers by single-rank name

    @property
    def config(self) -> dict:
        return self.meta["config"]

    def model_state(self) -> dict[str, torch.Tensor]:
        """The single-rank model's state dict: the weights and the persistent buffers, as torch's
        `GPT.state_dict()` holds them (a buffer the checkpoint lacks is left out: it starts at its init)."""
        return {**self.weights, **self.buffers}


def full_state(ckpt_dir: str, optimizer: bool = False) -> FullState:
    """The checkpoint `ckpt_dir/latest` names (or an iteration directory itself) as full tensors:
    the fp32 master weights and, with `optimizer`, AdamW's moments and step where it saved them."""
    path, meta = find_checkpoint(ckpt_dir)
    if legacy_warning(meta):  # saved before meta.json.sha256: read, meta.json unverified
        print(f"warning: {legacy_warning(meta)}", file=sys.stderr)
    if meta["format"] == DCP_FORMAT:
        weights, moments, step, buffers = _dcp_full(path, meta, optimizer)
        return FullState(dict(sorted(weights.items())), moments, step, meta, path, dict(sorted(buffers.items())))
    saved = SavedCheckpoint(path, meta)
    with_moments = optimizer and saved.step is not None
    full = {n: saved.full(n, moments=with_moments) for n in progress(saved.names(), "consolidating", unit=" tensors")}
    weights = {n: f["param"] for n, f in full.items()}
    buffers = {n: b for n in saved.buffer_names() if (b := saved.buffer(n)) is not None}
    if not with_moments:
        return FullState(weights, None, None, meta, path, buffers)
    moments = {n: {k: f[k] for k in MOMENTS} for n, f in full.items()}
    return FullState(weights, moments, float(saved.step), meta, path, buffers)


def _placeholder(item) -> torch.Tensor | io.BytesIO:
    """What DCP loads a saved item into: a tensor of its full shape, or (an object) bytes to unpickle."""
    if isinstance(item, TensorStorageMetadata):
        return torch.empty(item.size, dtype=item.properties.dtype)
    return io.BytesIO()


def _dcp_full(path: str, meta: dict, optimizer: bool) -> tuple[dict, dict | None, float | None, dict]:
    """(weights, moments or None, step or None, buffers) of a torch_dist directory (dcp.py's state dict layout:
    model.<name>, optimizer.step, optimizer.state.<name>.<moment>, buffers.<name>), loaded into full-shaped
    tensors."""
    check_files(path, meta)
    model: dict = {}
    buffers: dict = {}
    moments: dict[str, dict] = {}
    opt: dict = {"state": moments}
    for key, item in saved_keys(path).items():
        # an object (not a tensor) under model or optimizer is read too, so SafeReader refuses a crafted one
        # by key; the RNG streams are read back at the same layout only, by load.py
        empty = _placeholder(item)
        if key.startswith("model."):
            model[key[len("model.") :]] = empty
        elif key.startswith("buffers."):
            buffers[key[len("buffers.") :]] = empty
        elif optimizer and key == "optimizer.step":
            opt["step"] = empty
        elif optimizer and key.startswith("optimizer.state."):
            name, _, kind = key[len("optimizer.state.") :].rpartition(".")
            moments.setdefault(name, {})[kind] = empty
    state: dict = {"model": model, "optimizer": opt} if "step" in opt else {"model": model}
    if buffers:
        state["buffers"] = buffers
    dcp_load(state, path)
    if "step" not in opt:
        return model, None, None, buffers
    return model, moments, float(opt["step"]), buffers
