"""Document structure of packed samples, from their EOD tokens, with Megatron-LM's meaning.

Megatron (megatron/core/datasets/gpt_dataset.py, `_get_ltor_masks_and_position_ids`) looks
at the *input* tokens (the sample without its last token):

* --reset-attention-mask: a token after an EOD at i attends to no token <= i, so the EOD
  belongs to the document it ends and the next document starts at i + 1;
* --reset-position-ids: positions restart at 0 at i + 1;
* --eod-mask-loss: loss_mask[input == EOD] = 0, i.e. no loss on the prediction made *from*
  an EOD (the next document's first token); predicting the EOD itself is still trained.

Here the documents are one integer per token (its document's index in the sample, for the
whole sequence: every CP rank knows them all) instead of Megatron's [T, T] mask, and all of
it is computed on the device from the tokens.
"""

from __future__ import annotations

import torch

from ..model.documents import Documents


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, T] -> [B, T] int64: the number of EODs strictly before each token."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(1) - is_eod


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, T] positions from each document's first token."""
    T = doc_ids.shape[1]
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(first, index, torch.zeros_like(index)).cummax(1).values
    return index - start


def build_documents(
    tokens: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool, offset: int, length: int
) -> Documents | None:
    """The Documents of CP slice [offset, offset + length) of full-sequence `tokens` [B, T]; None when
    neither flag is set (the model then uses absolute positions and full causal attention)."""
    if not (reset_position_ids or reset_attention_mask):
        return None
    ids = document_ids(tokens, eod)
    positions = document_positions(ids)[:, offset : offset + length].contiguous() if reset_position_ids else None
    return Documents(positions, ids if reset_attention_mask else None, offset)


def eod_loss_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, T] float: 0 where the input token is EOD (--eod-mask-loss), else 1."""
    return (tokens != eod).float()
