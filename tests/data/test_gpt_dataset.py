"""GPTDataset / blends: coverage per epoch, determinism, blend fractions, build-on-one-rank, errors."""

import hashlib
import os

import numpy as np
import pytest

from megatron_zpp.data.blended import build_blending_indices, parse_data_path
from megatron_zpp.data.builder import build_gpt_datasets, describe_splits, parse_split
from megatron_zpp.data.gpt_dataset import split_ranges
from megatron_zpp.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter

SEQ = 16


def make_corpus(prefix, num_docs=50, seed=0, tag=0):
    """Token = tag*10^6 + doc*1000 + position: every token of the corpus is unique and traceable."""
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(prefix + ".bin", np.int32)
    for d in range(num_docs):
        n = int(rng.integers(1, 40))
        w.add_document(tag * 10**6 + d * 1000 + np.arange(n))
    w.finalize(prefix + ".idx")
    return prefix


def no_barrier():
    pass


def build(prefixes, num_samples, tmp_path, split="1,0,0", seed=1, cache="cache", builder=True, barrier=no_barrier):
    return build_gpt_datasets(list(prefixes), split, SEQ, seed, num_samples, str(tmp_path / cache), builder, barrier)


def in_stream_order(ds):
    """Samples in unshuffled order (the shuffle index is a permutation)."""
    inv = np.empty(len(ds), dtype=np.int64)
    inv[np.asarray(ds.shuffle_index, dtype=np.int64)] = np.arange(len(ds))
    return [ds[i] for i in inv]


@pytest.mark.parametrize("num_samples", [10, 200, 250])  # within one epoch; ~4 epochs, last one apart or not
def test_each_document_once_per_epoch_with_one_token_overlap(tmp_path, num_samples):
    prefix = make_corpus(str(tmp_path / "c"))
    indexed = IndexedDataset(prefix)
    train, valid, test = build([prefix], (num_samples, 0, 0), tmp_path)
    assert valid is None and test is None and len(train) >= num_samples
    assert sorted(np.asarray(train.shuffle_index)) == list(range(len(train)))
    samples = in_stream_order(train)
    assert all(s.shape == (SEQ + 1,) and s.dtype == np.int64 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]  # the label of one sample's last position is the next one's first input
    doc = np.asarray(train.document_index)
    n, epochs = len(indexed), len(doc) // len(indexed)
    assert (np.bincount(doc, minlength=n) == epochs).all()  # every document once per epoch
    inputs = np.concatenate([s[:-1] for s in samples])
    stream = np.concatenate([indexed[int(d)] for d in doc])
    np.testing.assert_array_equal(inputs, stream[: len(inputs)])  # the samples walk the document index
    assert 1 <= len(stream) - len(inputs) <= SEQ  # only the tail short of a full sample is dropped


def test_documents_shuffled_across_epochs_and_deterministic(tmp_path):
    prefix = make_corpus(str(tmp_path / "c"))
    a = build([prefix], (300, 0, 0), tmp_path, cache="c1")[0]
    b = build([prefix], (300, 0, 0), tmp_path, cache="c2")[0]
    c = build([prefix], (300, 0, 0), tmp_path, cache="c3", seed=2)[0]
    n = len(IndexedDataset(prefix))
    doc = np.asarray(a.document_index)
    assert len(set(doc[:n])) < n  # Megatron's order: all epochs' documents shuffled together
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert all(np.array_equal(a[i], b[i]) for i in range(0, len(a), 7))


def test_split_ranges_and_cache_reuse(tmp_path):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("98,2"), 10) == [(0, 10), None, None]  # 0.2 docs round to 0
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b")
    prefix = make_corpus(str(tmp_path / "c"), num_docs=100)
    train, valid, test = build([prefix], (100, 20, 5), tmp_path, split="80,15,5")
    assert len(train) >= 100 and len(valid) >= 20 and len(test) >= 5
    docs = lambda ds: {int(t) // 1000 for s in in_stream_order(ds) for t in s}  # noqa: E731
    assert docs(train) <= set(range(80)) and docs(valid) <= set(range(80, 95)) and docs(test) <= set(range(95, 100))
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len([f for f in files if f.endswith(".npy")]) == 9 and not [f for f in files if ".tmp" in f]
    mtimes = {f: os.path.getmtime(tmp_path / "cache" / f) for f in files}
    build([prefix], (100, 20, 5), tmp_path, split="80,15,5")  # same config: loaded, not rebuilt
    assert mtimes == {f: os.path.getmtime(tmp_path / "cache" / f) for f in files}
    make_corpus(prefix, num_docs=100, seed=5)  # data re-preprocessed: the old cache no longer matches
    build([prefix], (100, 20, 5), tmp_path, split="80,15,5")
    assert len(os.listdir(tmp_path / "cache")) > len(files)


@pytest.mark.parametrize("weights", [[0.2, 0.3, 0.5], [0.7, 0.3]])
def test_blend_fractions_within_one_over_n(tmp_path, weights):
    prefixes = [make_corpus(str(tmp_path / f"d{i}"), seed=i, tag=i + 1) for i in range(len(weights))]
    data_path = [x for w, p in zip(weights, prefixes) for x in (str(w * 10), p)]  # unnormalized on purpose
    train = build(data_path, (500, 0, 0), tmp_path)[0]
    assert len(train) == 500
    source = np.array([int(train[i][0]) // 10**6 - 1 for i in range(len(train))])
    np.testing.assert_array_equal(source, train.dataset_index)  # samples really come from that dataset
    n = np.arange(1, len(train) + 1)
    for i, w in enumerate(weights):
        assert (np.abs(np.cumsum(source == i) / n - w) <= 1 / n + 1e-12).all()


def test_blending_is_fast_and_exact_at_scale():
    w = [0.123, 0.456, 0.421]
    ids, within = build_blending_indices(w, 300_000)
    n = np.arange(1, len(ids) + 1)
    for i in range(3):
        hits = ids == i
        assert (np.abs(np.cumsum(hits) - w[i] * n) <= 1 + 1e-9).all()
        np.testing.assert_array_equal(within[hits], np.arange(hits.sum()))  # each sample used once, in order


def test_unweighted_blend_follows_sizes(tmp_path):
    a = make_corpus(str(tmp_path / "a"), num_docs=30, tag=1)
    b = make_corpus(str(tmp_path / "b"), num_docs=90, tag=2)
    assert parse_data_path([a, b]) == ([a, b], None)
    train = build([a, b], (400, 0, 0), tmp_path)[0]
    ta, tb = IndexedDataset(a).num_tokens, IndexedDataset(b).num_tokens
    assert np.mean(np.asarray(train.dataset_index) == 0) == pytest.approx(ta / (ta + tb), abs=1 / 400)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(IndexedDatasetError, match=str(tmp_path / "nope") + ".idx: missing"):
        build([str(tmp_path / "nope")], (1, 0, 0), tmp_path)
    with pytest.raises(ValueError, match="alternate"):
        parse_data_path(["0.5", "a", "b"])
    prefix = make_corpus(str(tmp_path / "c"))
    calls = []
    with pytest.raises(IndexedDatasetError, match="index cache missing on a non-builder rank"):
        build([prefix], (5, 0, 0), tmp_path, builder=False, barrier=lambda: calls.append(1))
    assert calls == [1]
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMAGIC!")
    with pytest.raises(IndexedDatasetError, match="bad magic"):
        build([prefix], (5, 0, 0), tmp_path, barrier=lambda: calls.append(2))
    assert calls == [1, 2]  # the failing builder still reached the barrier, so no rank hangs


def _rank_fn(rank, world_size, prefix, cache):
    import torch.distributed as dist

    barriers = []

    def barrier():
        barriers.append(1)
        dist.barrier()

    train = build_gpt_datasets([prefix], "1,0,0", SEQ, 3, (200, 0, 0), cache, rank == 0, barrier)[0]
    digest = hashlib.md5(np.stack([train[i] for i in range(len(train))]).tobytes()).hexdigest()
    return len(barriers), len(train), digest, sorted(os.listdir(cache))


def test_built_on_one_rank_others_wait_and_load(tmp_path):
    from tests.dist import run_distributed

    prefix = make_corpus(str(tmp_path / "c"))
    results = run_distributed(_rank_fn, 2, prefix, str(tmp_path / "cache"), timeout=120)
    assert [r[0] for r in results] == [1, 1]
    assert results[0][1:] == results[1][1:]
    local = build([prefix], (200, 0, 0), tmp_path, seed=3, cache="again")[0]  # and across runs
    assert hashlib.md5(np.stack([local[i] for i in range(len(local))]).tobytes()).hexdigest() == results[0][2]


def _corpus_of_lengths(prefix, lengths):
    w = IndexedDatasetWriter(prefix + ".bin", np.int32)
    for d, n in enumerate(lengths):
        w.add_document(d * 1000 + np.arange(n))
    w.finalize(prefix + ".idx")
    return prefix


def test_cache_rebuilt_when_repreprocessed_with_the_same_counts(tmp_path):
    """Same sequence and token counts, other lengths, even the same size and mtime: keyed by the .idx's
    content, the cache is rebuilt (it was reused, and its samples ran past the new documents: IndexError)."""
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 40, 60)]
    prefix = _corpus_of_lengths(str(tmp_path / "c"), lengths)
    build([prefix], (50, 0, 0), tmp_path)
    st = os.stat(prefix + ".idx")
    _corpus_of_lengths(prefix, lengths[::-1])
    os.utime(prefix + ".idx", ns=(st.st_atime_ns, st.st_mtime_ns))  # a rewrite that keeps the mtime
    again = build([prefix], (50, 0, 0), tmp_path)[0]
    fresh = build([prefix], (50, 0, 0), tmp_path, cache="fresh")[0]
    assert all(np.array_equal(again[i], fresh[i]) for i in range(len(fresh)))


def test_unwritable_cache_is_one_error_naming_the_flag(tmp_path):
    prefix = make_corpus(str(tmp_path / "c"))
    (tmp_path / "file").write_text("")
    with pytest.raises(
        IndexedDatasetError, match=r"cannot write the dataset index cache in .*give a writable --data-cache"
    ):
        build([prefix], (10, 0, 0), tmp_path, cache="file/cache")


def test_start_up_line_per_split_names_each_dataset(tmp_path):
    a = make_corpus(str(tmp_path / "a"), num_docs=50, tag=1)
    b = make_corpus(str(tmp_path / "b"), num_docs=20, seed=1, tag=2)
    blend = build(["0.75", a, "0.25", b], (200, 10, 0), tmp_path, split="90,10,0")
    train, valid, test = describe_splits(blend, "90,10,0", SEQ)
    tokens_a = int(IndexedDataset(a).sequence_lengths[:45].sum())
    epochs_a = len(blend[0].datasets[0].document_index) // 45
    assert train.startswith(
        f"data train: {len(blend[0])} samples of {SEQ}+1 tokens from 0.75 x {a} (documents 0:45 of 50"
    )
    assert f"{tokens_a:,} tokens, 151 of {len(blend[0].datasets[0])} samples, {epochs_a} epochs" in train
    assert f" + 0.25 x {b} (documents 0:18 of 20" in train and train.endswith("; --split 90,10,0")
    assert valid.startswith(f"data valid: {len(blend[1])} samples") and "documents 45:50 of 50" in valid
    assert test == "data test: none (--split 90,10,0 leaves it no documents)"
    (single,) = describe_splits(build([a], (200, 0, 0), tmp_path)[:1], "1", SEQ)
    assert f"from {a} (documents 0:50 of 50" in single  # 57 samples an epoch: the 4th gives 29 of them
    assert "4 epochs, the last shuffled apart)" in single
