"""Cross-entropy over vocabulary-sharded logits without gathering them.

Each TP rank holds logits for its slice of the vocabulary. One pass over the local logits
(ops.cross_entropy.local_stats) gives per row the local max m, the local sum of exp(x - m) and
the target logit when the label is in this slice; two small all-reduces combine them: MAX of m,
then SUM of [target, sum exp rescaled to the global max]. The backward is local: softmax -
onehot on this rank's slice, recomputed from the logits and the row's log-sum-exp, so no
softmax (and no fp32 copy of bf16 logits) is kept between forward and backward. Without TP
the same path runs with no collectives. Labels equal to `ignore_index` give loss 0 and no
gradient (as F.cross_entropy's default).
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
    def forward(ctx, logits, labels, tp: Group | None, ignore_index: int):
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
        return (lse - target).masked_fill_(ignored, 0.0).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        logits, local, lse, ignored = ctx.saved_tensors
        dloss = grad.reshape(-1).to(lse.dtype).masked_fill(ignored, 0.0)
        dx = ce.softmax_grad(logits.reshape(-1, logits.shape[-1]), local, lse, dloss)
        return dx.view(logits.shape), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp: Group | None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token loss (fp32; fp64 for fp64 logits) of `labels` under logits sharded over `tp`
    along the vocab (the whole vocab when `tp` is None or of size 1)."""
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, ignore_index)
