"""Megatron tensor-parallel layers.

Each sharded parameter records how it splits the full (single-rank) weight:
``param.tp_split = (dim, sections)``: the full tensor is cut along `dim` into
`sections` (e.g. q, k, v of a fused projection), and each section is split evenly over
the TP ranks. `init.py` uses this to build every shard from the full weight of the same
seed (so any layout starts from the single-rank model), and checkpoints use it to
reassemble full weights. With a TP group of size 1 the layers are plain linears.

Biases (`bias=True`, initialised to zero as Megatron's): a column-parallel bias is split like
the output rows (every fused section too) and added to this rank's slice; a row-parallel bias
is replicated and added once, after the all-reduce (or reduce-scatter): under sequence
parallelism each rank adds it to its own rows, so its gradient is a partial sum per TP rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from .. import comm
from ..topology import Group
from .mappings import (
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_to_sp,
    start_gather_seq,
    start_reduce_scatter_seq,
)


def _size(group: Group | None) -> int:
    return 1 if group is None else group.size


def mark(
    param: nn.Parameter, init: tuple, tp_split: tuple | None = None, tp_partial_grad: bool = False
) -> nn.Parameter:
    """Attach the init rule (('ones',), ('zeros',) or a random draw of model/init.py's DRAWS, e.g.
    ('normal', std)), the TP split, and whether the gradient of this replicated parameter is a
    partial sum per TP rank (the optimizer's finalize then sums it over TP)."""
    param.init = init
    param.tp_split = tp_split
    param.tp_partial_grad = tp_partial_grad
    return param


def is_expert(param) -> bool:
    """A routed expert's weight (moe/experts.py): held by its expert-parallel rank only, split over the
    expert-TP group (not TP), its gradient summed over the expert-data-parallel group (not DP x CP)."""
    return getattr(param, "expert_parallel", False)


def shard(full: torch.Tensor, tp_split: tuple | None, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of a full tensor."""
    if tp_split is None or size == 1:
        return full
    dim, sections = tp_split
    pieces = torch.split(full, list(sections), dim=dim)
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in pieces], dim=dim)


def unshard(pieces: list[torch.Tensor], tp_split: tuple | None) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's piece (in rank order)."""
    if tp_split is None or len(pieces) == 1:
        return pieces[0]
    dim, sections = tp_split
    size = len(pieces)
    local = [s // size for s in sections]
    per_rank = [torch.split(p, local, dim=dim) for p in pieces]
    return torch.cat([torch.cat([r[i] for r in per_rank], dim=dim) for i in range(len(sections))], dim=dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank computes its slice of y.

    `sections` lists the full output sizes of fused projections (q|k|v, gate|up) so
    each rank holds its share of every section. With sequence parallelism the input
    arrives sharded along the sequence and is all-gathered here; the backward keeps only
    the shard (see `column_parallel_product`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        tp: Group | None,
        init_std: float,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        bias: bool = False,
    ):
        super().__init__()
        sections = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        n = _size(tp)
        if any(s % n for s in sections):
            raise ValueError(f"output sections {sections} not divisible by TP size {n}")
        self.tp, self.sequence_parallel, self.gather_output = tp, sequence_parallel, gather_output
        self.weight = mark(
            nn.Parameter(torch.empty(sum(sections) // n, in_features)), ("normal", init_std), (0, tuple(sections))
        )
        self.bias = (
            mark(nn.Parameter(torch.empty(sum(sections) // n)), ("zeros",), (0, tuple(sections))) if bias else None
        )

    def forward(self, x: torch.Tensor, *shared: torch.Tensor):
        """shared: weights of further products of the same input (GLA's replicated low-rank gate),
        computed with this one (under TP in one autograd node) so that the input is kept, and under
        sequence parallelism gathered, once for all of them; their outputs then follow y: (y, *theirs)."""
        y, *theirs = column_parallel_product(x, [self.weight, *shared], self.tp, self.sequence_parallel)
        if self.bias is not None:
            y = y + self.bias
        y = gather_from_tp(y, self.tp) if self.gather_output else y
        return (y, *theirs) if shared else y


class _ColumnParallelProduct(torch.autograd.Function):
    """x W^T for each weight W, x the input of the tensor-parallel region (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication, for several weights sharing x).

    Sequence parallel: x is this rank's sequence shard. The forward all-gathers it and keeps
    only the shard for the backward; the backward starts the all-gather again, computes the
    input gradient while it runs, starts the reduce-scatter of that gradient and computes the
    weight gradients with the gathered input while that one runs. Otherwise x is replicated
    and its gradient is all-reduced over TP the same way, behind the weight gradients."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, *weights):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *weights)
        full = gather_seq(x, group, "sp_fwd_allgather", 1) if sequence_parallel else x
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        want_w = [need and g is not None for need, g in zip(ctx.needs_input_grad[3:], grads)]
        gathering, full = start_gather_seq(x, group, "sp_bwd_regather") if sp and any(want_w) else (None, x)
        grad_x, reducing = None, None
        if ctx.needs_input_grad[0]:
            for g, w in zip(grads, weights):
                if g is not None:
                    grad_x = g @ w if grad_x is None else grad_x.add_(g @ w)
        if gathering is not None:
            gathering.wait()
        if grad_x is not None:
            if sp:
                reducing, grad_x = start_reduce_scatter_seq(grad_x, group, "sp_bwd_reducescatter")
            else:
                reducing = comm.all_reduce(grad_x, group, "tp_bwd_allreduce", async_op=True)
        rows = full.reshape(-1, full.shape[-1]) if any(want_w) else None
        grad_w = [g.reshape(-1, g.shape[-1]).t() @ rows if want else None for g, want in zip(grads, want_w)]
        if reducing is not None:
            reducing.wait()
        return grad_x, None, None, *grad_w


def column_parallel_product(
    x: torch.Tensor, weights: list[torch.Tensor], tp: Group | None, sequence_parallel: bool
) -> tuple[torch.Tensor, ...]:
    """x W^T for each of `weights` (column-parallel shards, or replicated weights whose gradient
    is a partial sum over TP), x entering the TP region: under sequence parallelism x is this
    rank's sequence shard, all-gathered here, and only the shard is kept for the backward."""
    if _size(tp) == 1:
        return tuple(F.linear(x, w) for w in weights)
    return _ColumnParallelProduct.apply(x, tp, sequence_parallel, *weights)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, tp: Group | None, sequence_parallel: bool):
    """The column-parallel product with a weight held elsewhere (the tied output layer)."""
    return column_parallel_product(x, [weight], tp, sequence_parallel)[0]


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns: partial sums are all-reduced (or
    reduce-scattered along the sequence with sequence parallelism)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Group | None,
        init_std: float,
        sequence_parallel: bool = False,
        bias: bool = False,
    ):
        super().__init__()
        n = _size(tp)
        if in_features % n:
            raise ValueError(f"input size {in_features} not divisible by TP size {n}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = mark(
            nn.Parameter(torch.empty(out_features, in_features // n)), ("normal", init_std), (1, (in_features,))
        )
        self.bias = (
            mark(nn.Parameter(torch.empty(out_features)), ("zeros",), tp_partial_grad=sequence_parallel)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


class TokenIdError(ValueError):
    """A token id outside the embedding's rows: the data does not match the vocabulary."""


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids outside [0, vocab_size) on every TP rank alike (each sees the same ids), instead of an
    IndexError (TP 1) or the silent zero rows of a vocabulary-parallel lookup (TP > 1). On the CPU one
    min/max names the id; on an accelerator a device-side assert keeps the host from syncing every step
    (pretrain_gpt.py has already checked every token of the data files against the vocabulary)."""
    if ids.device.type != "cpu" or is_fake(ids):  # fake tensors (a dry run) hold no values to name
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(), _TOKEN_ID_HINT.format(bad="", n=vocab_size))
        return
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= vocab_size:
        raise TokenIdError(_TOKEN_ID_HINT.format(bad=f" {low if low < 0 else high}", n=vocab_size))


_TOKEN_ID_HINT = (
    "token id{bad} in the batch is outside the embedding's {n} rows: the data was tokenized "
    "with another tokenizer or --vocab-size is too small (pretrain_gpt.py checks every --data-path .bin)"
)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over TP ranks; each rank looks up the ids it
    owns and the partial results are summed (reduce-scattered with sequence parallel)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: Group | None, init_std: float, sequence_parallel: bool = False
    ):
        super().__init__()
        n = _size(tp)
        if vocab_size % n:
            raise ValueError(f"vocab size {vocab_size} not divisible by TP size {n}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.per_rank = vocab_size // n
        self.start = (tp.rank if tp else 0) * self.per_rank
        self.weight = mark(
            nn.Parameter(torch.empty(self.per_rank, hidden_size)), ("normal", init_std), (0, (vocab_size,))
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.per_rank * _size(self.tp))
        if _size(self.tp) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, self.tp) if self.sequence_parallel else reduce_from_tp(out, self.tp)
