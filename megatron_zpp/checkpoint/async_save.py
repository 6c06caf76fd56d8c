"""--async-save: a rank's part of a save, written from a background thread.

The save copies this rank's state to host memory (pinned on CUDA) in the step's thread, then a
thread writes the rank file from that copy while training goes on. Nothing is sealed from the
thread: save.finish_async_save, which every rank calls at the same points (the start of the next
save, the end of train(), an early stop), joins the thread and only then gathers the digests and
lets rank 0 write meta.json and move `latest`. A process killed while the thread writes leaves the
iteration's .tmp directory unsealed: `latest` still names the previous complete checkpoint.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .files import save_failure


def to_host(x, pin: bool):
    """A copy of `x` (nested dicts, lists, tuples of tensors and plain values) whose tensors live in
    host memory, pinned when `pin`, owned by nobody else: the live tensors may change afterwards."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type == "cpu":
            return x.clone()
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
        out.copy_(x, non_blocking=pin)
        return out
    if isinstance(x, dict):
        return {k: to_host(v, pin) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [to_host(v, pin) for v in x]
        return items if isinstance(x, list) else tuple(items)
    return x


def host_snapshot(state: dict, device: torch.device) -> dict:
    """`state` copied to host memory; returns once every copy has landed."""
    pin = device.type == "cuda"
    out = to_host(state, pin)
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)
    return out


@dataclass
class SaveJob:
    """One save, from its snapshot to its seal: what rank 0 writes into meta.json is taken when the
    save starts (the run's iteration, samples, tracking and loss scaler move on meanwhile)."""

    directory: str
    final: str
    tmp: str
    iteration: int
    consumed: int
    padded_vocab: int
    tracking: dict
    train_state: dict
    bad: list[str] = field(default_factory=list)  # this rank's non-finite tensors: its file is not written
    digest: str = "00" * 32
    problem: str | None = None  # why this rank's file could not be written
    thread: threading.Thread | None = None

    def write_in_background(self, write) -> None:
        """Run `write()` (returns the file's sha256) in a daemon thread: a process that dies or exits
        without finishing the save leaves it unsealed."""

        def work():
            try:
                self.digest = write()
            except OSError as e:
                self.problem = save_failure(e, self.iteration, self.directory)
            except Exception as e:  # noqa: BLE001  (reported at the seal, on every rank)
                self.problem = f"cannot save iteration {self.iteration} to {self.directory}: {type(e).__name__}: {e}"

        self.thread = threading.Thread(target=work, name=f"async-save-{self.iteration}", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


@dataclass
class SaveState:
    """The one part of a run the checkpoint code changes: the last checkpoint saved or loaded (where a
    stopped run resumes), the --async-save in flight (sealed later) and, for --async-save --ckpt-format
    torch_dist, DCP's own gloo group (dcp.writer_group)."""

    last: str | None = None
    pending: SaveJob | None = None
    dcp_writer_group: object | None = None
