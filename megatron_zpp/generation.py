"""Autoregressive decoding, one token at a time (no KV cache: each step re-reads the
context), shared by tools/generate.py (a consolidated single-rank model) and training's
--generate-tokens (the run's TP-sharded model).

    new_ids = generate(next_logits, prompt_ids, 32, top_p=0.9)

`next_logits(ids)` returns the 1-D logits of the token after `ids`, restricted to the real
vocabulary (padding rows are never sampled)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def next_token(
    logits: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from 1-D logits."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(
    next_logits: Callable[[list[int]], torch.Tensor],
    prompt_ids: list[int],
    max_new_tokens: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eod: int | None = None,
    seed: int = 0,
) -> list[int]:
    """New token ids after `prompt_ids` (stops early at `eod` when given)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        tok = next_token(next_logits(ids), greedy, temperature, top_k, top_p, gen)
        ids.append(tok)
        if eod is not None and tok == eod:
            break
    return ids[len(prompt_ids) :]
