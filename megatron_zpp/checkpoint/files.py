"""The files of a sharded checkpoint: names, the rank-file codec (safetensors, nothing
pickled), checksums and meta.json. A leaf: the save/load logic (save.py, load.py), the
resharding reader (reshard.py) and the layout description (layout.py) all build on it.

A rank file stores a nested dict: every tensor under its path in the dict (e.g.
"/model/unit3.layer2.master", "/optimizer/state/5/exp_avg"), the rest (numbers, strings,
the dict's shape) as JSON in the header's "megatron_zpp" entry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import threading

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "megatron_zpp.sharded.v3"  # v2: ZeRO files hold the fp32 masters only; v3: safetensors
DCP_FORMAT = "megatron_zpp.torch_dist.v1"  # --ckpt-format torch_dist: torch.distributed.checkpoint files (dcp.py)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or setting."""


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


LATEST_NAME = re.compile(r"iter_[0-9]{7,}")  # all `latest` may hold: one of the root's own iteration dirs


def read_latest(directory: str) -> str:
    """The iteration dir name `directory/latest` holds; anything else (a path, `..`, garbage, nothing)
    is a CheckpointError before any file it might point at is opened."""
    latest = os.path.join(directory, "latest")
    try:
        with open(latest, "rb") as f:
            raw = f.read(65)
    except OSError as e:
        raise CheckpointError(f"{latest}: cannot read ({e.strerror or e})") from None
    name = raw.decode("ascii", "replace").strip()
    if not LATEST_NAME.fullmatch(name):
        shown = repr(name[:40]) if name else "nothing"
        raise CheckpointError(
            f"{latest}: holds {shown}, not an iteration directory name such as {iter_name(100)}; "
            "write the name of the iteration dir to resume from, or give --load that dir"
        )
    return name


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


_UMASK_LOCK = threading.Lock()


def new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the process's umask (read without changing it
    where /proc says it, so that a writer thread never sees a umask of 0)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return 0o666 & ~mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' save_file, which creates its files 0600, then the usual mode (0644 under umask 022).
    A failed write (its Rust writer raises SafetensorError, no OSError) is the OSError it names."""
    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as e:  # noqa: BLE001  (SafetensorError: its text names the OS error)
        raise (write_error(e, path) or e) from None
    os.chmod(path, new_file_mode())


def write_error(e: BaseException, path: str) -> OSError | None:
    """The OSError behind a failed write to `path` (None when `e` is none): `e` itself; the `os error N`
    safetensors' writer names; or a write torch's zip writer found short ("unexpected pos": the errno
    is lost), taken as a full disk when the file system has no space left, else as the file-size limit
    when one is set, else named as a short write."""
    if isinstance(e, OSError):
        return e
    text = str(e)
    if m := re.search(r"os error (\d+)", text):
        code = int(m.group(1))
        return OSError(code, os.strerror(code), path)
    if "unexpected pos" not in text:
        return None
    try:
        st = os.statvfs(path if os.path.isdir(path) else os.path.dirname(path) or ".")
        full = st.f_bavail * st.f_frsize < (1 << 20)
    except OSError:
        full = False
    limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    if full or limited:
        code = errno.ENOSPC if full else errno.EFBIG
        return OSError(code, os.strerror(code), path)
    return OSError(errno.EIO, f"a write stopped short ({text.strip()[-40:]}: a quota, a network file system?)", path)


def os_error_line(e: OSError, path: str) -> str:
    """One line for an OSError met reading or writing `path` (e.filename where it names one)."""
    where = e.filename or path
    if e.errno == errno.ENOSPC:
        return f"no space left on device writing {where}"
    if e.errno == errno.EFBIG:
        return f"file too large (the file-size limit, ulimit -f) writing {where}"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded writing {where}"
    return f"{e.strerror or e} ({where})"


def save_failure(e: OSError, iteration: int, directory: str) -> str:
    """The one line of a save an OSError stopped (a full disk, a read-only file system)."""
    why = os_error_line(e, directory)
    return f"cannot save iteration {iteration} to {directory}: {why}; free space or give another --save"


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
        items = [_unflatten(v, tensor) for v in (skeleton["l"] if "l" in skeleton else skeleton["u"])]
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
    save_safetensors(tensors, path + ".tmp", {"megatron_zpp": json.dumps(skeleton)})
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
        path, named_by = os.path.join(directory, read_latest(directory)), latest
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


# meta.json's fields and their JSON types ("tracking" and "train_state" may be absent)
META_FIELDS = {
    "format": str,
    "iteration": int,
    "consumed_samples": int,
    "padded_vocab_size": int,
    "world_size": int,
    "layout": dict,
    "config": dict,
    "files": dict,
}
OPTIONAL_META_FIELDS = {"tracking": dict, "train_state": dict}


def meta_train_fields(train_state: dict) -> dict:
    """The run's train state (training/state.py's TrainState.state_dict()) as meta.json's fields:
    "iteration", "consumed_samples", "tracking" at the top, the rest under "train_state" (the
    validation samples when any were read; the loss scaler and skipped steps with --fp16 or after
    a skipped step), as checkpoints have always held them."""
    rest = {"consumed_valid_samples": train_state["consumed_valid_samples"]}
    rest = rest if rest["consumed_valid_samples"] else {}
    if train_state.get("loss_scaler") is not None or train_state.get("skipped_iterations"):
        rest["loss_scaler"] = train_state.get("loss_scaler")
        rest.update({k: train_state.get(k, 0) for k in ("skipped_iterations", "skipped_samples")})
    return {
        "iteration": int(train_state["iteration"]),
        "consumed_samples": int(train_state["consumed_samples"]),
        "tracking": dict(train_state.get("tracking") or {}),
        **({"train_state": rest} if rest else {}),
    }


def train_state_of(meta: dict, with_loss_scaler: bool = True) -> dict:
    """meta.json's fields as the train state they were saved from (meta_train_fields' inverse);
    without `with_loss_scaler` (--no-load-optim: the scaler is the optimizer's, as Megatron's) the
    run keeps its fresh scale."""
    rest = meta.get("train_state") or {}
    return {
        "iteration": int(meta["iteration"]),
        "consumed_samples": int(meta["consumed_samples"]),
        "consumed_valid_samples": rest.get("consumed_valid_samples"),  # absent: derived from the iteration
        "loss_scaler": rest.get("loss_scaler") if with_loss_scaler else None,
        "skipped_iterations": int(rest.get("skipped_iterations", 0)),
        "skipped_samples": int(rest.get("skipped_samples", 0)),
        "tracking": dict(meta.get("tracking") or {}),
    }


META_DIGEST = "meta.json.sha256"


def meta_digest_file(iteration_dir: str) -> str:
    """Beside meta.json: its sha256, written last by the save, checked first by every read."""
    return os.path.join(iteration_dir, META_DIGEST)


def write_meta(iteration_dir: str, meta: dict) -> None:
    data = json.dumps(meta, indent=1).encode()
    fsync_write(os.path.join(iteration_dir, "meta.json"), data)
    fsync_write(meta_digest_file(iteration_dir), (hashlib.sha256(data).hexdigest() + "\n").encode())


def _type_name(tp) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
    }
    return names.get(tp, "null")


def _field_problem(name: str, value, tp) -> str | None:
    if isinstance(value, bool) and tp is not bool or not isinstance(value, tp):
        return f"field {name!r} is {_type_name(type(value))}, expected {_type_name(tp)}"
    return None


def _config_problem(config: dict) -> str | None:
    """The first setting of meta["config"] whose type is not its field's (settings whose default is
    None may hold any JSON value); unknown sections and settings are config_from_dict's to name."""
    from ..config import Config  # the config package imports nothing of ours

    defaults = Config().to_dict()
    for section, values in config.items():
        if not isinstance(values, dict):
            return f"field 'config.{section}' is {_type_name(type(values))}, expected an object"
        for name, value in values.items():
            default = defaults.get(section, {}).get(name)
            if default is None or value is None:
                continue
            tp = float if type(default) is float else type(default)
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                continue
            if (isinstance(value, bool) != (tp is bool)) or not isinstance(value, tp):
                return (
                    f"field 'config.{section}.{name}' is {_type_name(type(value))} {value!r}, expected {_type_name(tp)}"
                )
    return None


def meta_problem(meta) -> str | None:
    """Why `meta` is not a meta.json this code wrote (None when its shape and types are right)."""
    if not isinstance(meta, dict):
        return f"is {_type_name(type(meta))}, not an object"
    if meta.get("format") not in (FORMAT, DCP_FORMAT):
        return f"unknown format {meta.get('format')!r} (expected {FORMAT} or {DCP_FORMAT})"
    for name, tp in META_FIELDS.items():
        if name not in meta:
            return f"field {name!r} is missing"
        problem = _field_problem(name, meta[name], tp)
        if problem:
            return problem
    for name, tp in OPTIONAL_META_FIELDS.items():
        problem = _field_problem(name, meta[name], tp) if meta.get(name) is not None else None
        if problem:
            return problem
    bad = [k for k, v in meta["files"].items() if not isinstance(v, str)]
    if bad:
        return f"field 'files.{bad[0]}' is {_type_name(type(meta['files'][bad[0]]))}, expected a string"
    if meta["format"] == DCP_FORMAT:
        if ".metadata" not in meta["files"]:
            return "field 'files' does not list DCP's .metadata"
    elif sorted(meta["files"]) != [rank_file(r) for r in range(meta["world_size"])]:
        return f"field 'files' does not list the {meta['world_size']} rank files of 'world_size'"
    return _config_problem(meta["config"])


# set (by _read_meta_file, never read from a file) on the meta of a checkpoint saved before meta.json.sha256
# and the rank files' own rank and layout existed: the warning text, which the load logs once
LEGACY = "_legacy_unverified"


def legacy_warning(meta: dict) -> str | None:
    """The one warning line a load of a pre-sha256 checkpoint prints (None for a current one)."""
    return meta.get(LEGACY)


def _read_meta_file(meta_path: str) -> dict:
    """meta.json, checked against its sha256 (meta.json.sha256 beside it) and its schema. A checkpoint
    without meta.json.sha256 is taken as the legacy format (saved before it existed): its meta.json is
    unverified (marked with LEGACY), the rest is checked as usual, and its rank files must be legacy too
    (no 'rank' or 'layout' of their own, see _rank_file_problem)."""
    digest_path = meta_digest_file(os.path.dirname(meta_path))
    try:
        with open(meta_path, "rb") as f:
            data = f.read()
        digest = None
        if os.path.exists(digest_path):
            with open(digest_path, "rb") as f:
                digest = f.read(256).decode("ascii", "replace").strip()  # garbage simply does not match
    except FileNotFoundError as e:
        raise CheckpointError(f"{e.filename} is missing (incomplete or damaged checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"{meta_path}: cannot be read ({e.strerror or e})") from None
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(
            f"{meta_path}: its sha256 does not match {os.path.basename(digest_path)} beside it "
            "(edited or damaged): restore the file as saved"
        )
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as e:  # truncated, not JSON or nested absurdly: damaged, not a bug
        raise CheckpointError(f"{meta_path}: not valid JSON ({e or 'nested too deeply'})") from None
    problem = meta_problem(meta)
    if problem:
        raise CheckpointError(f"{meta_path}: {problem}")
    if digest is None:
        meta[LEGACY] = (
            f"{meta_path}: a checkpoint saved before meta.json.sha256 existed (legacy format): meta.json itself is "
            "unverified (the rank files' sha256s it lists, their keys, shapes and dtypes are checked); "
            "the next save writes the current format"
        )
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
        state = _unflatten(self._skeleton, self.tensor)
        assert isinstance(state, dict)  # a rank's state is a dict at its top
        return state

    def header_keys(self) -> set:
        """The top-level entries of the saved dict."""
        return {k for k, _ in self._skeleton.get("d", [])}

    def header(self, key: str):
        """A top-level entry of the saved dict (a number, the layout), read without its tensors; KeyError if absent."""
        entries = dict(self._skeleton.get("d", []))
        return _unflatten(entries[key], self.tensor)


# what each rank file carries of meta.json, cross-checked on every read
RANK_FILE_COPIES = ("iteration", "consumed_samples", "layout")


def _rank_file_problem(rf: RankFile, meta: dict, rank: int) -> str | None:
    """Why the file `rf`, opened as `rank`'s, disagrees with meta.json (None when it agrees)."""
    if meta.get(LEGACY):  # a legacy file carries no rank or layout; a current one means meta.json.sha256 was lost
        entries = rf.header_keys()
        if "rank" in entries or "layout" in entries:
            return (
                f"carries its rank and layout (the current format) but {META_DIGEST} is missing beside meta.json "
                "(incomplete or damaged checkpoint)"
            )
        for key in ("iteration", "consumed_samples"):  # the legacy format had these two
            if key in entries and rf.header(key) != meta[key]:
                return f"field {key!r} is {rf.header(key)!r} but meta.json says {meta[key]!r}"
        return None
    try:
        saved_rank = rf.header("rank")
        if saved_rank != rank:
            return f"holds rank {saved_rank}'s state, not rank {rank}'s (rank files swapped?)"
        for key in RANK_FILE_COPIES:
            if rf.header(key) != meta[key]:
                return f"field {key!r} is {rf.header(key)!r} but meta.json says {meta[key]!r}"
    except KeyError as e:
        return f"field {e.args[0]!r} is missing"
    return None


def open_rank_file(path: str, meta: dict, rank: int, device="cpu") -> RankFile:
    """One rank's file, checked against meta.json's sha256 first."""
    fpath = os.path.join(path, rank_file(rank))
    if not os.path.exists(fpath):
        raise CheckpointError(f"checkpoint file {fpath} is missing")
    if sha256_of(fpath) != meta["files"].get(rank_file(rank)):
        raise CheckpointError(f"checkpoint file {fpath} is corrupted or truncated: its sha256 does not match meta.json")
    rf = RankFile(fpath, device)
    problem = _rank_file_problem(rf, meta, rank)
    if problem:
        raise CheckpointError(f"checkpoint file {fpath}: {problem}")
    return rf


def read_rank_file(path: str, meta: dict, rank: int, map_location="cpu") -> dict:
    """One rank's file as the nested dict that was saved (checked, nothing unpickled)."""
    return open_rank_file(path, meta, rank, map_location).state()
