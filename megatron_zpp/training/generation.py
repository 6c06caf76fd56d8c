"""Greedy decoding with the model of a run (after training, --generate-tokens)."""

from __future__ import annotations

import torch

from ..generation import generate
from ..tensor_parallel.mappings import gather_from_tp
from .run import Run


@torch.no_grad()
def greedy_generate(run: Run, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """One pipeline stage, no CP; TP ranks decode together and agree, since they see the
    same gathered logits."""
    model = run.chunks[0]
    model.eval()
    seq, tp, vocab = run.cfg.model.seq_length, run.groups.tp, run.tokenizer.vocab_size

    def next_logits(ids: list[int]) -> torch.Tensor:
        context = torch.tensor([ids[-seq:]], device=run.device)
        if run.cfg.parallel.sequence_parallel:  # the sequence must split over TP: left-pad to a multiple
            context = torch.nn.functional.pad(context, (-context.shape[1] % tp.size, 0))
        return gather_from_tp(model(tokens=context), tp)[0, -1, :vocab]

    return generate(next_logits, prompt_ids, num_tokens, greedy=True)
