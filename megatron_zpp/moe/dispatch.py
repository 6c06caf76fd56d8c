"""Token dispatch across ranks: each rank's routed tokens reach the ranks that hold their experts, the experts
run, and the outputs come back (megatron-core's MoEAlltoAllTokenDispatcher and MoEAllGatherTokenDispatcher).

alltoall (`ep`, `etp`): local permute expert-major -> the per-expert counts exchanged over EP (a fixed-size
all-to-all of E counts) -> the tokens exchanged with uneven splits -> under ETP the received tokens
all-gathered over the ETP group (their counts first, fixed size) -> the chunks sorted from source-major
(etp source, ep source, local expert) to expert-major (megatron-core's sort_chunks_by_idxs) -> the local
experts (their ETP slice: partial sums) -> the reverse: sort back, reduce-scatter over ETP, all-to-all back,
unpermute with the probabilities in fp32 on the source rank.

allgather (`etp_ep`): every rank's tokens, probabilities and routing map all-gathered over the expert
tensor-and-model-parallel group; each rank permutes and runs only its local experts on the tokens routed to
them (ETP slices: partial sums), unpermutes into all the group's tokens (zero where none of its experts was
chosen), and the outputs are reduce-scattered back: the sum over the group adds the experts of every EP rank
and the ETP partial sums.

Every collective is an autograd function whose backward is the reverse collective, all through comm.py. The
sequence of collectives depends only on the configuration: the same ops on every rank of a group in the same
order; the token exchanges' row counts depend on the routing and are known from the counts exchanged before
them (a host sync, as megatron-core's; comm.ORDER records them as `v` rows). Capacity dropping and padding
happen before dispatch, on each rank's own tokens (megatron-core's order).

Shapes only (FakeTensorMode on torch's fake process group: the dry run and the memory estimate) the counts
have no values: the dispatchers then read a stand-in, the routed rows spread evenly over the ranks and the
experts (balanced routing), so the shapes, the ledger and the order of collectives still come out."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import comm
from ..topology import Group
from .config import MoEConfig
from .experts import GroupedExperts, local_experts
from .permute import permute, unpermute


def _size(group: Group | None) -> int:
    return 1 if group is None else group.size


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows; the backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, phase):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.phase = group, out_splits, in_splits, phase
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all(out, x.contiguous(), group, phase, output_split_sizes=out_splits, input_split_sizes=in_splits)
        return out

    @staticmethod
    def backward(ctx, dy):
        dx = dy.new_empty(sum(ctx.in_splits), *dy.shape[1:])
        comm.all_to_all(
            dx, dy.contiguous(), ctx.group, ctx.phase + "_bwd", output_split_sizes=ctx.in_splits,
            input_split_sizes=ctx.out_splits,
        )  # fmt: skip
        return dx, None, None, None, None


class _AllGatherV(torch.autograd.Function):
    """Rows of every rank concatenated (counts[i] from group rank i); backward: the reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, counts, phase):
        ctx.group, ctx.counts, ctx.phase = group, counts, phase
        return comm.all_gather_v(x.contiguous(), counts, group, phase)

    @staticmethod
    def backward(ctx, dy):
        return comm.reduce_scatter_v(dy.contiguous(), ctx.counts, ctx.group, ctx.phase + "_bwd"), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    """Sum over the group, group rank i keeping its counts[i] rows; backward: the all-gather."""

    @staticmethod
    def forward(ctx, x, group, counts, phase):
        ctx.group, ctx.counts, ctx.phase = group, counts, phase
        return comm.reduce_scatter_v(x.contiguous(), counts, group, phase)

    @staticmethod
    def backward(ctx, dy):
        return comm.all_gather_v(dy.contiguous(), ctx.counts, ctx.group, ctx.phase + "_bwd"), None, None, None


def sort_chunks(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x's rows in chunks of counts [A, B] (chunk (a, b) after (a, b - 1), a-major) reordered b-major: chunk
    (a, b) goes after (a - 1, b). sort_chunks(y, counts.T) undoes it. A permutation of rows (a gather; its
    backward writes each row once)."""
    a_major = counts.reshape(-1)
    starts = (torch.cumsum(a_major, 0) - a_major).view(counts.shape).T.reshape(-1)
    b_major = counts.T.reshape(-1)
    new_starts = torch.cumsum(b_major, 0) - b_major
    shift = torch.repeat_interleave(starts - new_starts, b_major, output_size=x.shape[0])
    return x.index_select(0, torch.arange(x.shape[0], device=x.device) + shift)


def _host(counts: torch.Tensor, total: int) -> list[int]:
    """counts [n] on the host (a sync); a fake tensor's stand-in: `total` rows spread evenly (balanced)."""
    if not is_fake(counts):
        return counts.tolist()
    share, extra = divmod(total, counts.numel())
    return [share + (i < extra) for i in range(counts.numel())]


def _exchange_counts(counts: torch.Tensor, ep: Group | None) -> torch.Tensor:
    """counts [EP, E_local] (this rank's tokens for each EP rank's local experts) -> [EP, E_local]: the
    tokens each EP rank sends for this rank's local experts (a fixed-size all-to-all)."""
    out = torch.empty_like(counts)
    comm.all_to_all(out, counts.contiguous(), ep, "moe_counts")
    return out


class AllToAllDispatcher:
    def __init__(self, cfg: MoEConfig, ep: Group | None, etp: Group | None):
        self.cfg, self.ep, self.etp = cfg, ep, etp
        self.num_local = len(local_experts(cfg.num_experts, ep))

    def __call__(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: GroupedExperts,
        num_out: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """tokens [N, H], probs/routing_map [N, E] -> (the experts' weighted sum per token [N, H] in tokens'
        dtype, the rows each local expert ran on this rank [E_local])."""
        permuted, perm = permute(tokens, probs, routing_map, self.cfg.topk, num_out)
        if _size(self.ep) == 1 and _size(self.etp) == 1:  # one rank: no exchange, no host sync
            return unpermute(experts(permuted, perm.tokens_per_expert), perm, tokens.dtype), perm.tokens_per_expert
        ep_size = _size(self.ep)
        sent = perm.tokens_per_expert.view(ep_size, self.num_local)
        received = _exchange_counts(sent, self.ep)  # [EP sources, E_local]
        send_splits = _host(sent.sum(dim=1), permuted.shape[0])
        recv_splits = _host(received.sum(dim=1), permuted.shape[0])  # balanced: as many rows come as go
        h = _AllToAllV.apply(permuted, self.ep, recv_splits, send_splits, "moe_dispatch")
        grid = received.unsqueeze(0)  # [ETP sources, EP sources, E_local]
        if _size(self.etp) > 1:
            grid = torch.empty(_size(self.etp), *received.shape, dtype=received.dtype, device=received.device)
            comm.all_gather(grid.view(-1, self.num_local), received, self.etp, "moe_etp_counts")
            etp_counts = _host(grid.sum(dim=(1, 2)), sum(recv_splits) * _size(self.etp))
            h = _AllGatherV.apply(h, self.etp, etp_counts, "moe_etp_gather")
        sources = grid.view(-1, self.num_local)  # [ETP x EP sources, E_local], source-major
        per_expert = sources.sum(dim=0)
        y = sort_chunks(experts(sort_chunks(h, sources), per_expert), sources.T)
        if _size(self.etp) > 1:
            y = _ReduceScatterV.apply(y, self.etp, etp_counts, "moe_etp_scatter")
        y = _AllToAllV.apply(y, self.ep, send_splits, recv_splits, "moe_combine")
        return unpermute(y, perm, tokens.dtype), per_expert


class AllGatherDispatcher:
    def __init__(self, cfg: MoEConfig, ep: Group | None, etp_ep: Group | None):
        self.cfg, self.group = cfg, etp_ep
        self.local = local_experts(cfg.num_experts, ep)

    def __call__(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: GroupedExperts,
        num_out: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """As AllToAllDispatcher.__call__."""
        if _size(self.group) == 1:
            permuted, perm = permute(tokens, probs, routing_map, self.cfg.topk, num_out)
            return unpermute(experts(permuted, perm.tokens_per_expert), perm, tokens.dtype), perm.tokens_per_expert
        counts = [tokens.shape[0]] * _size(self.group)
        all_tokens = _AllGatherV.apply(tokens, self.group, counts, "moe_ag_tokens")
        all_probs = _AllGatherV.apply(probs, self.group, counts, "moe_ag_probs")
        all_map = comm.all_gather_v(routing_map.to(torch.uint8), counts, self.group, "moe_ag_map").bool()
        mine = slice(self.local.start, self.local.stop)
        local_probs, local_map = all_probs[:, mine], all_map[:, mine]
        slots = min(self.cfg.topk, len(self.local))  # a token reaches at most this many of the rank's experts
        if is_fake(all_map):  # shapes only: every gathered token, a balanced stand-in for the routed rows
            balanced = all_tokens.shape[0] * self.cfg.topk * len(self.local) // self.cfg.num_experts
            permuted, perm = permute(all_tokens, local_probs, local_map, slots, balanced)
            out = unpermute(experts(permuted, perm.tokens_per_expert), perm, tokens.dtype)
        else:  # only the gathered tokens routed here (a host sync): the combine's buffers span them alone
            chosen = local_map.any(dim=1).nonzero().squeeze(1)
            picked = all_tokens.index_select(0, chosen)  # unique rows: a deterministic backward
            permuted, perm = permute(picked, local_probs[chosen], local_map[chosen], slots)
            combined = unpermute(experts(permuted, perm.tokens_per_expert), perm, tokens.dtype)
            out = combined.new_zeros(all_tokens.shape).index_copy(0, chosen, combined)
        return _ReduceScatterV.apply(out, self.group, counts, "moe_ag_scatter"), perm.tokens_per_expert
