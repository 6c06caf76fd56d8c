"""Cross-entropy over vocabulary-sharded logits without gathering them.

Each TP rank holds logits for its slice of the vocabulary. One pass over the local logits
(ops.cross_entropy.local_stats) gives per row the local max m, the local sum of exp(x - m) and
the target logit when the label is in this slice; two small all-reduces combine them: MAX of m,
then SUM of [target, sum exp rescaled to the global max]. The backward is local: softmax -
onehot on this rank's slice, recomputed from the logits and the row's log-sum-exp, so no
softmax (and no fp32 copy of bf16 logits) is kept between forward and backward. Without TP
the same path runs with no collectives. Labels equal to `ignore_index` give loss 0 and no
gradient (as F.cross_entropy's default).

In-place gradient (`inplace_backward=True`, what the GPT model passes): the backward writes the
logits' gradient over the saved logits, so no second logits-sized buffer exists (2 GiB of bf16 at
8192 tokens x 128K vocab). Why a flag the caller sets and not Liger's way (the gradient computed in the
forward, into the logits): our loss is per token and the caller weights it (loss mask, micro-batch
scaling), so a forward-time gradient would need a second pass in the backward to scale it by dloss,
and the logits would be gone right after the forward (also under no_grad, in evaluation). With the
flag the backward does one read and one write of the logits, as now, and only a caller that knows
the logits are its own temporary (the output layer's product, which F.linear's backward does not
keep) opts in. Guards: a leaf tensor is never overwritten (it would become its own .grad), nor a
non-contiguous one (its reshape would be a copy); after the write the logits' version counter is
bumped, so any other autograd node that saved them, or a second backward through a retained graph,
raises PyTorch's "modified by an inplace operation" instead of reading the gradient as logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..ops import cross_entropy as ce
from ..topology import Group

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp: Group | None, ignore_index: int, inplace_backward: bool = False):
        per_rank = logits.shape[-1]
        x = logits.reshape(-1, per_rank)
        local = labels.reshape(-1) - (tp.rank * per_rank if tp is not None else 0)
        row_max, sum_exp, target = ce.local_stats(x, local)
        if tp is not None and tp.size > 1:
            global_max = row_max.clone()
            comm.all_reduce(global_max, tp, "tp_fwd_ce", op=dist.ReduceOp.MAX)
            both = torch.stack([target, sum_exp * (row_max - global_max).exp()])
            comm.all_reduce(both, tp, "tp_fwd_ce")
            row_max, target, sum_exp = global_max, both[0], both[1]
        lse = row_max + sum_exp.log()
        ignored = labels.reshape(-1) == ignore_index
        ctx.save_for_backward(logits, local, lse, ignored)
        ctx.inplace = inplace_backward and not logits.is_leaf and logits.is_contiguous()
        return (lse - target).masked_fill_(ignored, 0.0).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        logits, local, lse, ignored = ctx.saved_tensors
        dloss = grad.reshape(-1).to(lse.dtype).masked_fill(ignored, 0.0)
        dx = ce.softmax_grad(
            logits.view(-1, logits.shape[-1]) if ctx.inplace else logits.reshape(-1, logits.shape[-1]),
            local,
            lse,
            dloss,
            inplace=ctx.inplace,
        )
        if ctx.inplace:  # the logits are gone: a later reader of the saved tensor must fail loudly
            torch.autograd.graph.increment_version(logits)
        return dx.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp: Group | None,
    ignore_index: int = IGNORE_INDEX,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Per-token loss (fp32; fp64 for fp64 logits) of `labels` under logits sharded over `tp`
    along the vocab (the whole vocab when `tp` is None or of size 1). inplace_backward: the backward
    overwrites `logits` with their gradient (module docstring): only for logits nobody reads again."""
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, ignore_index, inplace_backward)
