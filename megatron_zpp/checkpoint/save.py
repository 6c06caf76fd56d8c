"""The save path of our checkpoints: every rank saves its own state (staging dir, atomic rename, `latest`,
--async-save's hand-off); load.py reads them back at the same layout (bitwise exact resume) or at any other
(resharded: reshard.py). The file codec and meta.json live in files.py.

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

A rank file holds {"rank", "iteration", "consumed_samples", "layout", "model", "optimizer", "rng", "buffers"}
(the first four cross-checked against meta.json on every read; meta.json's own sha256 is in
meta.json.sha256 beside it):
* "model", "optimizer": the data-parallel engine's state dict (zero/engine.py): plain DP
  {"chunk{c}.{param name}": tensor} and, for bf16, {"master.{i}": fp32 master}; ZeRO
  {"unit{u}.{unit name}.master": fp32 master shard} (the training-dtype shard, ZeRO-3's
  freed full weights and hpZ's secondary shards are rebuilt, so not saved); and the torch
  AdamW state_dict;
* "rng": torch CPU state, device state (or absent), the tensor-parallel stream's states,
  numpy's and Python's global states (as tensors / lists);
* "buffers": the model's persistent buffers by single-rank name (the routers' expert bias), whole on every
  rank of their stage (absent from files saved before them).
A weights-only checkpoint (`save_weights`, e.g. imported from HF) has both of the last empty.

Saving is crash-safe: ranks write into DIR/iter_XXXXXXX.tmp/ (each file: write, fsync,
rename) and hash their own file; rank 0 gathers the digests, writes meta.json, renames the
directory to its final name and replaces `latest` atomically. A save interrupted at any
point leaves the previous `latest` and its directory intact."""

from __future__ import annotations

import os
import shutil

import torch

from .. import comm
from ..logging_utils import log
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
    meta_train_fields,
    nonfinite_tensors,
    rank_file,
    read_latest,
    save_failure,
    write_meta,
    write_rank_file,
)
from .layout import layout_of, rank_layout
from .rng import get_rng_state

__all__ = ["finish_async_save", "save_checkpoint", "save_full_dcp", "save_weights"]


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
        # the routers' expert bias (persistent buffers, by single-rank name): training state, saved whole
        "buffers": host_snapshot(state["buffers"], run.device)
        if host
        else {k: b.detach().clone() for k, b in state["buffers"].items()},
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
    return dcp.state_dict_of(lay, state["model"], moments or None, state["rng"] or None, run.rank, state["buffers"])


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
