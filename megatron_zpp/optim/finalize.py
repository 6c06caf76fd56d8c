"""The gradient syncs every layout needs besides the data-parallel reduction (Megatron's
finalize_model_grads), written once for every engine:

1. parameters replicated over TP whose gradient is a partial sum per TP rank
   (`param.tp_partial_grad`: norm weights under --sequence-parallel, whose inputs were
   sequence shards): sum them over TP;
2. a tied embedding lives on the first and the last pipeline stage: sum its two
   gradients over the embedding group so both copies take the same step.

Both are linear, so they commute with the data-parallel sum: every engine runs them after
its data-parallel reduction (which may overlap the backward), the plain engine on the
averaged full gradients, the ZeRO engine on its reduced shards."""

from __future__ import annotations

import torch

from .. import comm
from ..topology import ProcessGroups


def finalize_model_grads(
    tp_partial: list[torch.Tensor], tied_embedding: list[torch.Tensor], groups: ProcessGroups
) -> None:
    """tp_partial: gradients (or their shards) to sum over TP; tied_embedding: the tied
    embedding's gradient (or shard) on an end stage, [] elsewhere."""
    if tp_partial and groups.tp.size > 1:  # one all-reduce for all of them
        flat = torch.cat([g.reshape(-1) for g in tp_partial])
        comm.all_reduce(flat, groups.tp, "sp_norm_grad_allreduce")
        offset = 0
        for g in tp_partial:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    if "embedding" in groups and groups.embedding.size > 1:  # middle stages hold no embedding
        for g in tied_embedding:
            comm.all_reduce(g, groups.embedding, "embedding_grad_allreduce")
