"""Activations and their gradients between adjacent pipeline stages.

One call exchanges everything a step needs with both neighbours, as a single batch of
async ops (receives posted before sends), so stages never wait on each other in a
cycle. Peers are group-relative on the ring of the PP group (the last stage sends to the
first under interleaving). Activations and gradients travel with different tags, and in
the same order on every rank, so a pair of stages that exchanges both (PP = 2) cannot
mix them up, on gloo (tags) or NCCL (order)."""

from __future__ import annotations

import torch

from .. import comm
from ..topology import Group

ACT, GRAD = 0, 1


class StageLink:
    def __init__(self, pp: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        self.next, self.prev = (pp.rank + 1) % pp.size, (pp.rank - 1) % pp.size

    def exchange(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send an activation forward / a gradient backward, and receive an activation
        from the previous stage / a gradient from the next one. Returns (activation, grad)."""
        ops: list[comm.Send | comm.Recv] = []
        got_act, got_grad = None, None
        if recv_prev:
            got_act = torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)
            ops.append(comm.Recv(got_act, self.prev, ACT))
        if send_next is not None:
            ops.append(comm.Send(send_next.detach().contiguous(), self.next, ACT, "pp_fwd_p2p"))
        if recv_next:
            got_grad = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(comm.Recv(got_grad, self.next, GRAD))
        if send_prev is not None:
            ops.append(comm.Send(send_prev.contiguous(), self.prev, GRAD, "pp_bwd_p2p"))
        for work in comm.p2p(ops, self.pp, "pp_p2p"):
            work.wait()
        if got_act is not None:
            got_act = got_act.detach().requires_grad_()
        return got_act, got_grad
