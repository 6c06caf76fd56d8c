"""Packed documents from EOD tokens (data/documents.py, data/loader.py): Megatron's meaning of
--reset-position-ids, --reset-attention-mask and --eod-mask-loss on a hand-computed sample and
against a transcription of Megatron's loop; CP slices; the masked loss's mean over CP ranks;
every pipeline stage receives the documents."""

import numpy as np
import torch

from megatron_zpp.context_parallel.attention import _mask
from megatron_zpp.data.documents import build_documents, document_ids, eod_loss_mask
from megatron_zpp.data.loader import BatchIterator, Packing, make_batch
from megatron_zpp.data.mock import MockGPTDataset
from tests.data.test_loader import groups

E = 9  # the EOD id of these samples


def test_hand_computed_sample():
    data = torch.tensor([[5, 7, E, 3, E, E, 6, 2, 4]])  # a sample: inputs are data[:-1]
    tokens = data[:, :-1]
    docs = build_documents(tokens, E, True, True, 0, 8)
    assert docs.doc_ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # an EOD belongs to the document it ends
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert docs.starts(8).tolist() == [[False, False, False, True, False, True, True, False]]
    # no loss where the *input* is EOD: the predictions of 3, E and 6 from an EOD are masked
    assert eod_loss_mask(tokens, E).tolist() == [[1, 1, 0, 1, 0, 0, 1, 1]]
    mask = _mask(0, 8, 8, docs.doc_ids, tokens.device)[0, 0].int()
    assert mask[3].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]  # first token of document 1 sees itself only
    assert mask[4].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # document 1's EOD sees its own document
    assert mask[7].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    only_positions = build_documents(tokens, E, True, False, 0, 8)
    assert only_positions.doc_ids is None and not only_positions.separate  # attention crosses documents
    assert build_documents(tokens, E, False, False, 0, 8) is None


def megatron_loop(tokens: torch.Tensor, eod: int):
    """Megatron's per-sample loop (get_ltor_masks_and_position_ids), transcribed: for each EOD at i,
    later tokens stop seeing 0..i and their positions drop by the length of the document."""
    T = tokens.shape[0]
    mask, positions = torch.ones(T, T).tril(), torch.arange(T)
    prev = 0
    for i in (tokens == eod).nonzero().flatten().tolist():
        mask[i + 1 :, : i + 1] = 0
        positions[i + 1 :] -= i + 1 - prev
        prev = i + 1
    return mask.bool(), positions


def test_matches_megatrons_loop_on_random_samples():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (6, 40), generator=gen)  # EOD = 3: about one token in four
    tokens[0, 0] = tokens[1, -1] = 3  # an EOD first, an EOD last
    docs = build_documents(tokens, 3, True, True, 0, 40)
    masks = _mask(0, 40, 40, docs.doc_ids, tokens.device)
    for b in range(6):
        mask, positions = megatron_loop(tokens[b], 3)
        assert torch.equal(masks[b, 0], mask) and torch.equal(docs.positions[b], positions)


def test_context_parallel_slices_and_masked_loss_mean():
    data = MockGPTDataset(4, 32, 50, seed=2, eod=49)
    samples = [data[i] for i in range(4)]
    packing = Packing(49, True, True, True)
    full = make_batch(samples, 0, 1, True, True, torch.device("cpu"), packing)
    parts = [make_batch(samples, c, 4, True, True, torch.device("cpu"), packing) for c in range(4)]
    assert (full["tokens"] == 49).sum() >= 4  # the mock samples pack documents
    positions = torch.cat([p["documents"].positions for p in parts], dim=1)
    assert torch.equal(positions, full["documents"].positions)
    for p in parts:  # every rank knows every token's document
        assert torch.equal(p["documents"].doc_ids, full["documents"].doc_ids)
    assert torch.equal(torch.cat([p["loss_mask"] for p in parts], dim=1), full["loss_mask"])
    # the schedule's loss on each CP rank, sum(loss * mask) / loss_tokens, averages over CP to the masked mean
    per_token = torch.rand(full["tokens"].shape, generator=torch.Generator().manual_seed(1))
    local = [(per_token[:, 8 * c : 8 * c + 8] * p["loss_mask"]).sum() / p["loss_tokens"] for c, p in enumerate(parts)]
    masked_mean = (per_token * full["loss_mask"]).sum() / full["loss_mask"].sum()
    torch.testing.assert_close(torch.stack(local).mean(), masked_mean, rtol=1e-6, atol=0)


def test_every_pipeline_stage_gets_the_documents():
    data = MockGPTDataset(8, 32, 50, seed=3, eod=49)
    packing = Packing(49, reset_position_ids=True)
    first, middle, last = (
        next(BatchIterator(data, 0, 2, groups(first=f, last=la), torch.device("cpu"), packing))
        for f, la in ((True, False), (False, False), (False, True))
    )
    assert middle["tokens"] is None and middle["labels"] is None
    for b in (middle, last):
        assert torch.equal(b["documents"].positions, first["documents"].positions)
    assert "loss_mask" not in last  # no --eod-mask-loss


def test_mock_documents_end_with_eod():
    plain, packed = MockGPTDataset(3, 64, 50, seed=4), MockGPTDataset(3, 64, 50, seed=4, eod=49)
    for i in range(3):
        assert len(packed[i]) == 65 and (plain[i] < 49).all()
        ids = document_ids(torch.from_numpy(packed[i])[None], 49)[0].numpy()
        assert ids[-1] >= 1 and np.all(packed[i][np.flatnonzero(np.diff(ids))] == 49)
