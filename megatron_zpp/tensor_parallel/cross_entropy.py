"""Cross-entropy over vocabulary-sharded logits without gathering them.

Each TP rank holds logits for its slice of the vocabulary. Three small all-reduces
(max, the target logit, the sum of exponentials) give the exact loss; the backward is
local: softmax - onehot on this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..topology import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp: Group):
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        comm.all_reduce(max_logit, tp, "tp_fwd_ce", op=dist.ReduceOp.MAX)
        logits = logits - max_logit.unsqueeze(-1)

        per_rank = logits.shape[-1]
        local = labels - tp.rank * per_rank
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0)
        target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target, sum_exp])
        comm.all_reduce(both, tp, "tp_fwd_ce")
        target, sum_exp = both[0], both[1]

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = grad_logits.view(-1, grad_logits.shape[-1])
        hit = (~outside).view(-1).to(rows.dtype)
        rows[torch.arange(rows.shape[0], device=rows.device), local.view(-1)] -= hit
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: Group | None) -> torch.Tensor:
    """Per-token loss (fp32) of `labels` under logits sharded over `tp` along the vocab."""
    if tp is None or tp.size == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits, labels, tp)
