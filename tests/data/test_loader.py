"""The rank-aware loader: Megatron's sample order, resume at a consumed-samples count,
and what each rank of the grid receives."""

import itertools
from types import SimpleNamespace

import numpy as np
import torch

from megatron_zpp.context_parallel.slices import sequence_slice
from megatron_zpp.data.loader import BatchIterator, MicroBatchSampler
from megatron_zpp.data.mock import MockGPTDataset


def test_sampler_order_covers_each_sample_once_per_round():
    dp, mbs = 4, 2
    taken = [list(itertools.chain.from_iterable(MicroBatchSampler(64, 0, mbs, r, dp))) for r in range(dp)]
    assert sorted(sum(taken, [])) == list(range(64))
    assert taken[1][:2] == [2, 3] and taken[1][2:4] == [10, 11]  # round of mbs x dp = 8 samples


def test_resume_at_consumed_samples_gives_the_same_next_batches():
    full = list(MicroBatchSampler(100, 0, 2, 1, 2))
    resumed = list(MicroBatchSampler(100, 24, 2, 1, 2))
    assert resumed == full[6:]  # 24 samples = 6 rounds of 2 x 2


def groups(tp_rank=0, cp_rank=0, cp=1, dp_rank=0, dp=1, first=True, last=True):
    return SimpleNamespace(
        tp_rank=tp_rank,
        cp_rank=cp_rank,
        cp=SimpleNamespace(size=cp),
        dp_rank=dp_rank,
        dp=SimpleNamespace(size=dp),
        is_first_stage=first,
        is_last_stage=last,
    )


def test_context_parallel_ranks_get_contiguous_slices_in_rank_order():
    data = MockGPTDataset(16, 32, 100, seed=3)
    full = next(BatchIterator(data, 0, 2, groups(), torch.device("cpu")))
    parts = [next(BatchIterator(data, 0, 2, groups(cp_rank=c, cp=4), torch.device("cpu"))) for c in range(4)]
    assert torch.equal(torch.cat([p["tokens"] for p in parts], dim=1), full["tokens"])
    assert torch.equal(torch.cat([p["labels"] for p in parts], dim=1), full["labels"])
    assert [sequence_slice(32, c, 4).start for c in range(4)] == [0, 8, 16, 24]  # the model's positions
    assert torch.equal(full["labels"][:, :-1], full["tokens"][:, 1:])


def test_pipeline_stages_read_only_what_they_need_and_tp_ranks_agree():
    data = MockGPTDataset(16, 32, 100, seed=3)
    first = next(BatchIterator(data, 0, 2, groups(last=False), torch.device("cpu")))
    last = next(BatchIterator(data, 0, 2, groups(first=False), torch.device("cpu")))
    middle = next(BatchIterator(data, 0, 2, groups(first=False, last=False), torch.device("cpu")))
    assert first["labels"] is None and last["tokens"] is None
    assert middle["tokens"] is None and middle["labels"] is None
    tp0 = next(BatchIterator(data, 0, 2, groups(tp_rank=0), torch.device("cpu")))
    tp1 = next(BatchIterator(data, 0, 2, groups(tp_rank=1), torch.device("cpu")))
    assert torch.equal(tp0["tokens"], tp1["tokens"])


def test_mock_data_is_deterministic_and_learnable():
    a, b = MockGPTDataset(4, 64, 50, seed=1), MockGPTDataset(4, 64, 50, seed=1)
    assert all(np.array_equal(a[i], b[i]) for i in range(4))
    assert len(a[0]) == 65 and a[0].max() < 50


def batches(it, n):
    return [next(it) for _ in range(n)]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys()
        and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        for x, y in zip(a, b)
    )


def test_background_workers_give_bitwise_the_batches_of_the_main_thread_and_resume():
    # DP rank 1 of 2, CP rank 1 of 2: 12 micro-batches of 2 from 50 samples (the last round is incomplete)
    data, cpu, g = MockGPTDataset(50, 32, 100, seed=5), torch.device("cpu"), groups(cp_rank=1, cp=2, dp_rank=1, dp=2)
    inline = list(BatchIterator(data, 0, 2, g, cpu, num_workers=0))
    assert len(inline) == 12
    for workers in (1, 3):
        assert same(list(BatchIterator(data, 0, 2, g, cpu, num_workers=workers)), inline), workers
    # resume at 16 consumed samples (4 rounds of 2 x 2), and stop/restart the threads mid-way
    it = BatchIterator(data, 16, 2, g, cpu, num_workers=2)
    first = batches(it, 3)
    it.close()
    assert same(first + list(it), inline[4:])
    assert it.wait_seconds > 0


def test_worker_errors_reach_the_step():
    class Broken(MockGPTDataset):
        def __getitem__(self, i):
            if i == 6:
                raise IndexError("sample 6 is unreadable")
            return super().__getitem__(i)

    it = BatchIterator(Broken(16, 32, 100, seed=1), 0, 2, groups(), torch.device("cpu"), num_workers=2)
    assert len(batches(it, 3)) == 3
    try:
        next(it)
        raise AssertionError("the error was lost")
    except IndexError as e:
        assert "sample 6" in str(e)


def test_sample_ids_checked_against_the_true_vocabulary():
    """Ids 100-127 of a 100-token vocabulary (padded to 128) are refused, naming the sample."""
    import pytest

    from megatron_zpp.data.loader import check_sample_ids
    from megatron_zpp.tensor_parallel.layers import TokenIdError

    good = [np.arange(100, dtype=np.uint16), np.zeros(5, np.int32)]
    check_sample_ids(good, [0, 1], 100)
    with pytest.raises(TokenIdError, match="token id 127 in sample 8 is outside the tokenizer's vocabulary of 100"):
        check_sample_ids([good[0], np.array([3, 127, 100], np.int32)], [7, 8], 100)
    with pytest.raises(TokenIdError, match="token id -1 in sample 3"):
        check_sample_ids([np.array([-1, 2], np.int32)], [3], 100)
