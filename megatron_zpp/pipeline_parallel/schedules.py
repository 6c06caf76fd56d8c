"""Forward-backward schedules over the micro-batches of one step.

Every schedule returns the mean loss of each micro-batch (detached). Each micro-batch's
loss is the mean over its tokens divided by the number of micro-batches, so the
accumulated gradient is that of the mean over the rank's share of the global batch."""
from __future__ import annotations

import torch


def micro_batch_loss(model, batch: dict) -> torch.Tensor:
    losses = model(tokens=batch["tokens"], labels=batch["labels"], position_offset=batch["position_offset"])
    return losses.mean()


def forward_backward_no_pipelining(model, batches, num_micro_batches: int, forward_only: bool = False
                                   ) -> list[torch.Tensor]:
    losses = []
    for _ in range(num_micro_batches):
        batch = next(batches)
        with torch.set_grad_enabled(not forward_only):
            loss = micro_batch_loss(model, batch)
            if not forward_only:
                (loss / num_micro_batches).backward()
        losses.append(loss.detach())
    return losses
