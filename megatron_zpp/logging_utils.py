"""Where metrics go: the console, a JSONL file, tensorboard and W&B (offline unless the
user asks otherwise). One rank logs; the others are silent."""

from __future__ import annotations

import json
import os
import sys
import time


def log(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class MetricsSink:
    def __init__(self, log_cfg, config_dict: dict, enabled: bool, start_iteration: int = 0):
        """A run resumed at `start_iteration` keeps the metrics file's lines up to it (those
        of the steps after it are redone) and appends."""
        self.enabled = enabled
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

            self.tb = SummaryWriter(log_cfg.tensorboard_dir)
        if log_cfg.wandb_project and log_cfg.wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=log_cfg.wandb_project, mode=log_cfg.wandb_mode, config=config_dict)

    def write(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(metrics) + "\n")
            self.jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _lines_up_to(path: str, iteration: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and json.loads(line).get("iteration", 0) <= iteration]


def fail(msg: str, code: int = 2, every_rank: bool = False) -> None:
    """Print one clear error and exit without a traceback: on rank 0 only (an error all
    ranks find alike, e.g. the configuration), or, with every_rank, on each rank that
    calls it (a failure of its own: its peer died, its checkpoint file is bad)."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)
