"""The files of a sharded checkpoint: names, the rank-file codec (safetensors, nothing
pickled), checksums and meta.json. A leaf: the save/load logic (sharded.py), the
resharding reader (reshard.py) and the layout description (layout.py) all build on it.

A rank file stores a nested dict: every tensor under its path in the dict (e.g.
"/model/unit3.layer2.master", "/optimizer/state/5/exp_avg"), the rest (numbers, strings,
the dict's shape) as JSON in the header's "megatron_zpp" entry.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "megatron_zpp.sharded.v3"  # v2: ZeRO files hold the fp32 masters only; v3: safetensors


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or setting."""


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def fsync_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_path(path: str) -> None:
    """fsync a written file, or a directory after renames in it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _flatten(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(every tensor by its path, a JSON skeleton of the rest): what a safetensors file holds."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path: str):
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().contiguous()
            return {"t": path}
        if isinstance(x, dict):  # keys keep their type (the optimizer's are ints)
            return {"d": [[k, walk(v, f"{path}/{k}")] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"u" if isinstance(x, tuple) else "l": [walk(v, f"{path}/{i}") for i, v in enumerate(x)]}
        return {"v": x}

    return tensors, walk(state, "")


def _unflatten(skeleton: dict, tensor) -> object:
    if "t" in skeleton:
        return tensor(skeleton["t"])
    if "d" in skeleton:
        return {k: _unflatten(v, tensor) for k, v in skeleton["d"]}
    if "l" in skeleton or "u" in skeleton:
        items = [_unflatten(v, tensor) for v in skeleton.get("l", skeleton.get("u"))]
        return items if "l" in skeleton else tuple(items)
    return skeleton["v"]


def nonfinite_tensors(state: dict) -> list[str]:
    """The paths of the floating-point tensors of `state` that hold an inf or a NaN."""
    tensors, _ = _flatten(state)
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def write_rank_file(tmp: str, rank: int, state: dict) -> str:
    """Write one rank's file (fsynced, renamed into place); its sha256."""
    path = os.path.join(tmp, rank_file(rank))
    tensors, skeleton = _flatten(state)
    save_file(tensors, path + ".tmp", metadata={"megatron_zpp": json.dumps(skeleton)})
    fsync_path(path + ".tmp")
    os.replace(path + ".tmp", path)
    return sha256_of(path)  # read back from the page cache


def read_meta(directory: str, iteration: int | None = None) -> tuple[str, dict] | None:
    """(iteration dir, meta) of the checkpoint `latest` names, or of `iteration`; None when
    `directory` holds no `latest` (and no iteration is asked for)."""
    latest = os.path.join(directory, "latest")
    if iteration is not None:
        path, named_by = os.path.join(directory, iter_name(iteration)), f"--ckpt-step {iteration}"
        if not os.path.isdir(path):
            have = (
                sorted(d for d in os.listdir(directory) if d.startswith("iter_") and not d.endswith(".tmp"))
                if os.path.isdir(directory)
                else []
            )
            raise CheckpointError(
                f"{named_by}: {path} does not exist (saved iterations in {directory}: {', '.join(have) or 'none'})"
            )
    elif not os.path.exists(latest):
        return None
    else:
        with open(latest) as f:
            path, named_by = os.path.join(directory, f.read().strip()), latest
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{named_by} names {path}, which has no meta.json (incomplete checkpoint)")
    return path, _read_meta_file(meta_path)


def locate_checkpoint(load: str, iteration: int | None = None) -> tuple[str, dict] | None:
    """(iteration dir, meta) that --load names: an iteration dir itself (it holds meta.json), or the
    one `latest` in the checkpoint root names (or `iteration`'s, --ckpt-step); None when `load` is a
    root without `latest` and no iteration is asked for."""
    if os.path.isfile(os.path.join(load, "meta.json")):
        path = os.path.normpath(load)
        if iteration is not None and os.path.basename(path) != iter_name(iteration):
            raise CheckpointError(
                f"--ckpt-step {iteration} asks for another iteration than --load {load} names: "
                "give --load the checkpoint root (the directory with 'latest') with --ckpt-step, or drop --ckpt-step"
            )
        return os.path.abspath(path), _read_meta_file(os.path.join(path, "meta.json"))
    found = read_meta(load, iteration)
    return (os.path.abspath(found[0]), found[1]) if found else None


def saved_iterations(directory: str) -> list[int]:
    """The iterations of the complete-looking iteration dirs in `directory`, in order."""
    if not os.path.isdir(directory):
        return []
    names = [d for d in os.listdir(directory) if d.startswith("iter_") and d[5:].isdigit()]
    return sorted(int(d[5:]) for d in names if os.path.isdir(os.path.join(directory, d)))


def find_checkpoint(ckpt_dir: str) -> tuple[str, dict]:
    """(iteration dir, meta) of `ckpt_dir/latest`, or of `ckpt_dir` when it is an iteration dir."""
    meta_path = os.path.join(ckpt_dir, "meta.json")
    if os.path.exists(meta_path):
        return ckpt_dir, _read_meta_file(meta_path)
    found = read_meta(ckpt_dir)
    if found is None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint (no 'latest' file)")
    return found


def _read_meta_file(meta_path: str) -> dict:
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except ValueError as e:  # truncated or not JSON: a damaged checkpoint, not a bug
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: unknown format {meta.get('format')!r} (expected {FORMAT})")
    return meta


class RankFile:
    """One rank's file, opened: tensors are read when asked for (`tensor(path)`), or all at
    once as the nested dict that was saved (`state()`)."""

    def __init__(self, fpath: str, device="cpu"):
        self.fpath = fpath
        try:
            self._file = safe_open(fpath, framework="pt", device=str(device))
            self._skeleton = json.loads(self._file.metadata()["megatron_zpp"])
            self.keys = set(self._file.keys())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read checkpoint file {fpath}: {e}") from e

    def tensor(self, path: str) -> torch.Tensor:
        if path not in self.keys:
            raise CheckpointError(f"checkpoint file {self.fpath} has no tensor {path}")
        return self._file.get_tensor(path)

    def state(self) -> dict:
        return _unflatten(self._skeleton, self.tensor)


def open_rank_file(path: str, meta: dict, rank: int, device="cpu") -> RankFile:
    """One rank's file, checked against meta.json's sha256 first."""
    fpath = os.path.join(path, rank_file(rank))
    if not os.path.exists(fpath):
        raise CheckpointError(f"checkpoint file {fpath} is missing")
    if sha256_of(fpath) != meta["files"].get(rank_file(rank)):
        raise CheckpointError(f"checkpoint file {fpath} is corrupted or truncated: its sha256 does not match meta.json")
    return RankFile(fpath, device)


def read_rank_file(path: str, meta: dict, rank: int, map_location="cpu") -> dict:
    """One rank's file as the nested dict that was saved (checked, nothing unpickled)."""
    return open_rank_file(path, meta, rank, map_location).state()
