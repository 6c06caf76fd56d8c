"""Where tools/convert_checkpoint.py writes: never over what exists, never mixed with the other format.

The rule, checked before any tensor is read (`check_output`) and again when the result is put in place
(`staged`): the output must not be the input, hold it, or lie inside an iteration directory; a file
(--to consolidated) or a HF directory (--to hf) must not exist yet (an empty directory is taken); a
checkpoint root (--to sharded: ours, --to megatron: megatron-core's) must not hold the iteration the
conversion writes, a `latest` (tracker) naming a newer one (it would move back) or the other format's
files. Everything is written under a fresh `*.tmp` first and renamed into place at the end: a conversion
that fails or is interrupted leaves the output as it was (at most a `*.tmp` a kill -9 left behind).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from .files import CheckpointError, fsync_path, fsync_write, iter_name, read_latest
from .mcore import TRACKER

KINDS = ("file", "hf", "ours", "megatron")  # --to consolidated, hf, sharded, megatron
ITER_DIR = re.compile(r"iter_[0-9]{7,}")
POINTER = {"ours": "latest", "megatron": TRACKER}  # the file a root's newest iteration is named in
FORMAT_NAME = {"ours": "megatron_zpp", "megatron": "megatron-core torch_dist", "hf": "HF (config.json + safetensors)"}


class OutputError(CheckpointError):
    """An output the converter will not write to; one line naming it and why."""


def _is_iteration_dir(path: str) -> str | None:
    """The format of the checkpoint iteration directory `path` ("ours", "megatron"), else None."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return "ours"
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "megatron"
    return None


def _formats_in(root: str) -> set[str]:
    """The checkpoint formats a root holds: by its pointer files, its iteration directories, a HF model's files."""
    found = {kind for kind, name in POINTER.items() if os.path.exists(os.path.join(root, name))}
    names = os.listdir(root)
    for name in names:
        if ITER_DIR.fullmatch(name) and (kind := _is_iteration_dir(os.path.join(root, name))):
            found.add(kind)
    if "config.json" in names and any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        found.add("hf")
    return found


def _pointed_iteration(root: str, kind: str) -> int | None:
    """The iteration the root's `latest` (ours) or tracker (megatron-core's) names; None without one.
    One that is not an iteration number is an OutputError: overwriting it would lose what it meant."""
    path = os.path.join(root, POINTER[kind])
    if not os.path.exists(path):
        return None
    try:
        if kind == "ours":
            return int(read_latest(root)[len("iter_") :])
        with open(path) as f:
            text = f.read(64).strip()
        return int(text)
    except (CheckpointError, OSError, ValueError, UnicodeDecodeError):
        raise OutputError(
            f"--output {root}: its {POINTER[kind]} names no iteration number; the converter does not replace it "
            "(give a new directory)"
        ) from None


def check_output(load: str, output: str, kind: str, iteration: int | None = None) -> None:
    """Refuse (OutputError) an `output` of `kind` (KINDS) that the conversion of `load` would overwrite or
    mix formats in; `iteration`: the one a checkpoint root gets (None: checked when it is known)."""
    out, src = os.path.realpath(output), os.path.realpath(load)
    if out == src:
        raise OutputError(f"--output {output} is --load itself: the converter never writes over its input")
    if src.startswith(out.rstrip(os.sep) + os.sep):
        raise OutputError(f"--output {output} holds --load {load}: the converter never writes over its input")
    for at in [out, *_parents(out)]:
        if os.path.isdir(at) and (fmt := _is_iteration_dir(at)):
            where = "is" if at == out else f"lies inside {at}, which is"
            raise OutputError(
                f"--output {output} {where} an iteration directory of a {FORMAT_NAME[fmt]} checkpoint: the "
                "converter never writes into one; give a path outside it (a new checkpoint root for --to sharded)"
            )
    if not os.path.lexists(out):
        return
    if kind == "file":
        what = "a directory" if os.path.isdir(out) else "an existing file"
        raise OutputError(f"--output {output} is {what}: the converter never overwrites; give a new FILE.pt")
    if not os.path.isdir(out):
        raise OutputError(f"--output {output} is a file: give a directory")
    if kind == "hf":
        if os.listdir(out):
            raise OutputError(
                f"--output {output} is not empty: the converter never overwrites a directory; give a new one"
            )
        return
    _check_root(output, out, kind, iteration)


def _check_root(output: str, out: str, kind: str, iteration: int | None) -> None:
    """A checkpoint root the conversion adds `iteration` to: same format, not there yet, not older than latest."""
    other = _formats_in(out) - {kind}
    if other:
        fmt = FORMAT_NAME[other.pop()]
        raise OutputError(
            f"--output {output} holds a {fmt} checkpoint: the converter never mixes formats in one directory; "
            "give a new one"
        )
    if iteration is None:
        return
    if os.path.exists(os.path.join(out, iter_name(iteration))):
        raise OutputError(
            f"--output {output} already holds {iter_name(iteration)}: the converter never overwrites a checkpoint; "
            "give a new directory"
        )
    newest = _pointed_iteration(out, kind)
    if newest is not None and newest > iteration:
        raise OutputError(
            f"--output {output}: its {POINTER[kind]} names iteration {newest}, newer than the {iteration} this "
            f"conversion writes (it would move {POINTER[kind]} back): give a new directory"
        )


def _parents(path: str) -> list[str]:
    out = []
    while (parent := os.path.dirname(path)) != path:
        out.append(parent)
        path = parent
    return out


@contextlib.contextmanager
def staged(load: str, output: str, kind: str) -> Iterator[str]:
    """The path to write the conversion to: a fresh `*.tmp` beside `output` (inside it, for an existing
    checkpoint root), put in place when the block ends (the checks run again first) and removed when it
    raises. For a root, the block writes a whole root there (its iteration directory and pointer file)."""
    out = os.path.realpath(output)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    into_root = kind in POINTER and os.path.isdir(out)
    where = out if into_root else parent
    prefix = ".convert-" if into_root else os.path.basename(out) + "."
    mask = os.umask(0o022)  # mkstemp and mkdtemp create 0600 and 0700: the result gets the usual mode
    os.umask(mask)
    if kind == "file":
        fd, stage = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=where)
        os.close(fd)
        os.chmod(stage, 0o666 & ~mask)
    else:
        stage = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=where)
        os.chmod(stage, 0o777 & ~mask)
    try:
        yield stage
        _publish(load, output, kind, stage, into_root)
    finally:
        if os.path.isdir(stage):
            shutil.rmtree(stage, ignore_errors=True)
        elif os.path.lexists(stage):
            os.unlink(stage)


def _publish(load: str, output: str, kind: str, stage: str, into_root: bool) -> None:
    """Put the staged result in place: the whole file or directory by one rename, or, into an existing
    root, its iteration directory by one rename and then the pointer file (written atomically)."""
    out = os.path.realpath(output)
    if not into_root:
        check_output(load, output, kind)
        if os.path.isdir(out):  # an empty directory (check_output refused any other)
            os.rmdir(out)
        os.rename(stage, out)
        fsync_path(os.path.dirname(out))
        return
    names = [n for n in os.listdir(stage) if ITER_DIR.fullmatch(n)]
    if len(names) != 1:
        raise CheckpointError(f"{stage}: the conversion wrote {len(names)} iteration directories, not one")
    check_output(load, output, kind, int(names[0][len("iter_") :]))
    os.rename(os.path.join(stage, names[0]), os.path.join(out, names[0]))
    fsync_path(out)
    pointer = names[0] + "\n" if kind == "ours" else str(int(names[0][len("iter_") :]))  # as each saver writes it
    fsync_write(os.path.join(out, POINTER[kind]), pointer.encode())
    fsync_path(out)
