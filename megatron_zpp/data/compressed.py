"""Input corpora read the same whether plain or compressed: gzip, bz2 and xz (standard library),
zstd (the `zstandard` package, in the `data` extra). The format is told by the file's first
bytes, not its name, so `corpus.jsonl.gz` and a gzip file named `corpus.jsonl` both work;
a zstd file without `zstandard` installed is refused with one line saying what to install.

Both data tools (tools/train_tokenizer.py, tools/preprocess_data.py) tell JSON lines from plain
text by one rule (is_json_lines) and read plain text through one reader (text_lines).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib

MAGIC = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bz2",
    b"\xfd7zXZ\x00": "xz",
}
SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz")
JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")


class CompressedInputError(OSError):
    """A compressed input this machine cannot read; the message says what to install."""


def compression_of(path: str) -> str | None:
    """'gzip', 'zstd', 'bz2', 'xz' or None (plain), from the first bytes of `path`."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((kind for magic, kind in MAGIC.items() if head.startswith(magic)), None)


def strip_compression_suffix(path: str) -> str:
    """'corpus.jsonl.gz' -> 'corpus.jsonl' (what the file holds once decompressed)."""
    for s in SUFFIXES:
        if path.endswith(s):
            return path[: -len(s)]
    return path


class InputFile:
    """A binary, line-iterable view of a plain or compressed file. `position` is how far into
    the file on disk reading has got (compressed bytes), for a progress bar over file sizes."""

    def __init__(self, path: str):
        self.path = path
        self.kind = compression_of(path)
        self._raw = open(path, "rb")
        try:
            self.stream = self._decompressor()
        except BaseException:
            self._raw.close()
            raise

    def _decompressor(self):
        if self.kind is None:
            return self._raw
        if self.kind == "gzip":
            return gzip.GzipFile(fileobj=self._raw, mode="rb")
        if self.kind == "bz2":
            return bz2.BZ2File(self._raw, mode="rb")
        if self.kind == "xz":
            return lzma.LZMAFile(self._raw, mode="rb")
        try:
            import zstandard
        except ImportError:
            raise CompressedInputError(
                f"{self.path}: zstd-compressed; reading it needs the zstandard package "
                "(pip install zstandard, or the project's `data` extra), or decompress it first (zstd -d)"
            ) from None
        return io.BufferedReader(_ZstdFrames(self._raw, zstandard.ZstdDecompressor()))

    @property
    def position(self) -> int:
        return self._raw.tell()

    def __iter__(self):
        """The file's lines; a corrupt or truncated compressed file is one CompressedInputError."""
        try:
            yield from self.stream
        except _read_errors() as e:
            raise CompressedInputError(self._cannot(e)) from None

    def read(self, n: int = -1) -> bytes:
        try:
            return self.stream.read(n)
        except _read_errors() as e:
            raise CompressedInputError(self._cannot(e)) from None

    def _cannot(self, e: BaseException) -> str:
        what = f"cannot decompress ({self.kind})" if self.kind else "cannot read"
        return f"{self.path}: {what}: {' '.join(str(e).split()) or type(e).__name__}"

    def close(self) -> None:
        if self.stream is not self._raw:
            self.stream.close()
        self._raw.close()

    def __enter__(self) -> InputFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ZstdFrames(io.RawIOBase):
    """zstd frames one after another, decompressed; unlike zstandard's stream_reader, a file that
    ends inside a frame (truncated) raises EOFError instead of ending quietly."""

    CHUNK = 1 << 20

    def __init__(self, raw, decompressor):
        self.raw, self.dctx = raw, decompressor
        self.obj, self.pending = decompressor.decompressobj(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data = self.raw.read(self.CHUNK)
            if not data:
                if self.obj is not None and not self.obj.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            while data:
                if self.obj is None or self.obj.eof:
                    self.obj = self.dctx.decompressobj()
                self.pending += self.obj.decompress(data)
                data = self.obj.unused_data if self.obj.eof else b""
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def open_input(path: str) -> InputFile:
    return InputFile(path)


def is_json_lines(path: str) -> bool:
    """Whether `path` holds one JSON document per line: named .jsonl/.json/.ndjson (before any
    compression suffix), or, named otherwise, its first non-blank line is a JSON object. Any other
    file is plain text."""
    if strip_compression_suffix(path).endswith(JSON_LINES_SUFFIXES):
        return True
    with open_input(path) as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:  # not JSON, or not UTF-8
                    return False
    return False


def text_lines(path: str):
    """The lines of a plain-text input (plain or compressed), newlines kept, decoded as UTF-8 with
    undecodable bytes replaced by U+FFFD (a newline byte never falls inside a UTF-8 sequence, so
    this equals decoding the whole file)."""
    with open_input(path) as f:
        for line in f:
            yield line.decode("utf-8", errors="replace")


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a corrupt or truncated compressed stream raises (gzip's BadGzipFile is an OSError)."""
    errors = (EOFError, OSError, zlib.error, lzma.LZMAError)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)
