"""Our sample stream against megatron-core's own BlendedMegatronDatasetBuilder (the test extra
`megatron`, installed by tools/setup_env.sh), sample for sample, on .bin/.idx files our writer makes:
a corpus read for several epochs with its last epoch mostly used (shuffled with the others) and
barely used (shuffled apart), a weighted three-corpus blend split three ways, and an unweighted
blend within one epoch of each and past it (there megatron-core's blend falls short of the samples asked;
ours is its stream, then reshuffled passes of it)."""

import types
import warnings

import numpy as np
import pytest

from megatron_zpp.data.builder import build_gpt_datasets, describe_splits
from megatron_zpp.data.gpt_dataset import separate_final_epoch
from tests.data.test_gpt_dataset import make_corpus

with warnings.catch_warnings():  # megatron-core's notes that Transformer Engine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlend
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

SEQ, SEED = 16, 1234
pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")  # no process group: rank 0
# The builder reads the tokenizer's vocabulary size and identifiers only; the samples' tokens come unpadded.
TOKENIZER = types.SimpleNamespace(vocab_size=None, eod=0, pad=-1, unique_identifiers={"class": "stub"})


def megatron_splits(prefixes, weights, split, sizes, cache):
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=cache,
        tokenizer=TOKENIZER,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(MegatronGPT, list(sizes), lambda: True, config).build()


def megatron_tokens(ds, i):
    """The seq_length + 1 tokens of Megatron's sample i, before its tokens/labels split."""
    if isinstance(ds, MegatronBlend):
        return megatron_tokens(ds.datasets[ds.dataset_index[i]], int(ds.dataset_sample_index[i]))
    return ds._query_document_sample_shuffle_indices(i)[0]


def assert_same_samples(ours, theirs):
    for split, (a, b) in enumerate(zip(ours, theirs)):
        assert (a is None) == (b is None), f"split {split}: ours {a}, Megatron's {b}"
        if a is None:
            continue
        assert len(a) == len(b), f"split {split}"
        for i in range(len(a)):
            np.testing.assert_array_equal(a[i], megatron_tokens(b, i), err_msg=f"split {split} sample {i}")


# The 40 training documents make 49 samples per epoch: 190 samples take 43 (> 80%) from the 4th epoch, 155 take 8.
@pytest.mark.parametrize("train_samples,separated", [(190, False), (155, True)])
def test_single_corpus_over_epochs_as_megatron(tmp_path, train_samples, separated):
    prefix = make_corpus(str(tmp_path / "c"))
    sizes = (train_samples, 30, 12)  # valid and test: a few documents each, read for many epochs
    ours = build_gpt_datasets([prefix], "80,15,5", SEQ, SEED, sizes, str(tmp_path / "ours"), True, lambda: None)
    theirs = megatron_splits([prefix], None, "80,15,5", sizes, str(tmp_path / "megatron"))
    train = ours[0]
    tokens = int(train.indexed.sequence_lengths[:40].sum())
    epochs = len(train.document_index) // 40
    assert epochs == 4 and separate_final_epoch(train_samples, tokens, epochs, SEQ) == separated
    assert (sorted(train.document_index[-40:]) == np.arange(40)).all() == separated  # the last epoch apart
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.document_index, b.document_index)
    assert_same_samples(ours, theirs)


def test_weighted_blend_over_epochs_as_megatron(tmp_path):
    prefixes = [make_corpus(str(tmp_path / f"d{i}"), num_docs=n, seed=i, tag=i + 1) for i, n in enumerate((50, 70, 30))]
    weights = [5.0, 3.0, 2.0]  # unnormalized on purpose
    data_path = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    sizes = (450, 40, 20)  # train: ~4 epochs of the first corpus; valid and test: many of their few documents
    ours = build_gpt_datasets(data_path, "90,5,5", SEQ, SEED, sizes, str(tmp_path / "ours"), True, lambda: None)
    theirs = megatron_splits(prefixes, weights, "90,5,5", sizes, str(tmp_path / "megatron"))
    assert max(len(d.document_index) // len(d.indexed) for d in ours[0].datasets) >= 3
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
        np.testing.assert_array_equal(a.dataset_sample_index, b.dataset_sample_index)
    assert_same_samples(ours, theirs)


def test_unweighted_blend_as_megatron_within_one_epoch(tmp_path):
    prefixes = [make_corpus(str(tmp_path / f"d{i}"), num_docs=n, seed=i, tag=i + 1) for i, n in enumerate((50, 30))]
    sizes = (60, 4, 3)  # within one epoch of each: Megatron blends them in proportion to their samples
    ours = build_gpt_datasets(prefixes, "80,10,10", SEQ, SEED, sizes, str(tmp_path / "ours"), True, lambda: None)
    theirs = megatron_splits(prefixes, None, "80,10,10", sizes, str(tmp_path / "megatron"))
    assert [len(d) for d in ours] == list(sizes)  # not capped at one epoch's samples
    for a, b in zip(ours, theirs):
        assert [len(d.document_index) for d in a.datasets] == [len(d.indices) for d in b.datasets]  # 1 epoch
        np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
    assert_same_samples(ours, theirs)


def test_unweighted_blend_past_one_epoch_starts_as_megatron(tmp_path):
    """Asked for 2.5 epochs of the blend: megatron-core's builder gives one (the sum of the datasets'
    epochs); ours is that stream sample for sample, then passes over the same samples, each reshuffled."""
    prefixes = [make_corpus(str(tmp_path / f"d{i}"), num_docs=n, seed=i, tag=i + 1) for i, n in enumerate((50, 30))]
    theirs = megatron_splits(prefixes, None, "80,10,10", (10**6, 4, 3), str(tmp_path / "megatron"))
    epoch = len(theirs[0])
    want = epoch * 5 // 2
    ours = build_gpt_datasets(prefixes, "80,10,10", SEQ, SEED, (want, 4, 3), str(tmp_path / "ours"), True, lambda: None)
    train = ours[0]
    assert len(train) == want and epoch == sum(len(d) for d in theirs[0].datasets)  # megatron-core: one epoch
    pairs = np.stack([train.dataset_index, train.dataset_sample_index], axis=1)
    np.testing.assert_array_equal(pairs[:epoch, 0], theirs[0].dataset_index)
    np.testing.assert_array_equal(pairs[:epoch, 1], theirs[0].dataset_sample_index)
    for i in range(epoch):
        np.testing.assert_array_equal(train[i], megatron_tokens(theirs[0], i), err_msg=f"sample {i}")
    first = sorted(map(tuple, pairs[:epoch]))
    for k in (1, 2):  # the next pass whole, the last half-pass: the first pass's samples, in another order
        part = pairs[k * epoch : (k + 1) * epoch]
        assert sorted(map(tuple, part)) == first if k == 1 else set(map(tuple, part)) <= set(first)
        assert not np.array_equal(part, pairs[: len(part)])
    line = describe_splits(ours, "80,10,10", SEQ)[0]
    assert line.startswith(f"data train: {want:,} samples (2.5 passes of megatron-core's {epoch:,}-sample blend, "), (
        line
    )
