"""Megatron's mmap `.bin/.idx` token store: a checking reader and a streaming writer.

Layout of `PREFIX.idx` (little endian), exactly as Megatron-LM writes it:
    9 bytes  magic b"MMIDIDX\\x00\\x00"
    u64      version = 1
    u8       dtype code (see DTYPE_CODES)
    u64      sequence count N
    u64      document count D (documents + 1)
    int32[N] sequence lengths in tokens
    int64[N] byte offset of each sequence in PREFIX.bin
    int64[D] document boundaries as sequence indices, starting at 0
`PREFIX.bin` is the raw tokens of every sequence back to back.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
VERIFY_BLOCK = 1 << 22  # index entries per step of verify(): 64 MiB of int64 work arrays at most


class IndexedDatasetError(ValueError):
    """A `.bin/.idx` pair that is missing or malformed; the message names the file and the fault."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def token_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 when every id fits with margin, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def encode_header(dtype, num_sequences: int, num_documents: int) -> bytes:
    """`num_documents` counts boundaries (documents + 1), as stored."""
    code = CODE_OF_DTYPE[np.dtype(dtype)]
    return (
        MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", code) + struct.pack("<QQ", num_sequences, num_documents)
    )


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair through np.memmap; nothing is loaded eagerly. With
    `mmap_bin=False` (--no-mmap-bin-files, as Megatron's file reader) the `.bin` is not mapped: each
    `get` reads its tokens from the file (for file systems where mapping is slow or not allowed).

    Construction checks magic, version, dtype code, the `.idx` length against its header, and
    the `.bin` length against the last pointer and length (O(1)); `verify()` checks every entry
    (data/inputs.py runs it on every --data-path pair before training).
    """

    def __init__(self, prefix: str, mmap_bin: bool = True):
        self.prefix, self.mmap_bin = prefix, mmap_bin
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: missing (expected the pair {prefix}.bin/.idx)")
        idx_bytes = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(f"{ipath}: truncated header ({idx_bytes} bytes, need {HEADER_BYTES})")
        if header[:9] != MAGIC:
            packed = header.startswith((b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zXZ"))
            why = "it is compressed: decompress it (pairs are memory-mapped)" if packed else "not a Megatron mmap index"
            raise IndexedDatasetError(f"{ipath}: bad magic {header[:9]!r}, expected {MAGIC!r} ({why})")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{ipath}: unsupported version {version}, expected {VERSION}")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{ipath}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n, d = struct.unpack("<QQ", header[18:34])
        want = HEADER_BYTES + 4 * n + 8 * n + 8 * d
        if idx_bytes != want:
            raise IndexedDatasetError(
                f"{ipath}: {idx_bytes} bytes but header says {n} sequences and {d} document boundaries "
                f"({want} bytes); the file is truncated or corrupt"
            )
        if d < 1:
            raise IndexedDatasetError(f"{ipath}: document count is 0 (must hold at least the leading 0)")
        self._idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n, HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(self._idx, np.int64, d, HEADER_BYTES + 12 * n)
        bin_bytes = os.path.getsize(bpath)
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if end != bin_bytes:
            raise IndexedDatasetError(
                f"{bpath}: {bin_bytes} bytes but {ipath} says the tokens end at byte {end} "
                f"({self.dtype.name}); the .bin and .idx do not belong together or one is truncated"
            )
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexedDatasetError(
                f"{ipath}: document indices must run from 0 to {n}, "
                f"got {self.document_indices[0]}..{self.document_indices[-1]}"
            )
        # np.memmap refuses empty files; an empty corpus is still a valid pair.
        mapped = mmap_bin and bin_bytes
        self._bin = np.memmap(bpath, mode="r", dtype=np.uint8) if mapped else np.zeros(0, np.uint8)

    def verify(self) -> None:
        """Full O(N) check, VERIFY_BLOCK entries at a time (bounded memory whatever N): lengths are
        non-negative, each pointer is the sum of the lengths before it, boundaries never decrease."""
        size, pointer, n = self.dtype.itemsize, 0, len(self)
        for s in range(0, n, VERIFY_BLOCK):
            lengths = self.sequence_lengths[s : s + VERIFY_BLOCK].astype(np.int64)
            if (lengths < 0).any():
                i = s + int(np.argmax(lengths < 0))
                raise IndexedDatasetError(f"{idx_path(self.prefix)}: sequence {i} has a negative length")
            ends = pointer + np.cumsum(lengths) * size
            expect = ends - lengths * size
            bad = np.flatnonzero(self.sequence_pointers[s : s + VERIFY_BLOCK] != expect)
            if bad.size:
                i = s + int(bad[0])
                raise IndexedDatasetError(
                    f"{idx_path(self.prefix)}: pointer of sequence {i} is {self.sequence_pointers[i]}, "
                    f"expected {expect[bad[0]]} from the lengths before it"
                )
            pointer = int(ends[-1])
        docs = self.document_indices
        for s in range(0, len(docs) - 1, VERIFY_BLOCK):
            if (np.diff(docs[s : s + VERIFY_BLOCK + 1]) < 0).any():
                raise IndexedDatasetError(f"{idx_path(self.prefix)}: document indices decrease")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset+length)` of sequence i, as a read-only view of the `.bin`."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {i} has {size} tokens; asked for [{offset}, {offset + length})")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        if self.mmap_bin:
            return np.frombuffer(self._bin, self.dtype, length, start)
        return self._read(start, length)

    def _read(self, start: int, length: int) -> np.ndarray:
        """`length` tokens from byte `start` of the `.bin`, read from the file (no memory map)."""
        out = np.empty(length, self.dtype)
        if length == 0:
            out.flags.writeable = False
            return out
        with open(bin_path(self.prefix), "rb", buffering=0) as f:
            f.seek(start)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise IndexedDatasetError(f"{bin_path(self.prefix)}: short read at byte {start} (truncated since opened?)")
        out.flags.writeable = False  # as the mapped view
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))


def _write(f, path: str, array: np.ndarray) -> None:
    """f.write(array's bytes); an OSError (a full disk) names `path`, which a file object's write does not."""
    try:
        f.write(array.tobytes())
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None


class IndexedDatasetWriter:
    """Streams sequences to `bin_file`; lengths spill to a side file so memory stays flat
    however large the corpus. `finalize(idx_file)` writes the index in one streaming pass.

    Every document is one sequence, the way preprocess_data writes without sentence splitting.
    """

    BLOCK = 1 << 16  # entries per streamed block of the index: bounds the memory of finalize()

    def __init__(self, bin_file: str, dtype, lengths_file: str | None = None):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        self.bin_file = bin_file
        self.lengths_file = lengths_file or bin_file + ".lengths"
        self._bin = open(bin_file, "wb")
        self._lengths = open(self.lengths_file, "wb")
        self.num_sequences = 0
        self.num_tokens = 0

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self.add_batch(arr, np.array([arr.size], np.int32))

    def add_batch(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: `tokens` concatenated, `lengths` one entry per document."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        assert int(lengths.sum(dtype=np.int64)) == tokens.size, "lengths must add up to the tokens"
        _write(self._bin, self.bin_file, tokens)
        _write(self._lengths, self.lengths_file, lengths)
        self.num_sequences += lengths.size
        self.num_tokens += tokens.size

    def add_index(self, prefix: str) -> None:
        """Append another pair (its documents keep their boundaries), as Megatron's merge does."""
        other = IndexedDataset(prefix)
        other.verify()  # its lengths become the merged index's: a damaged entry must not carry over
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{idx_path(prefix)}: dtype {other.dtype} differs from {self.dtype}")
        if not np.array_equal(other.document_indices, np.arange(len(other) + 1)):
            raise IndexedDatasetError(f"{idx_path(prefix)}: multi-sequence documents are not supported by this merge")
        with open(bin_path(prefix), "rb") as f:
            while chunk := f.read(64 << 20):
                self._bin.write(chunk)
        for s in range(0, len(other), self.BLOCK):
            self._lengths.write(np.ascontiguousarray(other.sequence_lengths[s : s + self.BLOCK]).tobytes())
        self.num_sequences += len(other)
        self.num_tokens += other.num_tokens

    def finalize(self, idx_file: str) -> None:
        """Write the index; an OSError (a full disk) names the file it was writing (`filename`)."""
        for f, path in ((self._bin, self.bin_file), (self._lengths, self.lengths_file)):
            try:
                f.close()  # flushes the last buffered bytes: where a full disk shows
            except OSError as e:
                raise OSError(e.errno, e.strerror, path) from None
        try:
            self._write_index(idx_file)
        except OSError as e:
            raise OSError(e.errno, e.strerror, e.filename or idx_file) from None
        os.remove(self.lengths_file)

    def _write_index(self, idx_file: str) -> None:
        n = self.num_sequences
        with open(idx_file, "wb") as out, open(self.lengths_file, "rb") as lengths:
            out.write(encode_header(self.dtype, n, n + 1))
            # Plain block reads, not a memmap: mapped pages would count in RSS and grow with N.
            while block := lengths.read(4 * self.BLOCK):
                out.write(block)
            lengths.seek(0)
            pointer = 0  # byte offsets are a running sum carried across blocks
            while (block := np.fromfile(lengths, np.int32, self.BLOCK)).size:
                nbytes = block.astype(np.int64) * self.dtype.itemsize
                ends = np.cumsum(nbytes) + pointer
                out.write((ends - nbytes).tobytes())
                pointer = int(ends[-1])
            for s in range(0, n + 1, self.BLOCK):
                out.write(np.arange(s, min(s + self.BLOCK, n + 1), dtype=np.int64).tobytes())

    def abort(self) -> None:
        """Close and delete everything written so far (used when a run fails, a full disk included)."""
        for f in (self._bin, self._lengths):
            try:
                f.close()
            except OSError:  # the buffered bytes that a full disk would not take: the file goes anyway
                pass
        for p in (self.bin_file, self.lengths_file):
            if os.path.exists(p):
                os.remove(p)
