"""Forward-backward schedules over the micro-batches of one step.

* no pipelining: forward + backward of each micro-batch in turn (PP = 1);
* 1F1B: stage p runs PP - p - 1 warm-up forwards, then alternates one forward and one
  backward, then drains the backwards: at most PP - p activations alive, bubble
  (PP-1)/(M+PP-1);
* interleaved 1F1B: each stage holds V chunks (virtual stages) and the same alternation
  runs over V x M virtual micro-batches, cutting the bubble by V (Megatron's schedule).

Before each backward the schedule tells the caller's `on_backward(chunk, last)` whether
it is that chunk's last micro-batch of the step (its gradients are then final as they are
produced: the data-parallel engine may reduce them during that backward).

A micro-batch's loss is the mean over its tokens divided by the number of micro-batches,
so the accumulated gradient is that of the mean over the rank's share of the global
batch. The schedules return the per-micro-batch losses on the last stage (empty
elsewhere); the caller broadcasts what it reports. With --eod-mask-loss a micro-batch's loss
is its masked mean instead (the batch's loss_mask and loss_tokens, data/loader.py).

Every chunk of a stage receives its micro-batch's batch: the first stage's embedding reads
the tokens, the last the labels, and every layer the packed documents (positions, document
ids), which each stage builds from the tokens it reads itself (data/loader.py), so nothing
but hidden states travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.moe_mlp import aux_loss_scale
from ..tensor_parallel.random import micro_batch
from .p2p import StageLink


class Stage:
    """This rank's model chunks and how to run one micro-batch through a chunk."""

    def __init__(
        self,
        chunks: list,
        batches,
        num_micro_batches: int,
        forward_only: bool,
        on_backward: Callable[[int, bool], None] | None = None,
        loss_scale: float = 1.0,
    ):
        self.chunks, self.batches, self.m = chunks, batches, num_micro_batches
        self.loss_scale = loss_scale  # --fp16: the backward starts from loss x scale
        self.forward_only = forward_only
        self.losses: list[torch.Tensor] = []
        self.runs = [0] * len(chunks)  # micro-batches each chunk has run
        self.fetched: dict[int, list] = {}  # micro-batch -> [its batch, chunks yet to run it]
        self.next_micro_batch = 0
        self.on_backward, self.backwards = on_backward, [0] * len(chunks)

    def batch_for(self, chunk_id: int) -> dict:
        """The batch of the next micro-batch of chunk `chunk_id`: each chunk runs micro-batches in order,
        so chunk c's j-th forward is micro-batch j; it is read once and kept until every chunk ran it."""
        j = self.runs[chunk_id]
        self.runs[chunk_id] += 1
        while self.next_micro_batch <= j:
            self.fetched[self.next_micro_batch] = [next(self.batches), len(self.chunks)]
            self.next_micro_batch += 1
        entry = self.fetched[j]
        entry[1] -= 1
        if not entry[1]:
            del self.fetched[j]
        return entry[0]

    def announce_backward(self, chunk_id: int) -> None:
        """Before a backward of chunk `chunk_id`: tell on_backward whether it is the chunk's last."""
        self.backwards[chunk_id] += 1
        if self.on_backward is not None:
            self.on_backward(chunk_id, self.backwards[chunk_id] == self.m)

    def forward(self, chunk_id: int, hidden: torch.Tensor | None) -> torch.Tensor:
        model = self.chunks[chunk_id]
        batch = self.batch_for(chunk_id)
        with torch.set_grad_enabled(not self.forward_only), micro_batch(batch.get("samples")):
            out = model(
                tokens=batch.get("tokens"),
                labels=batch.get("labels"),
                hidden=hidden,
                documents=batch.get("documents"),
            )
        if not model.post_process:
            return out
        loss = out.mean() if batch.get("loss_mask") is None else (out * batch["loss_mask"]).sum() / batch["loss_tokens"]
        self.losses.append(loss.detach())
        return loss / self.m if self.loss_scale == 1.0 else loss * (self.loss_scale / self.m)

    @staticmethod
    def backward(hidden: torch.Tensor | None, out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
        torch.autograd.backward(out, grad_tensors=grad)
        return hidden.grad if hidden is not None else None


def forward_backward_no_pipelining(stage: Stage) -> list[torch.Tensor]:
    for _ in range(stage.m):
        out = stage.forward(0, None)
        if not stage.forward_only:
            stage.announce_backward(0)
            stage.backward(None, out, None)
    return stage.losses


def forward_backward_1f1b(stage: Stage, link: StageLink) -> list[torch.Tensor]:
    pp, p = link.pp.size, link.pp.rank
    first, last = p == 0, p == pp - 1
    m = stage.m
    if stage.forward_only:
        for _ in range(m):
            x, _ = link.exchange(recv_prev=not first)
            y = stage.forward(0, x)
            link.exchange(send_next=None if last else y)
        return stage.losses

    warmup = min(pp - p - 1, m)
    inputs, outputs = [], []
    for _ in range(warmup):
        x, _ = link.exchange(recv_prev=not first)
        y = stage.forward(0, x)
        link.exchange(send_next=None if last else y)
        inputs.append(x)
        outputs.append(y)

    steady = m - warmup
    x = link.exchange(recv_prev=not first)[0] if steady else None
    for i in range(steady):
        y = stage.forward(0, x)
        _, dy = link.exchange(send_next=None if last else y, recv_next=not last)
        inputs.append(x)
        outputs.append(y)
        stage.announce_backward(0)
        dx = stage.backward(inputs.pop(0), outputs.pop(0), dy)
        x, _ = link.exchange(send_prev=dx, recv_prev=not first and i < steady - 1)

    for _ in range(warmup):
        _, dy = link.exchange(recv_next=not last)
        stage.announce_backward(0)
        dx = stage.backward(inputs.pop(0), outputs.pop(0), dy)
        link.exchange(send_prev=dx)
    return stage.losses


def forward_backward_interleaved(stage: Stage, link: StageLink) -> list[torch.Tensor]:
    """Megatron's interleaved 1F1B over V chunks; needs M to be a multiple of PP."""
    run = _Interleaved(stage, link)
    run.warmup()
    run.steady()
    if not stage.forward_only:
        run.cooldown()
    return stage.losses


class _Interleaved:
    """One interleaved 1F1B run: the k-th forward (backward) runs chunk `chunk_of(k)`; each chunk keeps
    queues of its inputs, outputs and output gradients."""

    def __init__(self, stage: Stage, link: StageLink):
        self.stage, self.link = stage, link
        pp, p, V, m = link.pp.size, link.pp.rank, len(stage.chunks), stage.m
        self.pp, self.V, self.total = pp, V, m * V
        self.first, self.last = p == 0, p == pp - 1
        self.inputs: list[list[torch.Tensor | None]] = [[] for _ in range(V)]
        self.outputs: list[list[torch.Tensor | None]] = [[] for _ in range(V)]
        self.out_grads: list[list[torch.Tensor | None]] = [[] for _ in range(V)]
        if stage.forward_only or m == pp:
            self.warmups, self.all_warmup = self.total, True
        else:
            self.warmups, self.all_warmup = min((pp - p - 1) * 2 + (V - 1) * pp, self.total), False
        self.steadies = self.total - self.warmups

    def chunk_of(self, k: int, forward: bool) -> int:
        c = (k % (self.pp * self.V)) // self.pp
        return c if forward else self.V - 1 - c

    def forward_k(self, k: int) -> torch.Tensor | None:
        c = self.chunk_of(k, True)
        if self.first and c == 0 and len(self.inputs[c]) == len(self.outputs[c]):
            self.inputs[c].append(None)
        y = self.stage.forward(c, self.inputs[c][-1])
        self.outputs[c].append(y)
        return None if (self.last and c == self.V - 1) else y

    def backward_k(self, k: int) -> torch.Tensor | None:
        c = self.chunk_of(k, False)
        if self.last and c == self.V - 1 and not self.out_grads[c]:
            self.out_grads[c].append(None)
        self.stage.announce_backward(c)
        dx = self.stage.backward(self.inputs[c].pop(0), self.outputs[c].pop(0), self.out_grads[c].pop(0))
        return None if (self.first and c == 0) else dx

    def warmup(self) -> None:
        stage, link, V, total = self.stage, self.link, self.V, self.total
        self.inputs[0].append(link.exchange(recv_prev=not self.first)[0])
        for k in range(self.warmups):
            y = self.forward_k(k)
            next_c = self.chunk_of(k + 1, True)
            recv_prev = not (self.first and next_c == 0) and k != total - 1
            if k == self.warmups - 1 and not stage.forward_only and not self.all_warmup:
                x, dy = link.exchange(send_next=y, recv_prev=recv_prev, recv_next=not self.last)
                self.out_grads[V - 1].append(dy)
            else:
                x, _ = link.exchange(send_next=y, recv_prev=recv_prev)
            self.inputs[next_c].append(x)

    def steady(self) -> None:
        pp, V = self.pp, self.V
        for i in range(self.steadies):
            fk, bk = i + self.warmups, i
            y = self.forward_k(fk)
            dx = self.backward_k(bk)
            if self.first:
                next_fc = self.chunk_of(fk - (pp - 1), True)
                recv_prev = next_fc != V - 1
                next_fc += 1
            else:
                recv_prev, next_fc = True, self.chunk_of(fk + 1, True)
            if self.last:
                next_bc = self.chunk_of(bk - (pp - 1), False)
                recv_next = next_bc != 0
                next_bc -= 1
            else:
                recv_next, next_bc = True, self.chunk_of(bk + 1, False)
            recv_prev = recv_prev and i != self.steadies - 1
            x, dy = self.link.exchange(send_next=y, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)
            if recv_prev:
                self.inputs[next_fc].append(x)
            if recv_next:
                self.out_grads[next_bc].append(dy)

    def cooldown(self) -> None:
        if self.all_warmup:
            self.out_grads[self.V - 1].append(self.link.exchange(recv_next=not self.last)[1])
        for k in range(self.steadies, self.total):
            dx = self.backward_k(k)
            next_bc = self.chunk_of(k + 1, False)
            recv_next = not (self.last and next_bc == self.V - 1) and k != self.total - 1
            self.out_grads[next_bc].append(self.link.exchange(send_prev=dx, recv_next=recv_next)[1])


def run_schedule(
    chunks: list,
    batches,
    num_micro_batches: int,
    link: StageLink | None,
    forward_only: bool = False,
    on_backward: Callable[[int, bool], None] | None = None,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    stage = Stage(chunks, batches, num_micro_batches, forward_only, on_backward, loss_scale)
    with aux_loss_scale(loss_scale / num_micro_batches):  # the MoE router losses' gradient, as the loss's
        if link is None or link.pp.size == 1:
            return forward_backward_no_pipelining(stage)
        if len(chunks) == 1:
            return forward_backward_1f1b(stage, link)
        return forward_backward_interleaved(stage, link)
