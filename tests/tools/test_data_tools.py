"""The data tools under conditions a small corpus does not show: a tokenizer corpus with
some malformed lines (one warning line: the count and the first), a document far longer than a
read batch (tokenized in pieces, the same tokens as whole), and a disk that fills during
preprocessing (one line naming the file and the errno text, no partial pair left, the previous
pair at the prefix untouched)."""

import contextlib
import errno
import io
import json
import os

import pytest

from megatron_zpp.data import preprocess as preprocess_data
from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = 'alpha beta  gamma delta\nwords. more\n\nx 12345 \t é has "q"'.split(" ")
TEXTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(30)]


def call(main, argv):
    """(exit code, stderr) of main(argv) in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code, text = (1, e.code) if isinstance(e.code, str) else (e.code, "")
            print(text, file=err)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return train_tokenizer.train(iter(TEXTS), str(tmp_path_factory.mktemp("tok") / "tok"), 300, "bpe")


def jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def pre(inp, prefix, sp, *extra):
    return ["--input", inp, "--output-prefix", prefix, "--quiet", "--tokenizer-model", sp, *extra]


def test_some_malformed_lines_are_one_warning(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:8]) + '{"text": oops\n\n{"body": "x"}\n')
    code, err = call(train_tokenizer.main, ["--input", str(path), "--model-prefix", str(tmp_path / "t")])
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1, err
    assert "2 of 10 JSON lines are malformed" in warnings[0] and f"the first at {path}:9: skipped" in warnings[0]
    assert os.path.exists(tmp_path / "t.model")


def test_a_long_document_is_tokenized_in_pieces_with_the_tokens_of_the_whole(tmp_path, sp, monkeypatch):
    from megatron_zpp.data.tokenizer import build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", sp, None, 1, 1)
    assert preprocess_data.piece_rule(tok) is True  # sentencepiece: its dummy prefix stands for the cut space
    long_doc = "  ".join(TEXTS) + " end"
    docs = [TEXTS[0], long_doc, "", TEXTS[1]]
    monkeypatch.setattr(preprocess_data, "PIECE_CHARS", 50)  # the long document: ~60 pieces
    prefix = str(tmp_path / "p")
    code, err = call(preprocess_data.main, pre(jsonl(tmp_path / "c.jsonl", docs), prefix, sp, "--append-eod"))
    assert code == 0, err
    ds = IndexedDataset(prefix + "_text_document")
    want = [tok.tokenize(d) + [tok.eod] for d in docs if d]  # an independent reference: each document whole
    assert [ds[i].tolist() for i in range(len(ds))] == want


class FullDisk:
    """A file whose writes fail with ENOSPC after `left` of them, as a full disk's do (no filename)."""

    def __init__(self, f, left):
        self.f, self.left = f, left

    def write(self, data):
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= 1
        return self.f.write(data)

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.mark.parametrize("where", ["bin", "idx"])
def test_a_full_disk_is_one_line_and_leaves_the_previous_pair(tmp_path, sp, monkeypatch, where):
    out = tmp_path / "out"
    prefix = str(out / "p")
    inp = jsonl(tmp_path / "c.jsonl", TEXTS * 4)
    assert call(preprocess_data.main, pre(jsonl(tmp_path / "old.jsonl", TEXTS[:3]), prefix, sp))[0] == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    monkeypatch.setattr(preprocess_data, "BATCH_LINES", 16)  # several batches: the disk fills mid-run
    init = IndexedDatasetWriter.__init__

    def full_disk_writer(self, *a, **kw):
        init(self, *a, **kw)
        self._bin = FullDisk(self._bin, 2)

    if where == "bin":
        monkeypatch.setattr(IndexedDatasetWriter, "__init__", full_disk_writer)
    else:
        real_open = open

        def index_open(path, mode="r", *a, **kw):  # the .idx fills the disk
            f = real_open(path, mode, *a, **kw)
            return FullDisk(f, 1) if ".idx" in str(path) and "w" in mode else f

        monkeypatch.setattr("builtins.open", index_open)
    code, err = call(preprocess_data.main, pre(inp, prefix, sp))
    monkeypatch.undo()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 1 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith(f"error: cannot write {prefix}_text_document.{where}: No space left on device;"), err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before  # nothing half-written, nothing lost
