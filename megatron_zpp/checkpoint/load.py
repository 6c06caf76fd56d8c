"""The load path of our checkpoints (both formats: zpp's per-rank safetensors, save.py, and torch_dist's
DCP files, dcp.py): find the iteration dir, read meta.json, plan what this rank reads, restore it
into the engine. A checkpoint saved at this layout loads as saved (bitwise exact resume); one of
any other layout is resharded (reshard.py, or DCP itself for torch_dist)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .. import comm
from ..zero import persistent_buffers
from . import dcp
from .files import (
    DCP_FORMAT,
    CheckpointError,
    legacy_warning,
    locate_checkpoint,
    rank_file,
    read_rank_file,
    train_state_of,
)
from .layout import RankLayout, layout_changes, rank_layout
from .reshard import SavedCheckpoint, check_same_model, function_changes, head_norm_change, rank_state_for
from .rng import get_rng_state

if TYPE_CHECKING:  # for the annotations only
    from ..config import Config
    from ..topology import ProcessGroups
    from ..zero import DataParallelEngine

__all__ = ["LoadPlan", "LoadTarget", "Restored", "load_checkpoint", "plan_load"]


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
            {
                "model": {k: v.to(target.device) for k, v in state["model"].items()},
                "optimizer": state.get("optimizer"),
                "buffers": state.get("buffers") or {},
            }
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _nothing_left() -> None:
    """A plan whose tensors were read while planning (zpp) has nothing left to read."""


@dataclass(frozen=True)
class LoadPlan:
    """One rank's load of one checkpoint, whatever its format: what it restores (`keys`: its tensors, as the
    format names them, read from `files`), whether the checkpoint holds AdamW state, how this run's layout
    differs from the saved one (computed once, here), and the state the engine takes. zpp's tensors are
    read while planning (each rank its own files, before the ranks agree that every one could);
    torch_dist's are read by `restore`, DCP's collective read into the buffers planned here."""

    path: str  # the iteration dir
    meta: dict  # its meta.json
    changes: list[str]  # layout_changes ([]: saved at this layout)
    files: tuple[str, ...]  # the checkpoint files this rank reads from
    keys: tuple[str, ...]  # the tensors it restores ("/model/chunk0.embedding.weight", "model.embedding.weight")
    has_optimizer: bool  # the checkpoint holds AdamW state (restored unless weights only)
    state: dict  # {"model", "optimizer", "rng"}: what the engine takes, and this rank's RNG streams
    read: Callable[[], None] = _nothing_left  # torch_dist: DCP's collective read into `state`
    buffers_note: str = ""  # persistent buffers (the expert bias) that this run or the checkpoint lacks

    @property
    def how(self) -> str:
        """How the checkpoint is read, in words, for the log."""
        by_dcp = self.meta["format"] == DCP_FORMAT
        if not self.changes:
            return "torch_dist, same layout" if by_dcp else "same layout"
        resharded = "torch_dist, resharded by DCP" if by_dcp else "resharded"
        return f"{resharded} ({', '.join(self.changes)}); RNG streams start from this layout's seeds"

    def restore(self, target: LoadTarget) -> dict | None:
        """Collective for torch_dist (every rank, once all agreed that each could plan its part): read what
        is left, hand the engine its state; returns the RNG streams read (None: not saved, or resharded)."""
        self.read()
        _restore(target, self.path, self.state)
        return self.state.get("rng") or None


def _train_dtype(cfg) -> torch.dtype:
    return torch.float16 if cfg.train.fp16 else torch.bfloat16 if cfg.train.bf16 else torch.float32


def _tensor_names(state: dict, sep: str, prefix: str = "") -> tuple[str, ...]:
    """The names of a nested state dict's tensors, its keys joined by `sep` (as the format names them)."""
    out: list[str] = []
    for k, v in state.items():
        name = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out += _tensor_names(v, sep, name)
        elif isinstance(v, torch.Tensor):
            out.append(name)
    return tuple(out)


def plan_load(target: LoadTarget, path: str, meta: dict, weights_only: bool) -> LoadPlan:
    """This rank's plan for the checkpoint at `path` (its `meta`), checked against this run (the same model,
    tensors of this layout's shapes); with `weights_only` (--no-load-optim, --finetune) the AdamW state is
    not restored. Raises CheckpointError; collective for no format."""
    check_same_model(path, meta, target.cfg, target.padded_vocab_size)
    changes = layout_changes(meta, target.cfg) + head_norm_change(meta, target.cfg)
    if meta["format"] == DCP_FORMAT:
        plan = _plan_dcp(target, path, meta, changes, weights_only)
    elif changes:
        plan = _plan_reshard(target, path, meta, changes, weights_only)
    else:
        plan = _plan_same_layout(target, path, meta, changes, weights_only)
    note, dropped = _buffers_note(target, plan.state["buffers"])
    keys = tuple(k for k in plan.keys if k.removeprefix("/buffers/") not in dropped)
    return replace(plan, buffers_note=note, keys=keys)


def _buffers_note(target: LoadTarget, saved: dict) -> tuple[str, set[str]]:
    """Words for the persistent buffers (the routers' expert bias) on one side only: those of this model that the
    checkpoint lacks keep their start value (0: saved without --moe-router-enable-expert-bias); those of the
    checkpoint this model lacks are dropped from `saved` (this run is without it). ('' when both agree, dropped)"""
    mine = set(persistent_buffers(target.dp.chunks))
    extra, missing = sorted(set(saved) - mine), sorted(mine - set(saved))
    for name in extra:
        del saved[name]
    words = []
    if missing:
        words.append(f"{', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''} not in the checkpoint: start at 0")
    if extra:
        words.append(f"the checkpoint's {', '.join(extra[:2])}{' ...' if len(extra) > 2 else ''} unused by this model")
    return "; ".join(words), set(extra)


def _plan_same_layout(target: LoadTarget, path: str, meta: dict, changes: list[str], weights_only: bool) -> LoadPlan:
    """A zpp checkpoint of this layout: this rank's own file, as saved (bitwise exact resume)."""
    state = read_rank_file(path, meta, target.rank, map_location=target.device)
    _check_tensors(target, path, meta, state["model"])
    has_optimizer = bool(state["optimizer"])  # a weights-only checkpoint (save_weights, --no-save-optim) has none
    state = {
        "model": state["model"],
        "optimizer": {} if weights_only else state["optimizer"],
        "rng": state.get("rng"),
        "buffers": state.get("buffers") or {},  # the routers' expert bias (saved before them: none)
    }
    keys = tuple("/" + k for k in _tensor_names(state, "/"))
    return LoadPlan(path, meta, changes, (rank_file(target.rank),), keys, has_optimizer, state)


def _plan_reshard(target: LoadTarget, path: str, meta: dict, changes: list[str], weights_only: bool) -> LoadPlan:
    """A zpp checkpoint of another layout: this rank's state rebuilt from the full tensors (reshard.py); the
    RNG streams stay this run's (they belong to the saving run's ranks)."""
    saved = SavedCheckpoint(path, meta)
    has_optimizer = saved.step is not None
    if weights_only:
        saved.step = None  # the fp32 masters only
    rebuilt = rank_state_for(saved, target.cfg, target.padded_vocab_size, target.rank, _train_dtype(target.cfg))
    optimizer = {} if weights_only else {"state": rebuilt["optimizer_state"]}
    state = {"model": rebuilt["model"], "optimizer": optimizer, "rng": None, "buffers": rebuilt["buffers"]}
    keys = tuple("/" + k for k in _tensor_names(state, "/"))
    return LoadPlan(path, meta, changes, saved.files_read(), keys, has_optimizer, state)


def _check_dcp_shapes(path: str, saved: dict, lay: RankLayout) -> None:
    """Every tensor of this rank's layout is in the torch_dist checkpoint at its full shape."""
    for s in lay.slots:
        got = getattr(saved.get(f"model.{s.name}"), "size", None)
        if got is None or tuple(got) != tuple(s.full_shape):  # the padded vocabulary is named where it matters
            vocab = s.name in ("embedding.weight", "output.weight")
            raise CheckpointError(f"{path}: holds no model.{s.name}, which this run's model has" if got is None else
                                  f"{path}: model.{s.name} is saved as {tuple(got)}, this run's {tuple(s.full_shape)}"
                                  + (" (torch_dist reshards at the same padded vocabulary: "
                                     "--make-vocab-size-divisible-by x TP)" if vocab else ""))  # fmt: skip


def _plan_dcp(target: LoadTarget, path: str, meta: dict, changes: list[str], weights_only: bool) -> LoadPlan:
    """A torch_dist checkpoint: checked (sha256s, every tensor's saved shape), and the buffers that DCP's
    collective read (LoadPlan.restore) fills: the RNG streams only at the same layout."""
    rank = target.rank
    dcp.check_files(path, meta)
    saved = dcp.saved_keys(path)
    lay = rank_layout(target.cfg, target.padded_vocab_size, rank)
    _check_dcp_shapes(path, saved, lay)
    has_optimizer = "optimizer.step" in saved
    dtype = _train_dtype(target.cfg)
    model = {k: torch.zeros(shape, dtype=torch.float32 if m else dtype) for k, (shape, m) in lay.tensors.items()}
    moments = None
    if has_optimizer and not weights_only:
        moments = {j: {"step": torch.zeros(()), "exp_avg": torch.zeros(sh), "exp_avg_sq": torch.zeros(sh)}
                   for j, sh in enumerate(lay.opt_shapes)}  # fmt: skip
    rng_saved = any(k.startswith(f"rng.rank{rank}.") for k in saved)
    rng = get_rng_state() if rng_saved and not changes else None  # the structure DCP fills
    buffers = {n: torch.zeros(shape) for n, shape in lay.buffers.items() if f"buffers.{n}" in saved}
    sd = dcp.state_dict_of(lay, model, moments, rng, rank, buffers)
    state = {"model": model, "optimizer": {"state": moments} if moments else {}, "rng": None, "buffers": buffers}

    def read() -> None:
        dcp.load(sd, path)
        for s in lay.slots:  # plain DP in 16 bits: the training-dtype weight from its fp32 master
            if s.master_key:
                model[s.key].copy_(model[s.master_key])
        for m in (moments or {}).values():
            m["step"] = sd["optimizer"]["step"].clone()
        state["rng"] = sd.get("rng", {}).get(f"rank{rank}")

    return LoadPlan(path, meta, changes, tuple(meta["files"]), _tensor_names(sd, "."), has_optimizer, state, read)


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
    nothing changed) when there is no checkpoint. Every rank plans (and checks) its part first; if any
    cannot, all raise CheckpointError. --no-load-optim, --no-load-rng and --finetune (neither, and
    iteration 0; `finetune` overrides it: --pretrained-checkpoint) skip their parts."""
    t = target.cfg.train
    finetune = t.finetune if finetune is None else finetune
    plan, error = None, None
    try:
        found = locate_checkpoint(directory, iteration)
        if found:
            plan = plan_load(target, *found, weights_only=finetune or not t.load_optim)
    except CheckpointError as e:
        error = e
    _agree(target, error)
    if plan is None:
        return None
    rng = plan.restore(target)
    # as Megatron: a finetune starts at iteration 0, a fresh W&B run, a fresh loss scale; the loss scaler
    # is the optimizer's (--no-load-optim: a fresh one)
    train_state = {} if finetune else train_state_of(plan.meta, with_loss_scaler=t.load_optim)
    what = _what_loaded(t, finetune, plan.has_optimizer, rng is not None)
    if t.override_ckpt_iteration is not None:  # Megatron's: the data replays from that iteration on
        at = t.override_ckpt_iteration
        assert t.global_batch_size is not None  # validation resolves it
        train_state.update(iteration=at, skipped_samples=0, consumed_samples=at * t.global_batch_size)
        what += f"; --override-ckpt-iteration {at}: {train_state['consumed_samples']} samples consumed"
    at, consumed = train_state.get("iteration", 0), train_state.get("consumed_samples", 0)
    batch = t.global_batch_at(consumed)  # a ramp-up resumes at its batch size
    return Restored(
        plan.path,
        f"{plan.path}: iteration {at}, {consumed} samples consumed (next global batch {batch}); {plan.how}; {what}"
        + (f"; {plan.buffers_note}" if plan.buffers_note else ""),
        train_state,
        # set just before the first step (training/step.py), so that nothing the set-up draws after this
        # (the MFU peak's matmul probe, a profiler) shifts the dropout streams of a resumed run
        rng if t.load_rng and not finetune else None,
        plan.changes or None,  # resharded: RNG states stay this run's fresh seeds
        # a checkpoint saved before meta.json.sha256 (loaded, unverified); settings that change what its tensors do
        "; ".join(filter(None, (legacy_warning(plan.meta), function_changes(plan.meta, target.cfg)))) or None,
    )
