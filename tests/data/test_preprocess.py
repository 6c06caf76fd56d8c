"""tools/preprocess_data.py end to end: exact bytes, bad input, interruption, HF sources, the demo corpus."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import sentencepiece as spm

from megatron_zpp.data import preprocess as preprocess_data
from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.indexed_dataset import IndexedDataset
from tools import make_demo_corpus

from .test_indexed_dataset import ref_write

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
THIS_CHECKOUT = {**os.environ, "PYTHONPATH": ROOT}  # the tools' subprocesses import this checkout's package

DOCS = [
    {"text": f"Document {i}: " + "words and more words, " * (i % 7) + "end.\n", "title": f"T{i}"} for i in range(300)
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer.train((d["text"] for d in DOCS), str(d / "tok"), 400, "bpe")
    return str(d / "tok.model")


def write_jsonl(path, docs, raw_lines=()):
    with open(path, "wb") as f:
        for d in docs:
            f.write(json.dumps(d).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


def run_pre(inp, prefix, model, *extra):
    return preprocess_data.main(
        [
            "--input",
            inp,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--quiet",
            *extra,
        ]
    )


def outputs(d):
    return sorted(p.name for p in d.iterdir() if ".bin" in p.name or ".idx" in p.name or ".lengths" in p.name)


@pytest.mark.parametrize("workers", [1, 2])
def test_output_is_byte_identical_to_reference(tmp_path, sp_model, workers, capsys):
    docs = DOCS + [{"text": "", "title": "empty text"}]
    inp = write_jsonl(tmp_path / "c.jsonl", docs, raw_lines=[b"", b"   "])
    assert run_pre(inp, str(tmp_path / "out"), sp_model, "--json-keys", "text", "title", "--workers", str(workers)) == 0
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    for key in ("text", "title"):
        want = [sp.encode(d[key]) + [sp.eos_id()] for d in docs if d[key]]
        ref_write(str(tmp_path / f"ref_{key}"), want, np.uint16)
        for ext in (".bin", ".idx"):
            got = open(tmp_path / f"out_{key}_document{ext}", "rb").read()
            assert got == open(tmp_path / f"ref_{key}{ext}", "rb").read(), (key, ext)
    err = capsys.readouterr().err
    assert "1 empty 'text' documents" in err and "2 blank lines" in err and "301 documents" in err
    assert outputs(tmp_path) == sorted(
        f"{a}_{k}{e}"
        for a, k in (("out", "text_document"), ("out", "title_document"), ("ref", "text"), ("ref", "title"))
        for e in (".bin", ".idx")
    )


def test_plain_text_files_are_one_document_each(tmp_path, sp_model, capsys):
    """Plain text, read as tools/train_tokenizer.py reads it: each file (here one gzip-compressed, one
    with a byte that is not UTF-8) is one document, its whole text; a JSON-lines file not named
    .jsonl is still read as JSON lines (its first line is an object)."""
    import gzip

    texts = ["First file.\n\nA second paragraph.\n", "def f(x):\n    return x\n", "caf\ufffd ok\n"]
    (tmp_path / "a.txt").write_text(texts[0])
    with gzip.open(tmp_path / "b.py.gz", "wt") as f:
        f.write(texts[1])
    (tmp_path / "c.md").write_bytes(b"caf\xe9 ok\n")
    json_lines = write_jsonl(tmp_path / "d.data", DOCS[:2])
    inputs = [str(tmp_path / n) for n in ("a.txt", "b.py.gz", "c.md")] + [json_lines]
    argv = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-model", sp_model, "--append-eod", "--quiet"]
    assert preprocess_data.main(["--input", *inputs, *argv]) == 0  # --tokenizer-type inferred from the .model
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    want = [sp.encode(t) + [sp.eos_id()] for t in texts + [d["text"] for d in DOCS[:2]]]
    data = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [data[i].tolist() for i in range(len(data))] == want
    assert "5 documents" in capsys.readouterr().err
    two_keys = run_pre(inputs[0], str(tmp_path / "two"), sp_model, "--json-keys", "text", "title")
    assert two_keys == 1 and "a.txt is plain text, which has one field: give one key" in capsys.readouterr().err


BAD = [
    (b'{"text": "ok", ', "invalid JSON: Expecting property name enclosed in double quotes (column 16)"),
    (b'{"body": "x", "id": 1}', "missing key 'text' (has 'body', 'id')"),
    (b'{"text": 42}', "key 'text' is int, not a string"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13 of the line"),
    (b'{"text": "a\\ud800b"}', "key 'text' holds a lone surrogate '\\ud800' at character 1"),
    (b'["text"]', "not a JSON object (got list)"),
]


@pytest.mark.parametrize("line, reason", BAD, ids=["json", "missing_key", "not_string", "utf8", "surrogate", "array"])
def test_bad_input_stops_with_file_line_and_reason(tmp_path, sp_model, line, reason):
    inp = write_jsonl(tmp_path / "c.jsonl", DOCS[:3], raw_lines=[line] + [json.dumps(DOCS[0]).encode()])
    with pytest.raises(SystemExit) as e:
        run_pre(inp, str(tmp_path / "out"), sp_model)
    first = str(e.value.code).splitlines()[0]
    assert first.startswith(f"error: {inp}:4: {reason}")
    assert outputs(tmp_path) == []  # no pair, no temporaries


def test_bad_input_with_workers_and_cli_exit_code(tmp_path, sp_model):
    inp = write_jsonl(tmp_path / "c.jsonl", DOCS * 10, raw_lines=[b"{oops"])
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "preprocess_data.py"),
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-model",
            sp_model,
            "--workers",
            "2",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=THIS_CHECKOUT,
    )
    assert r.returncode != 0
    assert f"error: {inp}:3001: invalid JSON" in r.stderr
    assert outputs(tmp_path) == []


def test_skip_bad_lines_counts_and_reports(tmp_path, sp_model, capsys):
    inp = write_jsonl(
        tmp_path / "c.jsonl", DOCS[:5], raw_lines=[line for line, _ in BAD] + [json.dumps(DOCS[5]).encode()]
    )
    assert run_pre(inp, str(tmp_path / "out"), sp_model, "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    assert f"{len(BAD)} bad lines skipped" in err and f"{inp}:6: invalid JSON" in err
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 6


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_run_leaves_no_valid_pair(tmp_path, sig):
    inp = tmp_path / "big.jsonl"
    line = json.dumps({"text": " ".join(str(i % 1000) for i in range(200))}).encode() + b"\n"
    with open(inp, "wb") as f:
        f.write(line * 60000)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "preprocess_data.py"),
        "--input",
        str(inp),
        "--output-prefix",
        str(out),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
        "--workers",
        "2",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=THIS_CHECKOUT)
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until tokens are being written
        tmp = [p for p in tmp_path.iterdir() if ".bin.tmp" in p.name]
        if tmp and tmp[0].stat().st_size > 0:
            break
        time.sleep(0.02)
    else:
        pytest.fail("preprocessing never started writing")
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert not (tmp_path / "out_text_document.idx").exists()
    if sig != signal.SIGKILL:  # handled signals also remove the temporaries
        assert outputs(tmp_path) == []


def test_hf_dataset_sources_match_jsonl(tmp_path, sp_model):
    import datasets

    inp = write_jsonl(tmp_path / "c.jsonl", DOCS)
    assert run_pre(inp, str(tmp_path / "a"), sp_model) == 0
    datasets.Dataset.from_list(DOCS).save_to_disk(str(tmp_path / "saved"))
    assert run_pre(str(tmp_path / "saved"), str(tmp_path / "b"), sp_model, "--hf-dataset", "--workers", "2") == 0
    assert run_pre(inp, str(tmp_path / "c"), sp_model, "--hf-dataset") == 0  # local data files
    for p in ("b", "c"):
        for ext in (".bin", ".idx"):
            assert (
                open(tmp_path / f"a_text_document{ext}", "rb").read()
                == open(tmp_path / f"{p}_text_document{ext}", "rb").read()
            )


def test_demo_corpus_builds_and_is_idempotent(tmp_path, capsys):
    args = ["--output", str(tmp_path / "demo"), "--build", "--max-mb", "0.3", "--vocab-size", "800", "--workers", "1"]
    assert make_demo_corpus.main(args) == 0
    first = capsys.readouterr().out
    assert "wrote" in first and "exists" not in first
    ds = IndexedDataset(str(tmp_path / "demo" / "corpus_text_document"))
    lines = open(tmp_path / "demo" / "corpus.jsonl").read().splitlines()
    assert len(ds) == len(lines) and ds.num_tokens > 10000
    assert json.loads(lines[0])["kind"] == "docstrings"
    assert make_demo_corpus.main(args) == 0
    assert capsys.readouterr().out.count("exists") == 3


PEAK_RSS = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
"""


def peak_rss_kb(args):
    """High-water RSS of this run only (VmHWM of the process after exec, not its parent's at fork)."""
    r = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True, timeout=120, env=THIS_CHECKOUT
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_memory_does_not_grow_with_corpus_size(tmp_path):
    """8x more documents (the per-document index grows 8x) and the peak RSS stays put."""
    peaks = []
    for n in (100_000, 800_000):
        inp = tmp_path / f"c{n}.jsonl"
        with open(inp, "wb") as f:
            for _ in range(n // 1000):
                f.write(b'{"text": "1 2 3 4 5 6 7 8"}\n' * 1000)
        cmd = [
            os.path.join(ROOT, "tools", "preprocess_data.py"),
            "--input",
            str(inp),
            "--output-prefix",
            str(tmp_path / f"o{n}"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            "--quiet",
        ]
        peaks.append(peak_rss_kb(cmd))
        assert len(IndexedDataset(str(tmp_path / f"o{n}_text_document"))) == n
    assert peaks[1] - peaks[0] < 4 * 1024, peaks  # Megatron-style lists of sizes+pointers would add ~15 MB
