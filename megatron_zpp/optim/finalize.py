"""The gradient syncs every layout needs before the optimizer step (Megatron's
finalize_model_grads), in this order:

1. parameters replicated over TP whose inputs were sequence-parallel shards (norm
   weights under --sequence-parallel) hold partial gradients: sum them over TP;
2. a tied embedding lives on the first and the last pipeline stage: sum its two
   gradients over the embedding group so both copies take the same step;
3. average everything over the data-parallel (x context-parallel) group."""
from __future__ import annotations

import torch

from .. import comm
from ..topology import ProcessGroups


def finalize_model_grads(chunks: list[torch.nn.Module], groups: ProcessGroups, grads) -> None:
    """grads: the zero.GradBuffer holding every parameter's main_grad."""
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    sp = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    if sp and groups.tp.size > 1:
        flat = torch.cat([g.reshape(-1) for g in sp])
        comm.all_reduce(flat, groups.tp, "sp_norm_grad_allreduce")
        offset = 0
        for g in sp:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    if "embedding" in groups and groups.embedding.size > 1:  # middle stages hold no embedding
        for chunk in chunks:
            if hasattr(chunk, "embedding") and chunk.tied:
                comm.all_reduce(chunk.embedding.weight.main_grad, groups.embedding, "embedding_grad_allreduce")

    grads.all_reduce_mean(groups.dp_cp)
