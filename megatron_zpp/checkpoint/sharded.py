"""Sharded checkpoints: every rank saves its own state; a run loads it at the same layout
(bitwise exact resume) or at any other (resharded: reshard.py).

Format of a checkpoint directory DIR:

    DIR/latest                 text: the name of the newest complete iteration dir
    DIR/iter_0000010/
        meta.json              {"format", "iteration", "consumed_samples", "padded_vocab_size", "world_size",
                                "layout": {tp, pp, cp, dp, zero_stage, vpp, ...},
                                "config": the full config dict, "files": {name: sha256}}
        rank_00000.safetensors ...  one per global rank: a nested dict stored as safetensors
                               (every tensor under its path in the dict, e.g.
                               "/model/unit3.layer2.master", "/optimizer/state/5/exp_avg"; the
                               rest, numbers, strings and the dict's shape, as JSON in the
                               header's "megatron_zpp" entry): nothing is ever unpickled, and a
                               rank reads only the tensors it asks for

A rank file holds {"iteration", "consumed_samples", "model", "optimizer", "rng"}:
* "model": PlainDP: {"chunk{c}.{param name}": tensor} and, for bf16, {"master.{i}": fp32 master};
  ZeroDP: {"unit{u}.{unit name}.master": fp32 master shard}. Not saved, because they are
  rebuilt: the training-dtype shard (the master's rounding, as after every step), ZeRO-3's
  freed full weights and hpZ's secondary shards (the next forward gather rebuilds them
  before any backward reads them);
* "optimizer": the torch AdamW state_dict (PlainDP's `optimizer.opt`, ZeroDP's `optimizer`);
* "rng": torch CPU state, device state (or absent), the tensor-parallel stream's states,
  numpy's and Python's global states (as tensors / lists).
A weights-only checkpoint (`save_weights`, e.g. imported from HF) has both of the last empty.

Saving is crash-safe: ranks write into DIR/iter_XXXXXXX.tmp/ (each file: write, fsync,
rename) and hash their own file; rank 0 gathers the digests, writes meta.json, renames the
directory to its final name and replaces `latest` atomically. A save interrupted at any
point leaves the previous `latest` and its directory intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import comm
from .rng import get_rng_state, set_rng_state

FORMAT = "megatron_zpp.sharded.v3"  # v2: ZeRO files hold the fp32 masters only; v3: safetensors


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or setting."""


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def layout_of(cfg) -> dict:
    """Everything that decides which tensor lives on which rank with which shape."""
    p, z = cfg.parallel, cfg.zero
    return {"world_size": p.world_size, "tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "cp": p.context_parallel_size, "dp": p.data_parallel_size, "order": p.order,
            "zero_stage": z.zero_stage, "vpp": p.num_layers_per_virtual_pipeline_stage,
            "first_stage_layers": p.decoder_first_pipeline_num_layers,
            "last_stage_layers": p.decoder_last_pipeline_num_layers,
            "zero_quantization_block_size": z.zero_quantization_block_size if z.zero_stage else None}


# ---- what one rank holds ------------------------------------------------------------------
def _model_state(run) -> dict:
    dp = run.dp
    if hasattr(dp, "units"):  # ZeroDP
        out = {}
        for i, u in enumerate(dp.units):
            out[f"unit{i}.{u.name}.master"] = u.master.detach().clone()
        return out
    out = {f"chunk{c}.{n}": p.detach().clone() for c, chunk in enumerate(run.chunks) for n, p in chunk.named_parameters()}
    for i, (p, m) in enumerate(zip(dp.optimizer.params, dp.optimizer.masters)):
        if m is not p:  # bf16: the fp32 master is the real weight
            out[f"master.{i}"] = m.detach().clone()
    return out


def _copy_into(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"shape mismatch for {name}: checkpoint has {tuple(src.shape)}, "
                              f"the model has {tuple(dst.shape)}")
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


@torch.no_grad()
def _load_model_state(run, state: dict) -> None:
    dp = run.dp
    if hasattr(dp, "units"):
        mine = {f"unit{i}.{u.name}": u for i, u in enumerate(dp.units)}
        _check_keys(set(state), {f"{k}.master" for k in mine})
        for key, u in mine.items():
            # in place: the optimizer's segment views alias unit.master (and ZeRO-3 fp32 shard == master)
            _copy_into(f"{key}.master", u.master, state[f"{key}.master"])
            u.set_shard(u.master)  # the rounded shard; stages 1-2 all-gather the full weights, 3 stay released
        return
    params = {f"chunk{c}.{n}": p for c, chunk in enumerate(run.chunks) for n, p in chunk.named_parameters()}
    masters = {f"master.{i}": m for i, (p, m) in enumerate(zip(dp.optimizer.params, dp.optimizer.masters)) if m is not p}
    _check_keys(set(state), set(params) | set(masters))
    for name, t in {**params, **masters}.items():
        _copy_into(name, t.data, state[name])


def _check_keys(got: set, want: set) -> None:
    if got != want:
        raise CheckpointError(f"checkpoint tensors do not match the model: missing {sorted(want - got)[:5]}, "
                              f"unexpected {sorted(got - want)[:5]}")


def _optimizer(run):
    return run.dp.optimizer.opt if hasattr(run.dp.optimizer, "opt") else run.dp.optimizer


# ---- files --------------------------------------------------------------------------------
def _fsync_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_path(path: str) -> None:
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


def _start(directory: str, iteration: int) -> tuple[str, str]:
    """(final, tmp): the iteration dir and the one its files are written in first."""
    final = os.path.join(directory, iter_name(iteration))
    return final, final + ".tmp"


def _fresh_dir(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
    os.makedirs(tmp)


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


def _write_rank_file(tmp: str, rank: int, state: dict) -> str:
    """Write one rank's file (fsynced, renamed into place); its sha256."""
    path = os.path.join(tmp, rank_file(rank))
    tensors, skeleton = _flatten(state)
    save_file(tensors, path + ".tmp", metadata={"megatron_zpp": json.dumps(skeleton)})
    _fsync_path(path + ".tmp")
    os.replace(path + ".tmp", path)
    return sha256_of(path)  # read back from the page cache


def _seal(directory: str, final: str, tmp: str, cfg, iteration: int, consumed: int, padded_vocab: int,
          digests: list[str]) -> None:
    """Write meta.json (with every rank file's sha256), rename tmp to final, then point
    `latest` at it."""
    files = {rank_file(r): d for r, d in enumerate(digests)}
    world = cfg.parallel.world_size
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed,
            "padded_vocab_size": padded_vocab, "world_size": world, "layout": layout_of(cfg),
            "config": cfg.to_dict(), "files": files}
    _fsync_write(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())
    _fsync_path(tmp)
    if os.path.exists(final):  # saved this iteration before: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(directory)
    _fsync_write(os.path.join(directory, "latest"), (os.path.basename(final) + "\n").encode())
    _fsync_path(directory)


def save_checkpoint(run, directory: str) -> str:
    """Collective: every rank writes its file; rank 0 seals the directory and `latest`."""
    final, tmp = _start(directory, run.iteration)
    if run.rank == 0:
        _fresh_dir(tmp)
    comm.barrier()
    digest = _write_rank_file(tmp, run.rank, {"iteration": run.iteration, "consumed_samples": run.consumed_samples,
                                              "model": _model_state(run), "optimizer": _optimizer(run).state_dict(),
                                              "rng": get_rng_state()})
    # each rank hashed its own file; rank 0 collects the digests (also: every file is written)
    world = run.groups.world
    digests = torch.zeros(world.size, 32, dtype=torch.uint8, device=run.device)
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=run.device).view(1, 32)
    comm.all_gather(digests, mine, world, "checkpoint_digests")
    if run.rank == 0:
        _seal(directory, final, tmp, run.cfg, run.iteration, run.consumed_samples, run.tokenizer.padded_vocab_size,
              [bytes(d.tolist()).hex() for d in digests.cpu()])
    comm.barrier()
    return final


def save_weights(directory: str, cfg, weights: dict[str, torch.Tensor]) -> str:
    """A weights-only checkpoint (iteration 0, no optimizer state, no RNG) of single-rank fp32
    `weights`, as a 1-rank plain-DP layout of `cfg`; `--load` reshards it to any layout and
    starts a fresh optimizer. For importers (tools/convert_checkpoint.py --from hf)."""
    if cfg.parallel.world_size != 1 or cfg.zero.zero_stage or cfg.train.bf16:
        raise ValueError("save_weights writes a 1-rank fp32 plain-DP layout: pass such a config")
    final, tmp = _start(directory, 0)
    _fresh_dir(tmp)
    digest = _write_rank_file(tmp, 0, {"iteration": 0, "consumed_samples": 0, "optimizer": {}, "rng": {},
                                       "model": {f"chunk0.{n}": t.float().contiguous() for n, t in weights.items()}})
    _seal(directory, final, tmp, cfg, 0, 0, weights["embedding.weight"].shape[0], [digest])
    return final


def read_meta(directory: str, iteration: int | None = None) -> tuple[str, dict] | None:
    """(iteration dir, meta) of the checkpoint `latest` names, or of `iteration`; None when
    `directory` holds no `latest` (and no iteration is asked for)."""
    latest = os.path.join(directory, "latest")
    if iteration is not None:
        path, named_by = os.path.join(directory, iter_name(iteration)), f"--ckpt-step {iteration}"
        if not os.path.isdir(path):
            have = sorted(d for d in os.listdir(directory) if d.startswith("iter_") and not d.endswith(".tmp")) \
                if os.path.isdir(directory) else []
            raise CheckpointError(f"{named_by}: {path} does not exist (saved iterations in {directory}: "
                                  f"{', '.join(have) or 'none'})")
    elif not os.path.exists(latest):
        return None
    else:
        with open(latest) as f:
            path, named_by = os.path.join(directory, f.read().strip()), latest
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{named_by} names {path}, which has no meta.json (incomplete checkpoint)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: unknown format {meta.get('format')!r} (expected {FORMAT})")
    return path, meta


def layout_changes(meta: dict, cfg) -> list[str]:
    """How this run's layout differs from the checkpoint's ([] when it is the same)."""
    saved, now = meta["layout"], layout_of(cfg)
    changed = [k for k in now if saved.get(k) != now[k]]
    if "zero_stage" in changed:  # the block size only matters when both sides shard: not news here
        changed = [k for k in changed if k != "zero_quantization_block_size"]
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in changed]


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
        raise CheckpointError(f"checkpoint file {fpath} is corrupted or truncated: its sha256 does not match "
                              f"meta.json")
    return RankFile(fpath, device)


def read_rank_file(path: str, meta: dict, rank: int, map_location="cpu") -> dict:
    """One rank's file as the nested dict that was saved (checked, nothing unpickled)."""
    return open_rank_file(path, meta, rank, map_location).state()


def load_checkpoint(run, directory: str, iteration: int | None = None) -> str | None:
    """Restore this rank's model, optimizer, RNG, iteration and consumed samples from the
    checkpoint `latest` names (or that of `iteration`), saved at this layout or (resharded)
    at any other. Returns what was restored, in words; None (and nothing changed) when
    there is no checkpoint."""
    found = read_meta(directory, iteration)
    if found is None:
        return None
    path, meta = found
    from .reshard import SavedCheckpoint, check_same_model, rank_state_for
    vocab = run.tokenizer.padded_vocab_size
    check_same_model(path, meta, run.cfg, vocab)
    changes = layout_changes(meta, run.cfg)
    if changes:
        saved = SavedCheckpoint(path, meta)
        dtype = torch.bfloat16 if run.cfg.train.bf16 else torch.float32
        state = rank_state_for(saved, run.cfg, vocab, run.rank, dtype)
        _load_model_state(run, {k: v.to(run.device) for k, v in state["model"].items()})
        opt = _optimizer(run)
        opt.load_state_dict({"state": state["optimizer_state"], "param_groups": opt.state_dict()["param_groups"]})
        run.resharded_from = changes  # RNG states stay this run's fresh seeds: they belong to ranks
        has_optimizer = saved.step is not None
        how = f"resharded ({', '.join(changes)}); RNG streams start from this layout's seeds"
    else:
        state = read_rank_file(path, meta, run.rank, map_location=run.device)
        _load_model_state(run, state["model"])
        has_optimizer = bool(state["optimizer"])  # a weights-only checkpoint (save_weights) has neither
        if has_optimizer:
            _optimizer(run).load_state_dict(state["optimizer"])
        if state["rng"]:
            set_rng_state(state["rng"])
        how = "same layout"
    run.iteration, run.consumed_samples = int(meta["iteration"]), int(meta["consumed_samples"])
    what = "weights and AdamW state" if has_optimizer else "weights only (the checkpoint has no optimizer state)"
    return f"{path}: iteration {run.iteration}, {run.consumed_samples} samples consumed; {how}; {what}"
