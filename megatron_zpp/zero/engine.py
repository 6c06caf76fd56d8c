"""The data-parallel engine interface: what the training loop and the checkpoint code use.

An engine owns the gradients (their buffers, the data-parallel reduction, the finalize
syncs), the fp32 master weights and AdamW, and the state dict of both, as torchtitan's
ModelWrapper / OptimizersContainer own theirs:

    engine.zero_grad();  <forward/backward>;  check = engine.step(rates, loss=loss)
    (rates: optim.Rates, the step's learning rates and weight decay, or one float lr)
    (the schedule calls engine.set_last_micro_batch(chunk, last) before each backward)
    state = engine.state_dict()          # {"model": {key: tensor}, "optimizer": AdamW state}
    engine.load_state_dict(state)        # "optimizer" may be absent/empty (weights only) or
                                         # lack "param_groups" (resharded: this run's are kept)
    with engine.full_parameters():       # every weight readable in full (ZeRO-3 gathers)
        ...

`build_engine` picks plain data parallelism (ZeRO stage 0, ddp_engine.py) or ZeRO-1/2/3
with ZeRO++ (zero_engine.py) from the config.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch


class DataParallelEngine(ABC):
    optimizer: torch.optim.Optimizer  # or anything with state_dict / load_state_dict
    optimizer_name: str = "AdamW"  # which AdamW steps the masters (optim.new_adamw), for the log

    @abstractmethod
    def describe(self) -> str:
        """One log line: the engine, its group and what it costs."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    def set_last_micro_batch(self, chunk: int, last: bool) -> None:
        """Called by the schedule before each backward of model chunk `chunk`: whether it is
        the chunk's last micro-batch of the step. Its gradients are then final as the backward
        produces them, so an engine may start reducing them (--overlap-grad-reduce); without
        this call everything is reduced in `step`."""

    @abstractmethod
    def step(self, lr, loss_scale: float | None = None, loss: float = 0.0, skip_nonfinite: bool = True):
        """Reduce and finalize the gradients, clip by the global norm, check the step
        (optim.check_step: `loss` and the norm, agreed by every rank), step AdamW at `lr` (optim.Rates,
        or a float for every group) when the check allows; returns the optim.StepCheck (the norm
        before clipping, what was finite, whether AdamW stepped). With `loss_scale` (--fp16) the
        gradients are first divided by it."""

    def counted_tensors(self, kind: str) -> tuple[list[torch.Tensor], list]:
        """("params" | "grads"): this rank's fp32 master weights or gradients (after `step`, before the
        next `zero_grad`), each parameter counted once over TP/PP and DP shards as the gradient norm
        counts it, and the groups to sum over (--log-params-norm, --log-num-zeros-in-grad)."""
        raise NotImplementedError(type(self).__name__)

    @abstractmethod
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights as saved: live tensors, keyed as the checkpoint format says."""

    @abstractmethod
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (the keys and shapes of model_state_dict) into the live weights;
        ValueError names what does not match."""

    def gather_parameters(self) -> None:
        """Make every weight readable in full (ZeRO-3 gathers; the others hold them)."""

    def release_parameters(self) -> None:
        """Undo gather_parameters (ZeRO-3 frees the full weights again)."""

    @contextlib.contextmanager
    def full_parameters(self):
        """Every weight readable in full inside the block. Copy what you keep: ZeRO-3 frees
        the storage after it (and a numpy view of a weight would pin it: PyTorch refuses)."""
        self.gather_parameters()
        try:
            yield
        finally:
            self.release_parameters()

    def state_dict(self) -> dict:
        return {"model": self.model_state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.load_model_state_dict(state["model"])
        optimizer = state.get("optimizer")
        if optimizer:  # the moments, by AdamW's numbering (adamw_order); the param groups stay this run's:
            # their rates are set every step, and --decoupled-lr may cut the same numbering into other groups
            self.optimizer.load_state_dict({**optimizer, "param_groups": self.optimizer.state_dict()["param_groups"]})


def copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (converted to dst's dtype and device), refusing another shape."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch for {name}: checkpoint has {tuple(src.shape)}, the model has {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def check_keys(got: set, want: set) -> None:
    if got != want:
        raise ValueError(
            f"checkpoint tensors do not match the model: missing {sorted(want - got)[:5]}, "
            f"unexpected {sorted(got - want)[:5]}"
        )
