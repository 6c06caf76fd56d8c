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
    def __init__(self, log_cfg, config_dict: dict, enabled: bool):
        self.enabled = enabled
        self.jsonl = self.tb = self.wandb = None
        if not enabled:
            return
        if log_cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(log_cfg.metrics_file)), exist_ok=True)
            self.jsonl = open(log_cfg.metrics_file, "w")
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


def fail(msg: str, code: int = 2, every_rank: bool = False) -> None:
    """Print one clear error and exit without a traceback: on rank 0 only (an error all
    ranks find alike, e.g. the configuration), or, with every_rank, on each rank that
    calls it (a failure of its own: its peer died, its checkpoint file is bad)."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)
