"""Sharded checkpoints: every rank saves its own state; a run loads it at the same layout
(bitwise exact resume) or at any other (resharded: reshard.py). The file codec and
meta.json live in files.py.

Format of a checkpoint directory DIR:

    DIR/latest                 text: the name of the newest complete iteration dir
    DIR/iter_0000010/
        meta.json              {"format", "iteration", "consumed_samples", "padded_vocab_size", "world_size",
                                "layout": {tp, pp, cp, dp, zero_stage, vpp, ...},
                                "config": the full config dict, "files": {name: sha256},
                                "tracking": run metadata that follows the run, e.g. {"wandb_run_id"}}
        rank_00000.safetensors ...  one per global rank: a nested dict stored as safetensors
                               (every tensor under its path in the dict, e.g.
                               "/model/unit3.layer2.master", "/optimizer/state/5/exp_avg"; the
                               rest, numbers, strings and the dict's shape, as JSON in the
                               header's "megatron_zpp" entry): nothing is ever unpickled, and a
                               rank reads only the tensors it asks for

A rank file holds {"rank", "iteration", "consumed_samples", "layout", "model", "optimizer", "rng"}
(the first four cross-checked against meta.json on every read; meta.json's own sha256 is in
meta.json.sha256 beside it):
* "model", "optimizer": the data-parallel engine's state dict (zero/engine.py): plain DP
  {"chunk{c}.{param name}": tensor} and, for bf16, {"master.{i}": fp32 master}; ZeRO
  {"unit{u}.{unit name}.master": fp32 master shard} (the training-dtype shard, ZeRO-3's
  freed full weights and hpZ's secondary shards are rebuilt, so not saved); and the torch
  AdamW state_dict;
* "rng": torch CPU state, device state (or absent), the tensor-parallel stream's states,
  numpy's and Python's global states (as tensors / lists).
A weights-only checkpoint (`save_weights`, e.g. imported from HF) has both of the last empty.

Saving is crash-safe: ranks write into DIR/iter_XXXXXXX.tmp/ (each file: write, fsync,
rename) and hash their own file; rank 0 gathers the digests, writes meta.json, renames the
directory to its final name and replaces `latest` atomically. A save interrupted at any
point leaves the previous `latest` and its directory intact.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import comm
from ..logging_utils import log
from ..zero import engine_class
from . import dcp
from .async_save import SaveJob, host_snapshot
from .dcp import DCP_FORMATS
from .files import (
    DCP_FORMAT,
    FORMAT,
    CheckpointError,
    fsync_path,
    fsync_write,
    iter_name,
    legacy_warning,
    locate_checkpoint,
    meta_train_fields,
    nonfinite_tensors,
    rank_file,
    read_latest,
    read_rank_file,
    save_failure,
    train_state_of,
    write_meta,
    write_rank_file,
)
from .layout import rank_layout
from .reshard import SavedCheckpoint, check_same_model, rank_state_for
from .rng import get_rng_state

if TYPE_CHECKING:  # for the annotations only
    from ..config import Config
    from ..topology import ProcessGroups
    from ..zero import DataParallelEngine


def layout_of(cfg) -> dict:
    """Everything that decides which tensor lives on which rank with which shape."""
    p = cfg.parallel
    layout = {
        "world_size": p.world_size,
        "tp": p.tensor_model_parallel_size,
        "pp": p.pipeline_model_parallel_size,
        "cp": p.context_parallel_size,
        "dp": p.data_parallel_size,
        "order": p.order,
        "zero_stage": None,  # these two are the engine's (layout_key); here for their place in meta.json
        "vpp": p.num_layers_per_virtual_pipeline_stage,
        "first_stage_layers": p.decoder_first_pipeline_num_layers,
        "last_stage_layers": p.decoder_last_pipeline_num_layers,
        "zero_quantization_block_size": None,
    }
    layout.update(engine_class(cfg).layout_key(cfg))
    return layout


def layout_changes(meta: dict, cfg) -> list[str]:
    """How this run's layout differs from the checkpoint's ([] when it is the same)."""
    saved, now = meta["layout"], layout_of(cfg)
    changed = [k for k in now if saved.get(k) != now[k]]
    if "zero_stage" in changed:  # the block size only matters when both sides shard: not news here
        changed = [k for k in changed if k != "zero_quantization_block_size"]
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in changed]


# ---- save ---------------------------------------------------------------------------------
def _rank_state(run, host: bool) -> dict:
    """What this rank saves: a snapshot of the weights (the live tensors go on changing), and of
    everything in host memory when `host` (--async-save: written later, from a thread).
    --no-save-optim and --no-save-rng leave their entries empty, as in a weights-only save."""
    state, t = run.dp.state_dict(), run.cfg.train
    optimizer = state["optimizer"] if t.save_optim else {}
    return {
        "rank": run.rank,  # these three are cross-checked against meta.json on every read (files.py)
        "iteration": run.state.iteration,
        "consumed_samples": run.state.consumed_samples,
        "layout": layout_of(run.cfg),
        "model": host_snapshot(state["model"], run.device)
        if host
        else {k: t.detach().clone() for k, t in state["model"].items()},
        "optimizer": host_snapshot(optimizer, run.device) if host else optimizer,
        "rng": get_rng_state() if t.save_rng else {},
    }


def _start(directory: str, iteration: int) -> tuple[str, str]:
    """(final, tmp): the iteration dir and the one its files are written in first."""
    final = os.path.join(directory, iter_name(iteration))
    return final, final + ".tmp"


def _fresh_dir(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
    os.makedirs(tmp)


def _seal(
    directory: str,
    final: str,
    tmp: str,
    cfg,
    iteration: int,
    consumed: int,
    padded_vocab: int,
    files: dict[str, str],
    tracking: dict | None = None,
    train_state: dict | None = None,
    fmt: str = FORMAT,
) -> None:
    """Write meta.json (with every file's sha256, the run's `tracking` metadata and its
    `train_state`: the loss scaler and skipped steps), rename tmp to final, then point `latest` at it."""
    world = cfg.parallel.world_size
    meta = {
        "format": fmt,
        "iteration": iteration,
        "consumed_samples": consumed,
        "padded_vocab_size": padded_vocab,
        "world_size": world,
        "layout": layout_of(cfg),
        "config": cfg.to_dict(),
        "files": files,
        "tracking": dict(tracking or {}),
    }
    if train_state:
        meta["train_state"] = train_state
    write_meta(tmp, meta)
    fsync_path(tmp)
    if os.path.exists(final):  # saved this iteration before: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(directory)
    fsync_write(os.path.join(directory, "latest"), (os.path.basename(final) + "\n").encode())
    fsync_path(directory)


def save_checkpoint(run, directory: str) -> str:
    """Collective: every rank writes its file; rank 0 seals the directory and `latest`. A save that
    fails anywhere (a non-finite tensor, an OSError such as a full disk) fails on every rank with
    one line, `latest` left where it was. With --async-save the files are written by a thread from
    a host copy and the save is sealed by finish_async_save (at the next save, or at exit)."""
    finish_async_save(run)  # the previous one first: every rank, in the same order
    final, tmp = _start(directory, run.state.iteration)
    problem = _os_problem(lambda: _fresh_dir(tmp), run.state.iteration, directory) if run.rank == 0 else None
    _agree_saved(run, problem, directory, tmp)  # also: tmp exists before any rank writes into it
    background = run.cfg.train.async_save
    state = _rank_state(run, host=background)
    at = meta_train_fields(run.state.state_dict())  # taken now: the run moves on while a background save writes
    job = SaveJob(
        directory, final, tmp, at["iteration"], at["consumed_samples"], run.tokenizer.padded_vocab_size,
        at["tracking"], at.get("train_state", {}),
    )  # fmt: skip
    if background:  # the check for non-finite tensors too runs behind the training, on the host copy
        if run.cfg.train.ckpt_format in DCP_FORMATS:  # DCP's collectives on a group of their own
            sd, group = _dcp_state(run, job, state), dcp.writer_group(run)
            job.write_in_background(lambda: _check_and_save_dcp(job, state, sd, group))
        else:
            job.write_in_background(lambda: _check_and_write(job, state))
        run.saves.pending = job
        return final
    job.bad = nonfinite_tensors(state)
    if run.cfg.train.ckpt_format in DCP_FORMATS:
        _save_dcp(run, job, state)
        return final
    if not job.bad:  # a file with a non-finite tensor is not written, and no rank seals the save
        written = []
        write = lambda: written.append(write_rank_file(tmp, run.rank, state))  # noqa: E731
        job.problem = _os_problem(write, job.iteration, directory)
        job.digest = written[0] if written else job.digest
    _complete_save(run, job)
    return final


def _check_and_write(job: SaveJob, state: dict) -> str:
    """--async-save's thread: this rank's file, unless a tensor is non-finite (then no rank seals the save)."""
    job.bad = nonfinite_tensors(state)
    return job.digest if job.bad else write_rank_file(job.tmp, state["rank"], state)


def _check_and_save_dcp(job: SaveJob, state: dict, sd: dict, group) -> str:
    """--async-save's thread, torch_dist: DCP writes every rank's boxes (a collective over `group`, so every
    rank writes, whatever it holds); a non-finite tensor anywhere keeps the save unsealed (_complete_save)."""
    job.bad = nonfinite_tensors(state)
    dcp.save(sd, job.tmp, group)
    return job.digest


def finish_async_save(run) -> str | None:
    """Collective (every rank, at the same points): wait for this rank's --async-save write in flight,
    then seal that save as a synchronous one is sealed. Its iteration dir, or None when none was in flight."""
    job = run.saves.pending
    if job is None:
        return None
    run.saves.pending = None
    job.wait()
    _complete_save(run, job, run.cfg.train.ckpt_format in DCP_FORMATS)
    log(f"saved checkpoint {job.final} (written in the background, --async-save)", run.rank)
    return job.final


def _complete_save(run, job: SaveJob, by_dcp: bool = False) -> None:
    """Every rank's digest and status to every rank; rank 0 seals the save if every file was written
    (`by_dcp`: an --async-save of --ckpt-format torch_dist, sealed with DCP's files)."""
    world = run.groups.world
    digests = torch.zeros(world.size, 33, dtype=torch.uint8, device=run.device)
    status = 1 if job.bad else 2 if job.problem else 0
    mine = torch.tensor([*bytes.fromhex(job.digest), status], dtype=torch.uint8, device=run.device).view(1, 33)
    comm.all_gather(digests, mine, world, "checkpoint_digests")
    statuses = [int(d[32]) for d in digests.cpu()]
    if 1 in statuses:
        _refuse_nonfinite(run, job, [r for r, v in enumerate(statuses) if v == 1])
    if 2 in statuses:
        failed = [r for r, v in enumerate(statuses) if v == 2]
        _agree_saved(run, job.problem or f"rank(s) {failed} could not write their files", job.directory, job.tmp)
    problem = None
    if run.rank == 0:
        digests_hex = [bytes(d[:32].tolist()).hex() for d in digests.cpu()]
        files = dcp.dcp_files(job.tmp) if by_dcp else {rank_file(r): d for r, d in enumerate(digests_hex)}
        seal = lambda: _seal_run(run, job, files, DCP_FORMAT if by_dcp else FORMAT)  # noqa: E731
        problem = _os_problem(seal, job.iteration, job.directory)
    _agree_saved(run, problem, job.directory, job.tmp)
    run.saves.last = job.final


def _seal_run(run, job: SaveJob, files: dict[str, str], fmt: str = FORMAT) -> None:
    d, cfg = job.directory, run.cfg
    previous = _latest_iteration(d)
    at = (job.iteration, job.consumed, job.padded_vocab)
    _seal(d, job.final, job.tmp, cfg, *at, files, job.tracking, job.train_state, fmt)
    retain = cfg.train.save_retain_interval
    if retain and previous and previous != job.iteration and previous % retain:
        # Megatron's --save-retain-interval: the checkpoint `latest` named before goes once a newer one is complete
        shutil.rmtree(os.path.join(d, iter_name(previous)), ignore_errors=True)
        log(f"--save-retain-interval {retain}: deleted {os.path.join(d, iter_name(previous))}", run.rank)


def _save_dcp(run, job: SaveJob, state: dict) -> None:
    """--ckpt-format torch_dist: every rank's boxes through DCP into tmp (a collective, so every rank
    first learns whether any holds a non-finite tensor); rank 0 hashes DCP's files and seals."""
    problem = None
    if job.bad:
        problem = (
            f"refused to save iteration {job.iteration}: {len(job.bad)} non-finite tensors, the first {job.bad[0]}"
        )
    _agree_saved(run, problem, job.directory, job.tmp)
    sd = _dcp_state(run, job, state)
    try:
        dcp.save(sd, job.tmp)
    except OSError as e:  # a full disk (dcp.save names DCP's failed write so)
        problem = save_failure(e, job.iteration, job.directory)
    except Exception as e:  # noqa: BLE001  (DCP raises on every rank alike)
        problem = f"cannot save iteration {job.iteration} to {job.directory}: {type(e).__name__}: {e}"
    _agree_saved(run, problem, job.directory, job.tmp)
    if run.rank == 0:
        seal = lambda: _seal_run(run, job, dcp.dcp_files(job.tmp), DCP_FORMAT)  # noqa: E731
        problem = _os_problem(seal, job.iteration, job.directory)
    _agree_saved(run, problem, job.directory, job.tmp)
    run.saves.last = job.final


def _dcp_state(run, job: SaveJob, state: dict) -> dict:
    """This rank's state as DCP's state dict: boxes of the single-rank model's tensors."""
    lay = rank_layout(run.cfg, job.padded_vocab, run.rank)
    moments = state["optimizer"].get("state") if state["optimizer"] else None
    return dcp.state_dict_of(lay, state["model"], moments or None, state["rng"] or None, run.rank)


def _latest_iteration(directory: str) -> int | None:
    """The iteration `latest` names now (None when there is none or it names no iteration dir)."""
    try:
        return int(read_latest(directory)[len("iter_") :])
    except CheckpointError:
        return None


def _os_problem(action, iteration: int, directory: str) -> str | None:
    """Run `action`; an OSError (full disk, read-only file system) as one line, else None."""
    try:
        action()
    except OSError as e:
        return save_failure(e, iteration, directory)
    return None


def _kept(directory: str) -> str:
    kept = _latest_iteration(directory)
    return f"{os.path.join(directory, 'latest')} still names {'no checkpoint' if kept is None else iter_name(kept)}"


def _agree_saved(run, problem: str | None, directory: str, tmp: str) -> None:
    """Every rank learns whether any rank's part of the save failed (one all-reduce every rank issues);
    then all raise CheckpointError, rank 0 having removed the unfinished directory."""
    flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=run.device)
    comm.all_reduce(flag, run.groups.world, "checkpoint_save", op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(f"{problem or 'another rank could not save (its line says why)'}; {_kept(directory)}")


def _refuse_nonfinite(run, job: SaveJob, flagged: list[int]) -> None:
    """No rank seals a save in which any rank holds a non-finite tensor: `latest` stays where it was."""
    comm.barrier()  # every rank is done with tmp
    if run.rank == 0:
        shutil.rmtree(job.tmp, ignore_errors=True)
    bad = job.bad
    mine = f"{len(bad)} non-finite tensors here, the first {bad[0]}" if bad else f"non-finite on ranks {flagged}"
    raise CheckpointError(
        f"refused to save iteration {job.iteration} to {job.directory}: {mine}; {_kept(job.directory)}"
    )


def save_weights(directory: str, cfg, weights: dict[str, torch.Tensor]) -> str:
    """A weights-only checkpoint (iteration 0, no optimizer state, no RNG) of single-rank fp32
    `weights`, as a 1-rank plain-DP layout of `cfg`; `--load` reshards it to any layout and
    starts a fresh optimizer. For importers (tools/convert_checkpoint.py --from hf)."""
    if cfg.parallel.world_size != 1 or cfg.zero.zero_stage or cfg.train.bf16 or cfg.train.fp16:
        raise ValueError("save_weights writes a 1-rank fp32 plain-DP layout: pass such a config")
    final, tmp = _start(directory, 0)
    _fresh_dir(tmp)
    model = {f"chunk0.{n}": t.float().contiguous() for n, t in weights.items()}
    state = {"rank": 0, "iteration": 0, "consumed_samples": 0, "layout": layout_of(cfg), "model": model}
    digest = write_rank_file(tmp, 0, {**state, "optimizer": {}, "rng": {}})
    _seal(directory, final, tmp, cfg, 0, 0, weights["embedding.weight"].shape[0], {rank_file(0): digest})
    return final


def save_full_dcp(
    directory: str, cfg, weights: dict, moments: dict | None, step: float | None, iteration: int, consumed: int
) -> str:
    """A --ckpt-format torch_dist checkpoint, written in this one process, of single-rank fp32 `weights`,
    AdamW's `moments` ({name: {"exp_avg", "exp_avg_sq"}}) and `step` (None: weights only), at `iteration`
    with `consumed` samples; `--load` reshards it to any layout. For importers (tools/convert_checkpoint.py
    --from megatron)."""
    final, tmp = _start(directory, iteration)
    _fresh_dir(tmp)
    state: dict = {"model": {n: t.float().contiguous() for n, t in weights.items()}}
    if moments:
        state["optimizer"] = {"step": torch.tensor(float(step or 0)), "state": moments}
    dcp.save(state, tmp, alone=True)
    vocab = weights["embedding.weight"].shape[0]
    _seal(directory, final, tmp, cfg, iteration, consumed, vocab, dcp.dcp_files(tmp), fmt=DCP_FORMAT)
    return final


# ---- load ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadTarget:
    """What a load restores into and checks against: this rank's engine (it takes the model and optimizer
    state), the config, the groups (every rank agrees), the device and the padded vocabulary."""

    cfg: Config
    groups: ProcessGroups
    device: torch.device
    dp: DataParallelEngine
    padded_vocab_size: int

    @property
    def rank(self) -> int:
        return self.groups.rank


@dataclass(frozen=True)
class Restored:
    """What load_checkpoint restored beyond the engine's state: the train state (training/state.py's
    TrainState.state_dict(); {} after a finetune load: a fresh one), the RNG streams to set right before
    the first step (None: this run's seeds), and what the run says about the load."""

    path: str  # the iteration dir
    description: str  # in words, for the log
    train_state: dict
    rng_state: dict | None
    resharded_from: list[str] | None  # the layout changes a resharded load went through
    warning: str | None  # a load that worked but is worth one line (a legacy, unverified meta.json)


def _check_tensors(target: LoadTarget, path: str, meta: dict, model: dict) -> None:
    """A same-layout load takes the tensors as saved: their keys and shapes must be this layout's,
    and their dtype too when the checkpoint trained in this run's dtype (never silently upcast)."""
    live = target.dp.model_state_dict()
    fpath = f"{path}/{rank_file(target.rank)}"
    if set(model) != set(live):
        missing, extra = sorted(set(live) - set(model)), sorted(set(model) - set(live))
        raise CheckpointError(f"{fpath}: tensors do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    saved_train = meta["config"].get("train", {})
    same_dtype = (saved_train.get("bf16"), saved_train.get("fp16")) == (target.cfg.train.bf16, target.cfg.train.fp16)
    for key, t in model.items():
        if tuple(t.shape) != tuple(live[key].shape):
            raise CheckpointError(
                f"{fpath}: /model/{key} has shape {tuple(t.shape)}, this layout's is {tuple(live[key].shape)}"
            )
        if same_dtype and t.dtype != live[key].dtype:
            raise CheckpointError(
                f"{fpath}: /model/{key} is {str(t.dtype).replace('torch.', '')}, "
                f"this layout saves {str(live[key].dtype).replace('torch.', '')} (the file was rewritten?)"
            )


def _agree(target: LoadTarget, error: CheckpointError | None) -> None:
    """Every rank learns whether any rank could not read its part (one all-reduce every rank issues,
    before any collective of the restore), so all of them stop, each with a line, none waiting."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=target.device)
    comm.all_reduce(flag, target.groups.world, "checkpoint_load", op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item():
        raise CheckpointError("another rank could not load the checkpoint (its line says why)")


def _restore(target: LoadTarget, path: str, state: dict) -> None:
    """Hand the engine its state; a mismatch is the checkpoint's fault, named with its path."""
    try:
        target.dp.load_state_dict(
            {"model": {k: v.to(target.device) for k, v in state["model"].items()}, "optimizer": state.get("optimizer")}
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _read_state(target: LoadTarget, path: str, meta: dict, weights_only: bool) -> tuple[dict, str, bool]:
    """(this rank's state to restore, how it was read, whether it has AdamW state), checked; with
    `weights_only` (--no-load-optim, --finetune) the AdamW state is not read (moments) or dropped."""
    vocab = target.padded_vocab_size
    check_same_model(path, meta, target.cfg, vocab)
    changes = layout_changes(meta, target.cfg)
    if changes:
        saved = SavedCheckpoint(path, meta)
        has_optimizer = saved.step is not None
        if weights_only:
            saved.step = None  # the fp32 masters only
        dtype = torch.float16 if target.cfg.train.fp16 else torch.bfloat16 if target.cfg.train.bf16 else torch.float32
        state = rank_state_for(saved, target.cfg, vocab, target.rank, dtype)
        how = f"resharded ({', '.join(changes)}); RNG streams start from this layout's seeds"
        optimizer = {} if weights_only else {"state": state["optimizer_state"]}
        return {"model": state["model"], "optimizer": optimizer}, how, has_optimizer
    state = read_rank_file(path, meta, target.rank, map_location=target.device)
    _check_tensors(target, path, meta, state["model"])
    has_optimizer = bool(state["optimizer"])  # a weights-only checkpoint (save_weights, --no-save-optim) has none
    if weights_only:
        state["optimizer"] = {}
    return state, "same layout", has_optimizer


def _prepare_dcp(target: LoadTarget, path: str, meta: dict, weights_only: bool):
    """A torch_dist checkpoint: checked (sha256s, every tensor's saved shape), and the buffers DCP
    will fill; returns (the collective load to run once every rank agreed, how, has AdamW state)."""
    vocab, rank = target.padded_vocab_size, target.rank
    check_same_model(path, meta, target.cfg, vocab)
    dcp.check_files(path, meta)
    saved = dcp.saved_keys(path)
    lay = rank_layout(target.cfg, vocab, rank)
    for s in lay.slots:
        got = getattr(saved.get(f"model.{s.name}"), "size", None)
        if got is None or tuple(got) != tuple(s.full_shape):  # the padded vocabulary is named where it matters
            vocab = s.name in ("embedding.weight", "output.weight")
            raise CheckpointError(f"{path}: holds no model.{s.name}, which this run's model has" if got is None else
                                  f"{path}: model.{s.name} is saved as {tuple(got)}, this run's {tuple(s.full_shape)}"
                                  + (" (torch_dist reshards at the same padded vocabulary: "
                                     "--make-vocab-size-divisible-by x TP)" if vocab else ""))  # fmt: skip
    has_optimizer = "optimizer.step" in saved
    changes = layout_changes(meta, target.cfg)
    dtype = torch.float16 if target.cfg.train.fp16 else torch.bfloat16 if target.cfg.train.bf16 else torch.float32
    model = {k: torch.zeros(shape, dtype=torch.float32 if m else dtype) for k, (shape, m) in lay.tensors.items()}
    moments = None
    if has_optimizer and not weights_only:
        moments = {j: {"step": torch.zeros(()), "exp_avg": torch.zeros(sh), "exp_avg_sq": torch.zeros(sh)}
                   for j, sh in enumerate(lay.opt_shapes)}  # fmt: skip
    rng_saved = any(k.startswith(f"rng.rank{rank}.") for k in saved)
    rng = get_rng_state() if rng_saved and not changes else None  # the structure DCP fills
    sd = dcp.state_dict_of(lay, model, moments, rng, rank)

    def finish() -> dict:
        dcp.load(sd, path)
        for s in lay.slots:  # plain DP in 16 bits: the training-dtype weight from its fp32 master
            if s.master_key:
                model[s.key].copy_(model[s.master_key])
        for state in (moments or {}).values():
            state["step"] = sd["optimizer"]["step"].clone()
        return {
            "model": model,
            "optimizer": {"state": moments} if moments else {},
            "rng": sd.get("rng", {}).get(f"rank{rank}"),
        }

    if changes:
        how = f"torch_dist, resharded by DCP ({', '.join(changes)}); RNG streams start from this layout's seeds"
    else:
        how = "torch_dist, same layout"
    return finish, how, has_optimizer


def _what_loaded(t, finetune: bool, has_optimizer: bool, has_rng: bool) -> str:
    """The load's words for the optimizer, the RNG and the position, after the flags that skip them."""
    if finetune:
        return "weights only (finetune: AdamW starts fresh from them, iteration and samples consumed reset to 0)"
    if not t.load_optim:
        what = "weights only (--no-load-optim: AdamW starts fresh from them)"
    else:
        what = "weights and AdamW state" if has_optimizer else "weights only (the checkpoint has no optimizer state)"
    if has_rng and not t.load_rng:
        what += "; RNG states not loaded (--no-load-rng: this run's seeds)"
    return what


def load_checkpoint(
    target: LoadTarget, directory: str, iteration: int | None = None, finetune: bool | None = None
) -> Restored | None:
    """Restore this rank's model and optimizer (into `target.dp`) from the checkpoint `directory`
    names (files.locate_checkpoint: an iteration dir, or the one `latest` or `iteration` names in a
    root), saved at this layout or (resharded) at any other, and return the rest of what it restored:
    the train state (iteration, samples consumed, loss scaler, ...) and the RNG streams; None (and
    nothing changed) when there is no checkpoint. Every rank reads and checks its part first; if any
    cannot, all raise CheckpointError. --no-load-optim, --no-load-rng and --finetune (neither, and
    iteration 0; `finetune` overrides it: --pretrained-checkpoint) skip their parts."""
    t = target.cfg.train
    finetune = t.finetune if finetune is None else finetune
    found, error = None, None
    try:
        found = locate_checkpoint(directory, iteration)
        if found:
            read = _prepare_dcp if found[1]["format"] == DCP_FORMAT else _read_state
            state, how, has_optimizer = read(target, *found, weights_only=finetune or not t.load_optim)
    except CheckpointError as e:
        error = e
    _agree(target, error)
    if found is None:
        return None
    path, meta = found
    if callable(state):  # torch_dist: DCP's collective read, every rank having checked its part
        state = state()
    _restore(target, path, state)
    rng = state.get("rng") or None
    # as Megatron: a finetune starts at iteration 0, a fresh W&B run, a fresh loss scale; the loss scaler
    # is the optimizer's (--no-load-optim: a fresh one)
    train_state = {} if finetune else train_state_of(meta, with_loss_scaler=t.load_optim)
    what = _what_loaded(t, finetune, has_optimizer, rng is not None)
    if t.override_ckpt_iteration is not None:  # Megatron's: the data replays from that iteration on
        at = t.override_ckpt_iteration
        assert t.global_batch_size is not None  # validation resolves it
        train_state.update(iteration=at, skipped_samples=0, consumed_samples=at * t.global_batch_size)
        what += f"; --override-ckpt-iteration {at}: {train_state['consumed_samples']} samples consumed"
    at, consumed = train_state.get("iteration", 0), train_state.get("consumed_samples", 0)
    batch = t.global_batch_at(consumed)  # a ramp-up resumes at its batch size
    return Restored(
        path,
        f"{path}: iteration {at}, {consumed} samples consumed (next global batch {batch}); {how}; {what}",
        train_state,
        # set just before the first step (training/step.py), so that nothing the set-up draws after this
        # (the MFU peak's matmul probe, a profiler) shifts the dropout streams of a resumed run
        rng if t.load_rng and not finetune else None,
        layout_changes(meta, target.cfg) or None,  # resharded: RNG states stay this run's fresh seeds
        legacy_warning(meta),  # a checkpoint saved before meta.json.sha256: loaded, unverified
    )
