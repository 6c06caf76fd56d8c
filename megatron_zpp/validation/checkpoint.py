"""Checkpointing: save intervals, exit signals and Megatron's checkpoint flags."""

from __future__ import annotations

from ..config import Config
from .common import failed

EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")  # what --exit-signal-handler may catch


def check_checkpointing(cfg: Config, world_size: int) -> list[str]:
    t = cfg.train
    unknown = [s for s in t.exit_signal if s not in EXIT_SIGNALS]
    return failed(
        [
            (t.save_interval >= 0, f"--save-interval must be >= 0 (got {t.save_interval})"),
            (
                t.exit_signal_handler or t.exit_signal == ["SIGTERM"],
                f"--exit-signal {' '.join(t.exit_signal)} needs --exit-signal-handler (which catches it)",
            ),
            (
                not unknown,
                f"--exit-signal {' '.join(unknown)}: not one of {' '.join(EXIT_SIGNALS)}",
            ),
            *_checkpoint_flag_checks(t),
        ]
    )


def _checkpoint_flag_checks(t) -> list[tuple[bool, str]]:
    """Megatron's checkpoint flags: --save-retain-interval, --finetune, --ckpt-format."""
    retain = t.save_retain_interval
    return [
        (retain is None or retain > 0, f"--save-retain-interval must be > 0 (got {retain})"),
        (retain is None or t.save is not None, "--save-retain-interval needs --save DIR (whose checkpoints it thins)"),
        (
            retain is None or not t.save_interval or retain <= 0 or retain % t.save_interval == 0,
            f"--save-retain-interval {retain} must be a multiple of --save-interval {t.save_interval}",
        ),
        (
            t.override_ckpt_iteration is None or t.override_ckpt_iteration >= 0,
            f"--override-ckpt-iteration must be >= 0 (got {t.override_ckpt_iteration})",
        ),
        (
            t.override_ckpt_iteration is None or not t.rampup_batch_size,
            "--override-ckpt-iteration takes N x --global-batch-size samples as consumed (Megatron's rule), which "
            "a --rampup-batch-size run did not consume: drop one of them",
        ),
        (
            t.override_ckpt_iteration is None or t.load is not None or t.pretrained_checkpoint is not None,
            "--override-ckpt-iteration needs --load DIR (the checkpoint whose iteration it replaces)",
        ),
        (
            not (t.finetune and t.load is None and t.pretrained_checkpoint is None),
            "--finetune needs --load DIR (the weights to start from)",
        ),
        (
            t.ckpt_format != "torch",
            "--ckpt-format torch (Megatron's legacy per-rank torch.save pickles) is not built: use zpp (the default, "
            "sharded safetensors) or torch_dist (torch.distributed.checkpoint)",
        ),
        (
            t.ckpt_format != "fsdp_dtensor",
            "--ckpt-format fsdp_dtensor is Megatron-FSDP's own DCP layout, not built: use torch_dist "
            "(torch.distributed.checkpoint, keyed by the single-rank model's names) or zpp (the default)",
        ),
    ]


# what converts a megatron-core checkpoint once (--load converts one on the fly; --pretrained-checkpoint does not)
MCORE_CONVERT = "python tools/convert_checkpoint.py --from megatron --to sharded --load {load} --output DIR"


def check_load(cfg: Config) -> list[str]:
    """--load and --pretrained-checkpoint as a run will read them, before any process exists. As Megatron-LM,
    a --load that holds no checkpoint (absent, empty, no tracker) starts from scratch (the run warns), an
    error only with --exit-on-missing-checkpoint; a megatron-core tracker naming no checkpoint is an error
    (the load reads and checks ours, and says what is wrong with it in a CheckpointError)."""
    t = cfg.train
    errors = []
    if t.load:
        found, problem = find_load(t.load, t.ckpt_step)
        if problem:
            errors.append(problem)
        elif found is None and t.exit_on_missing_checkpoint:
            errors.append(f"--load {t.load}: {missing_checkpoint(t.load)} (--exit-on-missing-checkpoint)")
    if t.pretrained_checkpoint:
        p = t.pretrained_checkpoint
        found, problem = find_load(p, None, "--pretrained-checkpoint")
        if found == "mcore":
            problem = f"--pretrained-checkpoint {p}: a megatron-core checkpoint: convert it first with " + (
                MCORE_CONVERT.format(load=p)
            )
        if problem or found is None:
            errors.append(problem or f"--pretrained-checkpoint {p}: {missing_checkpoint(p)}")
    return errors


def missing_checkpoint(directory: str) -> str:
    """Why `directory` (where find_load found nothing) holds no checkpoint: the words of the one line."""
    import os

    if not os.path.exists(directory):
        return "does not exist"
    return "holds no checkpoint (no 'latest', no meta.json)"


def find_load(directory: str, step: int | None, flag: str = "--load") -> tuple[str | None, str | None]:
    """(what `directory` holds: 'ours', 'mcore' (a megatron-core torch_dist checkpoint: its tracker file
    or an iteration dir with DCP's .metadata and no meta.json of ours) or None for no checkpoint, why it
    cannot be read or None). Ours is what files.locate_checkpoint finds (a meta.json, a 'latest', or the
    --ckpt-step iteration): reading and checking it is the load's (a CheckpointError naming the file)."""
    import os

    from ..checkpoint.files import CheckpointError, iter_name
    from ..checkpoint.mcore import TRACKER, iteration_dir

    has = lambda *names: os.path.isfile(os.path.join(directory, *names))  # noqa: E731
    latest = os.path.exists(os.path.join(directory, "latest"))
    if has(TRACKER) and not latest or has(".metadata") and not has("meta.json"):
        source = os.path.join(directory, iter_name(step)) if step is not None else directory
        try:  # the tracker names an iteration dir that holds DCP's metadata
            iteration_dir(source)
        except (CheckpointError, ValueError) as e:
            return None, f"{flag} {directory}: a megatron-core checkpoint that cannot be read: {e}"
        return "mcore", None
    return ("ours" if latest or has("meta.json") or step is not None else None), None
