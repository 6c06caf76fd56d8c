"""TrainState: what the training loop changes as it goes, in one object (torchtitan's Stateful
train state). The loop and the step write these fields and nothing else of the run.

The first group is what a checkpoint keeps and restores (`state_dict` / `load_state_dict`; the
checkpoint code maps it onto meta.json's fields: checkpoint/files.py); the second lives only as
long as this process (how the last step went, why the loop stopped, what the next step must do)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..optim.loss_scaler import LossScaler


@dataclass
class TrainState:
    # ---- saved in checkpoints, restored by --load
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int | None = None  # where the validation iterator continues (None: not known yet)
    # --fp16: the loss scaler; steps skipped on overflow (they do not advance the LR schedule)
    loss_scaler: LossScaler | None = None
    skipped_iterations: int = 0
    skipped_samples: int = 0
    tracking: dict = field(default_factory=dict)  # run metadata that follows the run: {"wandb_run_id": ...}
    # ---- this process only
    last_step_skipped: bool = False
    consecutive_skips: int = 0  # --fp16: overflowing steps in a row (more than --max-skipped-steps stops the run)
    stop_request: tuple = (0, 0, 0)  # the last step's agreed stop lanes (ExitSignal.lanes)
    stopped_by: str | None = None  # why train() stopped before --train-iters (signal, interrupt, interval, duration)
    pending_rng_state: dict | None = None  # a same-layout --load's RNG streams, set right before the first step
    resumed_from: str | None = None  # the checkpoint --load restored, until the first step's record names it
    final_evaluation: dict = field(default_factory=dict)  # train(final_evaluation=True): val/test loss and ppl

    @property
    def stopped_by_signal(self) -> bool:
        """--exit-signal-handler: the signal ended train() early."""
        return self.stopped_by == "signal"

    def state_dict(self) -> dict:
        """The saved fields; "loss_scaler" is the scaler's own state dict (None without --fp16)."""
        return {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "consumed_valid_samples": self.consumed_valid_samples,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "skipped_iterations": self.skipped_iterations,
            "skipped_samples": self.skipped_samples,
            "tracking": dict(self.tracking),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the saved fields from `state` (what state_dict returns; a missing entry keeps its
        fresh value, and a missing or None "loss_scaler" keeps this run's fresh scale)."""
        self.iteration = int(state.get("iteration", 0))
        self.consumed_samples = int(state.get("consumed_samples", 0))
        valid = state.get("consumed_valid_samples")
        self.consumed_valid_samples = int(valid) if valid is not None else None
        self.skipped_iterations = int(state.get("skipped_iterations", 0))
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.tracking = dict(state.get("tracking") or {})
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
