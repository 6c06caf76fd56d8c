"""The load path of our checkpoints (both formats: zpp's per-rank safetensors, save.py, and torch_dist's
DCP files, dcp.py): find the iteration dir, read meta.json, plan what this rank reads, restore it
into the engine. A checkpoint saved at this layout loads as saved (bitwise exact resume); one of
any other layout is resharded (reshard.py, or DCP itself for torch_dist)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import comm
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
from .layout import layout_changes, rank_layout
from .reshard import SavedCheckpoint, check_same_model, rank_state_for
from .rng import get_rng_state

if TYPE_CHECKING:  # for the annotations only
    from ..config import Config
    from ..topology import ProcessGroups
    from ..zero import DataParallelEngine

__all__ = ["LoadTarget", "Restored", "load_checkpoint"]


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
