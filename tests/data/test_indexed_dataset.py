"""The .bin/.idx format against a reference reader/writer written here from the spec alone."""

import os
import struct

import numpy as np
import pytest

from megatron_zpp.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    token_dtype,
)
from tools import merge_datasets

# --- reference implementation, straight from Megatron's documented layout -------------------
SPEC_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def ref_write(prefix, docs, dtype):
    """One sequence per document, like Megatron's preprocess_data without sentence splitting."""
    lengths = [len(d) for d in docs]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.array(d, dtype=dtype).tobytes())
    itemsize = np.dtype(dtype).itemsize
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", SPEC_CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(struct.pack(f"<{len(docs)}i", *lengths))
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def ref_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    dtype = {v: k for k, v in SPEC_CODES.items()}[raw[17]]
    n, d = struct.unpack_from("<QQ", raw, 18)
    lengths = struct.unpack_from(f"<{n}i", raw, 34)
    pointers = struct.unpack_from(f"<{n}q", raw, 34 + 4 * n)
    doc_idx = struct.unpack_from(f"<{d}q", raw, 34 + 12 * n)
    data = np.fromfile(prefix + ".bin", dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    seqs = [data[p // itemsize : p // itemsize + n_] for p, n_ in zip(pointers, lengths)]
    return dtype, seqs, list(doc_idx)


def random_docs(rng, dtype, n=40):
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    hi = min(info.max, 60000) if info else 1000
    lo = max(info.min, -1000) if info else -1000
    return [rng.integers(lo, hi, size=rng.integers(0, 30)).astype(dtype) for _ in range(n)]


def write_ours(prefix, docs, dtype):
    w = IndexedDatasetWriter(prefix + ".bin", dtype)
    for d in docs:
        w.add_document(d)
    w.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", list(SPEC_CODES))
def test_byte_identical_and_round_trip_every_dtype(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, dtype)
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    write_ours(ours, docs, dtype)
    ref_write(ref, docs, dtype)
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(ref + ext, "rb").read(), ext
    ds = IndexedDataset(ref)  # our reader on reference files
    ds.verify()
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(docs) and ds.num_documents == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    got_dtype, seqs, doc_idx = ref_read(ours)  # reference reader on our files
    assert got_dtype is dtype and doc_idx == list(range(len(docs) + 1))
    for s, d in zip(seqs, docs):
        np.testing.assert_array_equal(s, d)


def test_batch_writes_match_single_writes_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(IndexedDatasetWriter, "BLOCK", 7)  # force the streamed index into many blocks
    rng = np.random.default_rng(1)
    docs = random_docs(rng, np.uint16, n=50)
    w = IndexedDatasetWriter(str(tmp_path / "a.bin"), np.uint16)
    for k in range(0, 50, 9):
        part = docs[k : k + 9]
        w.add_batch(np.concatenate(part), np.array([len(d) for d in part]))
    w.finalize(str(tmp_path / "a.idx"))
    ref_write(str(tmp_path / "r"), docs, np.uint16)
    assert open(tmp_path / "a.idx", "rb").read() == open(tmp_path / "r.idx", "rb").read()
    assert not os.path.exists(tmp_path / "a.bin.lengths")


def test_get_slices_and_dtype_choice(tmp_path):
    ref_write(str(tmp_path / "x"), [[1, 2, 3, 4], [5]], np.int32)
    ds = IndexedDataset(str(tmp_path / "x"))
    np.testing.assert_array_equal(ds.get(0, 1, 2), [2, 3])
    with pytest.raises(IndexError):
        ds.get(1, 0, 2)
    assert token_dtype(32000) is np.uint16 and token_dtype(65500) is np.int32
    assert set(DTYPE_CODES) == set(SPEC_CODES.values())


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "fault, needle",
    [
        ("magic", "bad magic"),
        ("version", "unsupported version 2"),
        ("dtype", "unknown dtype code 9"),
        ("truncated_idx", "truncated or corrupt"),
        ("short_bin", "do not belong together"),
        ("missing_bin", "missing"),
        ("tiny_idx", "truncated header"),
    ],
)
def test_reader_names_file_and_fault(tmp_path, fault, needle):
    prefix = str(tmp_path / "d")
    ref_write(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    if fault == "magic":
        corrupt(prefix + ".idx", 0, b"XXXX")
    elif fault == "version":
        corrupt(prefix + ".idx", 9, struct.pack("<Q", 2))
    elif fault == "dtype":
        corrupt(prefix + ".idx", 17, b"\x09")
    elif fault == "truncated_idx":
        os.truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8)
    elif fault == "short_bin":
        os.truncate(prefix + ".bin", 4)
    elif fault == "missing_bin":
        os.remove(prefix + ".bin")
    elif fault == "tiny_idx":
        os.truncate(prefix + ".idx", 10)
    with pytest.raises(IndexedDatasetError, match=needle) as e:
        IndexedDataset(prefix)
    assert prefix in str(e.value)
    assert isinstance(e.value, ValueError)


def test_merge_matches_concatenation(tmp_path):
    rng = np.random.default_rng(2)
    a, b = random_docs(rng, np.uint16, 10), random_docs(rng, np.uint16, 7)
    d = tmp_path / "parts"
    d.mkdir()
    ref_write(str(d / "b"), b, np.uint16)  # sorted order: a then b
    ref_write(str(d / "a"), a, np.uint16)
    assert merge_datasets.main(["--input", str(d), "--output-prefix", str(tmp_path / "m")]) == 0
    ref_write(str(tmp_path / "r"), a + b, np.uint16)
    for ext in (".bin", ".idx"):
        assert open(tmp_path / ("m" + ext), "rb").read() == open(tmp_path / ("r" + ext), "rb").read()
    ref_write(str(d / "c"), [[1, 2]], np.int32)  # mixed dtypes: refused, nothing written
    assert merge_datasets.main(["--input", str(d), "--output-prefix", str(tmp_path / "bad")]) == 1
    assert not list(tmp_path.glob("bad*"))


def test_no_mmap_bin_files_reads_the_file(tmp_path):
    """--no-mmap-bin-files: the .bin is never mapped; every read gives the tokens written."""
    docs = [[7, 8, 9], [], [1, 2, 3, 4, 5], [6]]
    ref_write(str(tmp_path / "x"), docs, np.uint16)
    ds = IndexedDataset(str(tmp_path / "x"), mmap_bin=False)
    assert not isinstance(ds._bin, np.memmap) and ds._bin.nbytes == 0  # nothing of the .bin held
    for i, d in enumerate(docs):
        got = ds[i]
        assert got.dtype == np.uint16 and got.tolist() == d and not got.flags.writeable
    assert ds.get(2, 1, 3).tolist() == [2, 3, 4]
    assert IndexedDataset(str(tmp_path / "x")).get(2, 1, 3).tolist() == [2, 3, 4]  # the mapped reader agrees


def test_no_mmap_bin_files_flag_reaches_the_datasets(tmp_path):
    from megatron_zpp.config.arguments import parse_args
    from megatron_zpp.data.builder import build_gpt_datasets

    assert parse_args(["--no-mmap-bin-files"]).data.mmap_bin_files is False
    assert parse_args([]).data.mmap_bin_files is True
    ref_write(str(tmp_path / "c"), [list(range(1 + i, 20 + i)) for i in range(12)], np.uint16)
    args = ([str(tmp_path / "c")], "10,1,1", 8, 3, (6, 2, 0), str(tmp_path / "cache"))
    built = {m: build_gpt_datasets(*args, is_builder=True, barrier=lambda: None, mmap_bin=m)[0] for m in (True, False)}
    assert not built[False].indexed.mmap_bin and built[True].indexed.mmap_bin
    for i in range(6):
        np.testing.assert_array_equal(built[False][i], built[True][i])


def test_verify_checks_every_entry_across_blocks(tmp_path, monkeypatch):
    """verify() runs in blocks (bounded memory): the running pointer carries from block to block, and
    a bad pointer, a negative length or a decreasing boundary deep in the index is named."""
    import megatron_zpp.data.indexed_dataset as ixd

    monkeypatch.setattr(ixd, "VERIFY_BLOCK", 3)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 100, int(rng.integers(0, 6))).tolist() for _ in range(20)]
    prefix = str(tmp_path / "d")
    ref_write(prefix, docs, np.uint16)
    IndexedDataset(prefix).verify()  # the reference's own pair is consistent
    n, idx = len(docs), open(prefix + ".idx", "rb").read()
    cases = [
        (34 + 4 * n + 8 * 13, struct.pack("<q", 2), "pointer of sequence 13 is 2"),
        (34 + 4 * 11, struct.pack("<i", -1), "sequence 11 has a negative length"),
        (34 + 12 * n + 8 * 9, struct.pack("<q", 1), "document indices decrease"),
    ]
    for offset, data, needle in cases:
        with open(prefix + ".idx", "wb") as f:
            f.write(idx[:offset] + data + idx[offset + len(data) :])
        with pytest.raises(IndexedDatasetError, match=needle):
            IndexedDataset(prefix).verify()
