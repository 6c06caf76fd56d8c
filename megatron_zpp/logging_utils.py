"""Where metrics go: the console, a JSONL file, tensorboard and W&B (offline unless the
user asks otherwise). One rank logs; the others are silent."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


def set_logging_level(level: int | None) -> None:
    """--logging-level: the level of Python's logging (the libraries' loggers; our lines are printed)."""
    if level is not None:
        logging.basicConfig(level=level)
        logging.getLogger().setLevel(level)


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class MetricsSink:
    def __init__(
        self,
        log_cfg,
        config_dict: dict,
        enabled: bool,
        start_iteration: int = 0,
        save_dir: str | None = None,
        wandb_run_id: str | None = None,
    ):
        """A run resumed at `start_iteration` keeps the metrics file's lines up to it (those
        of the steps after it are redone) and appends; tensorboard drops the previous run's
        events after it (purge_step), and W&B continues the run `wandb_run_id` (the one the
        checkpoint names). `wandb_run_id` afterwards: this run's W&B id (None without W&B)."""
        self.enabled, self.wandb_run_id = enabled, wandb_run_id
        self.tb_interval = log_cfg.tensorboard_log_interval
        self.jsonl = self.tb = self.wandb = None
        if not enabled:
            return
        if log_cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log_cfg.metrics_file)), exist_ok=True)
            kept = _lines_up_to(log_cfg.metrics_file, start_iteration) if start_iteration else []
            self.jsonl = open(log_cfg.metrics_file, "w")
            self.jsonl.writelines(kept)
        if log_cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # the next step logged is start_iteration + 1: events of the previous run from there on are void
            self.tb = SummaryWriter(
                log_cfg.tensorboard_dir,
                purge_step=start_iteration + 1 if start_iteration else None,
                max_queue=log_cfg.tensorboard_queue_size,
            )
        mode = log_cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        if log_cfg.wandb_project and mode != "disabled":
            self.wandb = _wandb_run(log_cfg, mode, config_dict, save_dir, wandb_run_id)
            self.wandb_run_id = self.wandb.id

    def write(self, metrics: dict, step: int) -> None:
        """A step's JSONL record; its numbers also to tensorboard (every --tensorboard-log-interval
        steps) and W&B under the same names."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(metrics) + "\n")
            self.jsonl.flush()
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        scalars = {k: v for k, v in numbers.items() if k != "iteration"}
        if self.tb and step % self.tb_interval == 0:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def wandb_log(self, scalars: dict, step: int) -> None:
        """Numbers outside a step's record (the final evaluation) to W&B, at the last step."""
        if self.enabled and self.wandb:
            self.wandb.log(scalars, step=step)

    def tensorboard(self, scalars: dict, step: int, samples: int) -> None:
        """Megatron-LM's tensorboard scalars: each NAME at `step` and "NAME vs samples" at `samples`."""
        if not (self.enabled and self.tb):
            return
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
            self.tb.add_scalar(f"{k} vs samples", v, samples)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _wandb_run(log_cfg, mode: str, config_dict: dict, save_dir: str | None, run_id: str | None):
    """wandb.init with Megatron's flags; `run_id` (a resumed run's) is continued (resume="allow"),
    unless $WANDB_RUN_ID names another run."""
    import wandb

    directory = log_cfg.wandb_save_dir or (os.path.join(save_dir, "wandb") if save_dir else None)
    if directory:
        os.makedirs(directory, exist_ok=True)
    run_id = os.environ.get("WANDB_RUN_ID") or run_id
    return wandb.init(
        project=log_cfg.wandb_project,
        name=log_cfg.wandb_exp_name,
        entity=log_cfg.wandb_entity,
        dir=directory,
        mode=mode,
        config=config_dict,
        id=run_id,
        resume="allow" if run_id else None,
    )


def _lines_up_to(path: str, iteration: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and json.loads(line).get("iteration", 0) <= iteration]


def fail(msg: str, code: int = 2) -> None:
    """Print one clear error and exit without a traceback, on every rank that calls it (prefixed
    with its rank when there are several): a launcher such as torchrun kills the other ranks as
    soon as one exits, so a line left to rank 0 alone could be lost."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if world not in ("0", "1") and not msg.startswith("rank "):
        msg = f"rank {rank}: {msg}"
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)
