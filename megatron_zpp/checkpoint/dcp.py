"""--ckpt-format torch_dist (or torch_dcp): checkpoints written and read by torch.distributed.checkpoint.

The state dict is the single-rank model's, whatever the layout:

    {"model": {name: fp32 weight},                               # the masters, full shapes
     "optimizer": {"step": AdamW's step, "state": {name: {"exp_avg", "exp_avg_sq"}}},
     "rng": {"rank{r}": rank r's RNG streams},                    # read back at the same layout only
     "buffers": {name: persistent buffer}}                       # the routers' expert bias, whole

Each rank offers DCP the pieces of those tensors it holds, described by checkpoint/layout.py's
slots: a slot is a flat span of a TP piece (a whole parameter in plain DP, a part of one in a ZeRO
shard), cut here into boxes of the full tensor (a partial first row, whole rows, a partial last
row, recursively; a TP piece of fused sections (q|k|v, gate|up) splits further at the section
boundaries). DCP writes each box once (replicas, e.g. plain DP's or a TP-replicated norm's, are
de-duplicated by DCP) and, on load, reads each rank's boxes from wherever they were saved: the
load reshards across TP, PP, DP and the ZeRO stage. `dcp_to_torch_save` (torch's
format_utils) turns the directory into one torch.save file of full tensors.

Around DCP's files the directory is ours: written in iter_XXXXXXX.tmp/, sealed with meta.json
(the config, iteration, samples, each DCP file's sha256) and meta.json.sha256, then renamed and
named by `latest`, as the zpp format is (save.py). DCP's `.metadata` pickle is read by
pickled.SafeReader (DCP's classes only; no pickled code runs) after meta.json's sha256s are checked.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .files import DCP_FORMAT, CheckpointError, sha256_of, write_error
from .layout import RankLayout, Slot
from .pickled import SafeReader, dcp_load
from .pickled import single_process_quiet as _single_process_quiet

__all__ = ["DCP_FORMAT", "DCP_FORMATS", "Pieces", "load", "save", "state_dict_of"]
DCP_FORMATS = ("torch_dist", "torch_dcp")


class Pieces(torch.Tensor):
    """A tensor of `full` shape of which this rank holds some boxes: {offsets: tensor}. It speaks
    DCP's checkpointable protocol (the one DTensor implements: write items, chunk list, shard by
    index), so that DCP saves the boxes and loads into them in place; it has no data of its own."""

    @staticmethod
    def __new__(cls, boxes: dict[tuple, torch.Tensor], full: tuple):
        first = next(iter(boxes.values()))
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(full), dtype=first.dtype, device=first.device)
        self.boxes = {torch.Size(o): t for o, t in boxes.items()}
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Pieces holds checkpoint boxes only, not {func}")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size(),
                ),
            )
            for o, t in self.boxes.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[torch.Size(index.offset)]


def flat_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """The boxes (offsets, sizes, flat start) of a row-major tensor of `shape` that together are
    its flat range [lo, hi), in order: each is a contiguous run of that range."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)
    if r0 == r1:
        return [((r0, *o), (1, *z), r0 * inner + f) for o, z, f in flat_boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0, *o), (1, *z), r0 * inner + f) for o, z, f in flat_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:
        out += [((r1, *o), (1, *z), r1 * inner + f) for o, z, f in flat_boxes(shape[1:], 0, c1)]
    return out


def _in_full(s: Slot, offsets: tuple, sizes: tuple) -> list[tuple[tuple, int, int]]:
    """A box of the TP piece in the full tensor: (full offsets, start, length along the TP dim
    within the box) per part; one part unless the box crosses fused sections."""
    if s.tp_split is None or s.tp_size == 1:
        return [(offsets, 0, sizes[0] if sizes else 0)]
    dim, sections = s.tp_split
    out, local_start, full_start = [], 0, 0
    a, b = offsets[dim], offsets[dim] + sizes[dim]
    for section in sections:
        local = section // s.tp_size
        x0, x1 = max(a, local_start), min(b, local_start + local)
        if x0 < x1:
            full = full_start + s.tp_rank * local + (x0 - local_start)
            out.append(((*offsets[:dim], full, *offsets[dim + 1 :]), x0 - a, x1 - x0))
        local_start, full_start = local_start + local, full_start + section
    return out


def slot_boxes(s: Slot, span: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """{full offsets: view of `span`} for the slot `s`, `span` being its flat values (length hi - lo)."""
    out = {}
    for offsets, sizes, flat in flat_boxes(s.shape, s.start, s.start + s.hi - s.lo):
        box = span[flat - s.start : flat - s.start + math.prod(sizes)].view(sizes)
        dim = s.tp_split[0] if s.tp_split is not None and s.tp_size > 1 else 0
        for full, start, length in _in_full(s, offsets, sizes):
            out[full] = box if len(sizes) == 0 else box.narrow(dim, start, length)
    return out


def master_key(s: Slot) -> str:
    """The "model" tensor whose span [lo, hi) holds the slot's fp32 weight."""
    return s.master_key or s.key


def state_dict_of(
    lay: RankLayout, model: dict, optimizer: dict | None, rng: dict | None, rank: int, buffers: dict | None = None
) -> dict:
    """The DCP state dict of one rank: `model` (the engine's "model" dict), `optimizer` (AdamW's
    state_dict()["state"], or None) and `rng` as boxes of the single-rank tensors (views into them);
    `buffers` (persistent buffers by single-rank name, replicated on every rank of their stage) whole:
    DCP writes one copy of each."""
    weights: dict[str, tuple[tuple, dict]] = {}
    moments: dict[tuple[str, str], tuple[tuple, dict]] = {}
    for s in lay.slots:
        span = model[master_key(s)].reshape(-1)[s.lo : s.hi]
        weights.setdefault(s.name, (s.full_shape, {}))[1].update(slot_boxes(s, span))
        if optimizer:
            for k in ("exp_avg", "exp_avg_sq"):
                boxes = slot_boxes(s, optimizer[s.opt][k].reshape(-1))
                moments.setdefault((s.name, k), (s.full_shape, {}))[1].update(boxes)
    out: dict = {"model": {name: Pieces(boxes, full) for name, (full, boxes) in weights.items()}}
    if optimizer:
        state: dict = {}
        for (name, k), (full, boxes) in moments.items():
            state.setdefault(name, {})[k] = Pieces(boxes, full)
        step = next(iter(optimizer.values()))["step"]
        out["optimizer"] = {"step": torch.as_tensor(step).detach().clone().float().cpu(), "state": state}
    if rng:
        out["rng"] = {f"rank{rank}": rng}
    if buffers:
        out["buffers"] = dict(buffers)
    return out


def dcp_files(path: str) -> dict[str, str]:
    """{file: sha256} of the DCP files in `path` (its .metadata and data files)."""
    return {
        f: sha256_of(os.path.join(path, f)) for f in sorted(os.listdir(path)) if f.endswith((".distcp", ".metadata"))
    }


def check_files(path: str, meta: dict) -> None:
    """Every DCP file meta.json lists is there with its sha256, then the `.metadata` reads without running
    pickled code and names data files that are there in full (pickled.SafeReader)."""
    for name, digest in meta["files"].items():
        fpath = os.path.join(path, name)
        if not os.path.exists(fpath):
            raise CheckpointError(f"checkpoint file {fpath} is missing")
        if sha256_of(fpath) != digest:
            raise CheckpointError(
                f"checkpoint file {fpath} is corrupted or truncated: its sha256 does not match meta.json"
            )
    saved_keys(path)


def save(state: dict, tmp: str, group=None, alone: bool = False) -> None:
    """Collective (DCP plans the write over `group`, default the world's): every rank's boxes into `tmp`;
    `alone`: this process writes the whole state, whether or not a process group exists (a converter)."""
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    no_dist = alone or not torch.distributed.is_initialized()
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: it would escape `except Exception`
        raise _save_failure(e, tmp) from None


def _save_failure(e: CheckpointException, tmp: str) -> Exception:
    """What DCP's save failed of: the OSError of a failed write (a full disk: torch's zip writer says only
    "unexpected pos"), else a CheckpointError naming the first rank's error."""
    causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    for cause in causes:
        if isinstance(cause, BaseException) and (err := write_error(cause, tmp)) is not None:
            return err
    first = causes[0] if causes else e
    return CheckpointError(f"DCP could not save {tmp}: {type(first).__name__}: {str(first).strip()[-200:]}")


def writer_group(run):
    """Collective the first time (every rank saves at the same steps): a gloo group of the whole world for
    --async-save's DCP writes, whose collectives then run in the writer thread beside the training's own
    on other groups (as torchtitan's async checkpointing does); None without a process group."""
    if not torch.distributed.is_initialized():
        return None
    if run.saves.dcp_writer_group is None:
        run.saves.dcp_writer_group = torch.distributed.new_group(backend="gloo")
    return run.saves.dcp_writer_group


def saved_keys(path: str) -> dict[str, object]:
    """{flattened key: its DCP storage metadata} of a saved directory."""
    return dict(SafeReader(path).read_metadata().state_dict_metadata)


def load(state: dict, path: str) -> None:
    """Collective: DCP reads into the boxes of `state` (in place)."""
    dcp_load(state, path, no_dist=not torch.distributed.is_initialized())
