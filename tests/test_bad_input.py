"""Bad input never gives a traceback: malformed command lines and corpora fed to the data tools,
tools/convert_checkpoint.py and pretrain_gpt.py each end with a one-line error naming the cause
and a non-zero exit, before any model is built. Most cases call the tools' main(argv) in this
process (a Python start with torch costs seconds); a few run as real subprocesses."""

import contextlib
import gzip
import hashlib
import io
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import zstandard

import pretrain_gpt
from megatron_zpp.data import preprocess as preprocess_data
from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter
from tools import convert_checkpoint, merge_datasets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 2".split()
HEAD = 1 << 20  # tokens
TEXTS = [f"document {i}: some words, more words and an end." for i in range(60)]


def write_pair(prefix, docs, dtype=np.uint16):
    w = IndexedDatasetWriter(prefix + ".bin", dtype)
    for d in docs:
        w.add_document(d)
    w.finalize(prefix + ".idx")
    return prefix


def patched(src, dst, edit):
    """Copy the pair `src` to `dst` and let edit(idx bytes, bin bytes) return the broken ones."""
    idx, bin_ = (open(src + ext, "rb").read() for ext in (".idx", ".bin"))
    idx, bin_ = edit(bytearray(idx), bytearray(bin_))
    for ext, data in ((".idx", idx), (".bin", bin_)):
        with open(dst + ext, "wb") as f:
            f.write(bytes(data))
    return dst


def write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    f = {"dir": str(d)}
    f["good"] = write_pair(str(d / "good_text_document"), [list(range(1, 40))] * 10)
    f["big_ids"] = write_pair(str(d / "big_ids"), [[5, 900, 7]] * 10)  # ids past NullTokenizer --vocab-size 512
    late = np.arange(HEAD + 8) % 500
    late[-3] = 700  # past the first 1M tokens, which was all the old check read
    f["late_oov"] = write_pair(str(d / "late_oov"), [late])
    f["padding_ids"] = write_pair(str(d / "padding_ids"), [[5, 505, 7]] * 10)  # vocab 500, padded to 512
    f["empty_docs"] = write_pair(str(d / "empty_docs"), [[]] * 5)
    f["float"] = write_pair(str(d / "float"), [[1.0, 2.0]] * 3, np.float32)
    f["int32"] = write_pair(str(d / "int32"), [[1, 2, 3]] * 3, np.int32)
    g = f["good"]
    f["trunc_idx"] = patched(g, str(d / "trunc_idx"), lambda i, b: (i[:-5], b))
    f["short_bin"] = patched(g, str(d / "short_bin"), lambda i, b: (i, b[:-6]))
    f["dtype99"] = patched(g, str(d / "dtype99"), lambda i, b: (i[:17] + bytes([99]) + i[18:], b))
    f["dtype_int32"] = patched(g, str(d / "dtype_int32"), lambda i, b: (i[:17] + bytes([4]) + i[18:], b))
    f["magic"] = patched(g, str(d / "magic"), lambda i, b: (b"NOTMAGIC!" + i[9:], b))
    f["version"] = patched(g, str(d / "version"), lambda i, b: (i[:9] + struct.pack("<Q", 7) + i[17:], b))
    f["header"] = patched(g, str(d / "header"), lambda i, b: (i[:20], b))
    f["gz_idx"] = patched(g, str(d / "gz_idx"), lambda i, b: (gzip.compress(bytes(i)), b))
    n = 10
    ptr = 34 + 4 * n  # the first sequence pointer: pointing past its place fails verify()
    f["pointer"] = patched(g, str(d / "pointer"), lambda i, b: (i[:ptr] + struct.pack("<q", 2) + i[ptr + 8 :], b))
    f["no_bin"] = patched(g, str(d / "no_bin"), lambda i, b: (i, b))
    os.remove(f["no_bin"] + ".bin")
    f["no_idx"] = patched(g, str(d / "no_idx"), lambda i, b: (i, b))
    os.remove(f["no_idx"] + ".idx")
    f["bin_dir"] = patched(g, str(d / "bin_dir"), lambda i, b: (i, b))
    os.remove(f["bin_dir"] + ".bin")
    os.mkdir(f["bin_dir"] + ".bin")
    f["sp"] = train_tokenizer.train(iter(TEXTS), str(d / "tok"), 300, "bpe")
    f["garbage"] = write(d / "garbage.model", b"not a sentencepiece model\n")
    good = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[:5])
    f["jsonl"] = write(d / "good.jsonl", good)
    corpora = {
        "utf8": b'{"text": "caf\xe9"}\n',
        "array": b'["text", "a list"]\n',
        "number": b"42\n",
        "string": b'"just a string"\n',
        "null": b"null\n",
        "json": b'{"text": "unterminated\n',
        "key": b'{"body": "no text key"}\n',
        "nonstr": b'{"text": 7}\n',
        "surrogate": b'{"text": "\\ud800 lone"}\n',
    }
    for name, body in corpora.items():
        f[name] = write(d / f"{name}.jsonl", good + body)
    f["trunc_gz"] = write(d / "trunc.jsonl.gz", gzip.compress(good * 50)[:-30])
    f["gz_utf8"] = write(d / "bad.jsonl.gz", gzip.compress(good + corpora["utf8"]))
    zst = zstandard.ZstdCompressor().compress(good * 50)
    f["zst_trunc"] = write(d / "trunc.jsonl.zst", zst[:-10])
    f["zst_bad"] = write(d / "bad.jsonl.zst", zst[:8] + b"\x13" * 40)
    f["no_text"] = write(d / "no_text.jsonl", b"[1]\n[2]\n")
    f["blank_only"] = write(d / "blank_only.jsonl", b"\n\n")
    f["empty_jsonl"] = write(d / "empty.jsonl", b"")
    f["mostly_bad"] = write(d / "mostly_bad.jsonl", good[: good.index(b"\n") + 1] + b'{"text": oops\n' * 9)
    f["yaml_key"] = write(d / "key.yaml", b"hiden-size: 64\n")
    f["yaml_bad"] = write(d / "bad.yaml", b"hidden-size: [1, 2\n")
    f["yaml_list"] = write(d / "list.yaml", b"- 1\n- 2\n")
    f["yaml_value"] = write(d / "value.yaml", b"hidden-size: wide\n")
    f["yaml_fraction"] = write(d / "fraction.yaml", b"hidden-size: 32.9\n")
    f["yaml_bool"] = write(d / "bool.yaml", b"num-layers: true\n")
    f["yaml_int_key"] = write(d / "int_key.yaml", b"1: 5\n")
    f["yaml_latin1"] = write(d / "latin1.yaml", b"hidden-size: 32\ntokenizer-model: caf\xe9\n")
    f["yaml_null"] = write(d / "null.yaml", b"num-layers:\n")
    f["yaml_scalar"] = write(d / "scalar.yaml", b"0\n")
    f["yaml_twice"] = write(d / "twice.yaml", b"num-layers: 2\nnum-layers: 4\n")
    for name, text in (("latest_up", b"../x\n"), ("latest_abs", b"/etc\n"), ("latest_empty", b"")):
        f[name] = str(d / name)
        os.makedirs(d / name / "iter_0000001")
        write(d / name / "latest", text)
    os.mkdir(d / "empty_dir")
    os.mkdir(d / "hf_empty")
    os.mkdir(d / "hf_bogus")
    write(d / "hf_bogus" / "config.json", b'{"model_type": "bogus", "num_attention_heads": 4, "hidden_size": 32}')
    f["ckpt_meta"] = str(d / "ckpt")
    os.makedirs(d / "ckpt" / "iter_0000001")
    write(d / "ckpt" / "latest", b"iter_0000001")
    write(d / "ckpt" / "iter_0000001" / "meta.json", b'{"format": ')
    write(d / "ckpt" / "iter_0000001" / "meta.json.sha256", hashlib.sha256(b'{"format": ').hexdigest().encode())
    f["ckpt_unhashed"] = str(d / "unhashed")  # meta.json without its sha256 beside it
    os.makedirs(d / "unhashed" / "iter_0000001")
    write(d / "unhashed" / "latest", b"iter_0000001")
    write(d / "unhashed" / "iter_0000001" / "meta.json", b"{}")
    return f


def call(main, argv):
    """(exit code, stderr) of main(argv) in this process, as the shell would see them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
            if isinstance(code, str):  # sys.exit("message"): printed, exit status 1
                print(code, file=err)
                code = 1
    return code, err.getvalue()


def pre(f, inp, *extra, tok=("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{sp}")):
    out = os.path.join(f["dir"], "out", "p")
    return ["--input", inp, "--output-prefix", out, "--quiet", *[t.format(**f) for t in tok], *extra]


def pretrain(*args):
    return TINY + list(args)


# (tool, argv from the fixture's files, what the error line must say)
CASES = [
    # pretrain_gpt.py: the data path and its blend
    ("pretrain", lambda f: pretrain("--data-path", f["dir"] + "/nope"), "nope.idx is missing (did you mean"),
    ("pretrain", lambda f: pretrain("--data-path", f["good"] + ".bin"), "without .bin/.idx"),
    ("pretrain", lambda f: pretrain("--data-path", f["dir"]), "is a directory; give the prefix"),
    ("pretrain", lambda f: pretrain("--data-path", f["no_bin"]), "no_bin.bin is missing"),
    ("pretrain", lambda f: pretrain("--data-path", f["no_idx"]), "no_idx.idx is missing"),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--attention-type", "gdn", "--attention-output-gate"),
        "--attention-output-gate gates softmax attention's output, and this model has none",
    ),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--qk-layernorm-full-width", "--normalization", "RMSNorm"),
        "--qk-layernorm-full-width normalizes q and k over all their heads with RMSNorm: it needs --qk-layernorm",
    ),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--attention-type", "gdn", "--reordered-norms", "softmax"),
        "--reordered-norms softmax: this model has no softmax attention layer",
    ),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--linear-allow-neg-eigval"),
        "--linear-allow-neg-eigval and --linear-norm-epsilon change Gated DeltaNet layers, and this model has none",
    ),
    ("pretrain", lambda f: pretrain("--data-path", f["bin_dir"]), "is a directory, not a file"),
    ("pretrain", lambda f: pretrain("--data-path", "0.3", f["good"], "0.7x", f["good"]), "weight '0.7x'"),
    ("pretrain", lambda f: pretrain("--data-path", "nan", f["good"]), "weight 'nan'"),
    ("pretrain", lambda f: pretrain("--data-path", "0.3", f["good"], "0.7"), "has no prefix after it"),
    ("pretrain", lambda f: pretrain("--data-path", "-1", f["good"], "1", f["good"]), "non-negative"),
    ("pretrain", lambda f: pretrain("--data-path", f["good"], "0.5", f["good"]), "alternate"),
    # pretrain_gpt.py: malformed pairs
    ("pretrain", lambda f: pretrain("--data-path", f["trunc_idx"]), "truncated or corrupt"),
    ("pretrain", lambda f: pretrain("--data-path", f["short_bin"]), "do not belong together or one is truncated"),
    ("pretrain", lambda f: pretrain("--data-path", f["dtype99"]), "unknown dtype code 99"),
    ("pretrain", lambda f: pretrain("--data-path", f["dtype_int32"]), "do not belong together"),
    ("pretrain", lambda f: pretrain("--data-path", f["magic"]), "bad magic"),
    ("pretrain", lambda f: pretrain("--data-path", f["version"]), "unsupported version 7"),
    ("pretrain", lambda f: pretrain("--data-path", f["header"]), "truncated header"),
    ("pretrain", lambda f: pretrain("--data-path", f["gz_idx"]), "it is compressed"),
    ("pretrain", lambda f: pretrain("--data-path", f["pointer"]), "pointer of sequence 0"),
    ("pretrain", lambda f: pretrain("--data-path", f["empty_docs"]), "holds no tokens"),
    ("pretrain", lambda f: pretrain("--data-path", f["float"]), "not integer token ids"),
    ("pretrain", lambda f: pretrain("--data-path", f["big_ids"]), "token id 900"),
    ("pretrain", lambda f: pretrain("--data-path", f["late_oov"]), "token id 700"),
    (
        "pretrain",
        lambda f: pretrain("--data-path", f["padding_ids"], "--vocab-size", "500"),
        "token id 505 in",
    ),
    # pretrain_gpt.py: values that parse but cannot train
    ("pretrain", lambda f: pretrain("--data-path", f["good"], "--split", "0,0,0"), "gives the training set no"),
    ("pretrain", lambda f: pretrain("--data-path", f["good"], "--split", "0,0,1"), "its first number must be > 0"),
    ("pretrain", lambda f: pretrain("--mock-data", "--adam-beta1", "1.5"), "--adam-beta1 1.5 must be in [0, 1)"),
    ("pretrain", lambda f: pretrain("--mock-data", "--hidden-dropout", "1.5"), "--hidden-dropout 1.5 must be in"),
    ("pretrain", lambda f: pretrain("--mock-data", "--seed", "-1"), "--seed -1 must be in [0, 2^32)"),
    ("pretrain", lambda f: pretrain("--mock-data", "--lr", "nan"), "--lr nan must be a finite number"),
    ("pretrain", lambda f: pretrain("--mock-data", "--clip-grad", "-1"), "--clip-grad -1.0 must be >= 0"),
    ("pretrain", lambda f: pretrain("--mock-data", "--max-skipped-steps", "-1"), "--max-skipped-steps must be >= 0"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_fraction"]), "expected an integer, got 32.9"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_bool"]), "expected an integer, got True"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_int_key"]), "key 1 is not a setting name"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_latin1"]), "latin1.yaml:2: not UTF-8"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_null"]), "num-layers: has no value (null)"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_scalar"]), "top level (YAML read int)"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_twice"]), "key 'num-layers' given twice"),
    *[
        (
            "pretrain",
            lambda f, v=v: pretrain("--mock-data", "--distributed-timeout-minutes", v),
            "must be in (0, 10080]",
        )
        for v in ("1e15", "-1", "0")
    ],
    ("pretrain", lambda f: pretrain("--mock-data", "--distributed-timeout-minutes", "nan"), "nan must be a finite"),
    ("pretrain", lambda f: pretrain("--mock-data", "--rotary-percent", "nan"), "--rotary-percent nan must be a finite"),
    ("pretrain", lambda f: pretrain("--mock-data", "--ffn-hidden-size", "0"), "--ffn-hidden-size 0 must be >= 1"),
    ("pretrain", lambda f: pretrain("--mock-data", "--seq-length", "1" + "0" * 20), "past the 64-bit integer range"),
    ("pretrain", lambda f: pretrain("--mock-data", "--load", f["latest_up"]), "latest: holds '../x', not an iteration"),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--load", f["latest_abs"]),
        "latest: holds '/etc', not an iteration",
    ),
    ("pretrain", lambda f: pretrain("--mock-data", "--load", f["latest_empty"]), "latest: holds nothing"),
    # pretrain_gpt.py: the tokenizer and the vocabulary
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--tokenizer-type", "SentencePieceTokenizer"),
        "needs --tokenizer-model",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--data-path",
            f["good"],
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            f["dir"] + "/no.model",
        ),
        "no such file",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--data-path", f["good"], "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f["dir"]
        ),
        "is a directory; SentencePieceTokenizer",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--data-path", f["good"], "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f["garbage"]
        ),
        "cannot be loaded as a SentencePieceTokenizer",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--data-path", f["good"], "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f["sp"]
        ),
        "is a file; HuggingFaceTokenizer",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f["dir"] + "/hf_empty"
        ),
        "holds no tokenizer files",
    ),
    (
        "pretrain",
        lambda f: pretrain(
            "--data-path",
            f["good"],
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            f["sp"],
            "--vocab-size",
            "50000",
        ),
        "--vocab-size 50000 is larger than the vocabulary",
    ),
    (
        "pretrain",
        lambda f: pretrain("--data-path", f["good"], "--vocab-size", "20"),
        "token id 39",
    ),
    # pretrain_gpt.py: --config and flag values
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--config", f["yaml_key"]),
        "'hiden-size' (did you mean 'hidden-size'?)",
    ),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_bad"]), "invalid YAML"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_list"]), "expected a mapping"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["yaml_value"]), "invalid value 'wide'"),
    ("pretrain", lambda f: pretrain("--mock-data", "--config", f["dir"] + "/none.yaml"), "cannot read"),
    ("pretrain", lambda f: pretrain("--mock-data", "--hidden-size", "abc"), "invalid int value: 'abc'"),
    ("pretrain", lambda f: pretrain("--mock-data", "--no-such-flag", "1"), "unrecognized arguments"),
    ("pretrain", lambda f: pretrain("--mock-data", "--tokenizer-type", "Bogus"), "invalid choice: 'Bogus'"),
    ("pretrain", lambda f: pretrain("--mock-data", "--split", "a,b"), "--split 'a,b'"),
    ("pretrain", lambda f: pretrain("--mock-data", "--num-layers", "0"), "--num-layers must be >= 1"),
    ("pretrain", lambda f: pretrain(), "give --data-path PREFIX"),
    # tools/preprocess_data.py: malformed corpora and flags
    *[
        ("pre", lambda f, k=k: pre(f, f[k]), why)
        for k, why in [
            ("utf8", "invalid UTF-8"),
            ("array", "not a JSON object (got list)"),
            ("number", "not a JSON object (got int)"),
            ("string", "not a JSON object (got str)"),
            ("null", "not a JSON object (got NoneType)"),
            ("json", "invalid JSON"),
            ("key", "missing key 'text'"),
            ("nonstr", "is int, not a string"),
            ("surrogate", "lone surrogate"),
            ("trunc_gz", "cannot decompress (gzip)"),
            ("gz_utf8", "bad.jsonl.gz:6: invalid UTF-8"),
            ("zst_bad", "cannot decompress (zstd)"),
            ("zst_trunc", "ends inside a zstd frame"),
        ]
    ],
    ("pre", lambda f: pre(f, f["dir"] + "/none.jsonl"), "no such file"),
    ("pre", lambda f: pre(f, f["empty_jsonl"]), "empty.jsonl: holds no documents (it is empty); nothing written"),
    ("pre", lambda f: pre(f, f["blank_only"]), "blank_only.jsonl: holds no documents (2 blank line(s))"),
    ("pre", lambda f: pre(f, f["dir"] + "/*.nothing"), "no file matches"),
    ("pre", lambda f: pre(f, f["dir"]), "is a directory"),
    ("pre", lambda f: pre(f, f["jsonl"], "--workers", "0"), "--workers must be >= 1"),
    ("pre", lambda f: pre(f, f["jsonl"], tok=("--tokenizer-type", "NullTokenizer")), "needs --vocab-size"),
    (
        "pre",
        lambda f: pre(
            f, f["jsonl"], tok=("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{dir}/no.model")
        ),
        "no such file",
    ),
    (
        "pre",
        lambda f: pre(
            f, f["jsonl"], tok=("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{garbage}")
        ),
        "cannot be loaded",
    ),
    ("pre", lambda f: pre(f, f["jsonl"], tok=("--tokenizer-type", "Bogus")), "invalid choice"),
    # tools/train_tokenizer.py
    ("tok", lambda f: ["--input", f["dir"] + "/none.jsonl", "--model-prefix", f["dir"] + "/t"], "no such file"),
    (
        "tok",
        lambda f: ["--input", f["no_text"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "300"],
        "2 of 2 JSON lines are malformed",
    ),
    (
        "tok",
        lambda f: ["--input", f["blank_only"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "300"],
        "0 text(s)",
    ),
    (  # 9 of 10 lines malformed is refused (it trained on the one good line, silently)
        "tok",
        lambda f: ["--input", f["mostly_bad"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "300"],
        "9 of 10 JSON lines are malformed (invalid JSON or UTF-8, not an object, or no string under --json-keys "
        "text), the first at",
    ),
    (
        "tok",
        lambda f: ["--input", f["trunc_gz"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "300"],
        "cannot decompress",
    ),
    (
        "tok",
        lambda f: ["--input", f["jsonl"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "0"],
        "--vocab-size must be >= 1",
    ),
    (
        "tok",
        lambda f: ["--input", f["jsonl"], "--model-prefix", f["dir"] + "/t", "--vocab-size", "x"],
        "invalid int value",
    ),
    # tools/merge_datasets.py
    (
        "merge",
        lambda f: ["--input", f["good"], f["dir"] + "/nope", "--output-prefix", f["dir"] + "/m"],
        "nope.idx: missing",
    ),
    ("merge", lambda f: ["--input", f["good"], f["int32"], "--output-prefix", f["dir"] + "/m"], "differs from"),
    (
        "merge",
        lambda f: ["--input", f["good"], f["trunc_idx"], "--output-prefix", f["dir"] + "/m"],
        "truncated or corrupt",
    ),
    ("merge", lambda f: ["--input", f["gz_idx"], "--output-prefix", f["dir"] + "/m"], "it is compressed"),
    (
        "merge",
        lambda f: ["--input", f["good"], f["pointer"], "--output-prefix", f["dir"] + "/m"],
        "pointer of sequence 0",
    ),
    ("merge", lambda f: ["--input", f["dir"] + "/empty_dir", "--output-prefix", f["dir"] + "/m"], "no .idx files"),
    ("merge", lambda f: ["--output-prefix", f["dir"] + "/m"], "required: --input"),
    # tools/convert_checkpoint.py
    (
        "convert",
        lambda f: ["--load", f["dir"] + "/none", "--to", "consolidated", "--output", f["dir"] + "/c.pt"],
        "no checkpoint",
    ),
    (
        "convert",
        lambda f: ["--load", f["ckpt_meta"], "--to", "consolidated", "--output", f["dir"] + "/c.pt"],
        "not valid JSON",
    ),
    (
        "convert",
        lambda f: ["--load", f["ckpt_unhashed"], "--to", "consolidated", "--output", f["dir"] + "/c.pt"],
        "unknown format None",
    ),
    (
        "pretrain",
        lambda f: pretrain("--mock-data", "--load", f["ckpt_meta"]),
        "not valid JSON",
    ),
    (
        "convert",
        lambda f: ["--from", "hf", "--load", f["dir"] + "/hf_empty", "--to", "sharded", "--output", f["dir"] + "/s"],
        "config.json",
    ),
    ("pretrain", lambda f: pretrain("--data-path", "1e308", f["good"], "1e308", f["good"]), "their sum overflows"),
    (
        "convert",
        lambda f: ["--from", "hf", "--load", f["dir"] + "/hf_bogus", "--to", "sharded", "--output", f["dir"] + "/s"],
        "model_type 'bogus' is none of those imported: llama, gpt2, olmo_hybrid, qwen3_moe, mixtral, megatron_zpp_gla "
        "(our GLA/hybrid export)",
    ),
] + [  # every wrong --from/--to pair: its own reason, and the pairs that are conversions
    ("convert", lambda f, a=a, b=b: ["--from", a, "--load", f["dir"], "--to", b, "--output", f["dir"] + "/s"], why)
    for a, b, why in [
        ("megatron_zpp", "sharded", "--to sharded: our checkpoints are sharded already (pretrain_gpt.py --load"),
        ("hf", "hf", "--load is a HF directory already; the conversions are --from megatron_zpp --to consolidated|"),
        ("megatron", "megatron", "--load is a megatron-core checkpoint already; the conversions are"),
        *[(a, b, f"{a} --to {b}: a") for a, b in [("hf", "consolidated"), ("hf", "megatron"), ("megatron", "hf")]],
        (
            "megatron",
            "consolidated",
            "a megatron-core checkpoint converts to our sharded checkpoint only (--to sharded",
        ),
    ]
]
MAINS = {
    "pretrain": pretrain_gpt.main,
    "pre": preprocess_data.main,
    "tok": train_tokenizer.main,
    "merge": merge_datasets.main,
    "convert": convert_checkpoint.main,
}


def test_every_bad_input_is_one_named_error(files, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert len(CASES) >= 50
    failures = []
    for tool, argv, why in CASES:
        args = argv(files)
        code, err = call(MAINS[tool], args)
        errors = [line for line in err.splitlines() if "error:" in line]  # argparse's usage, a hint may surround it
        ok = code not in (0, None) and "Traceback" not in err and len(errors) == 1 and why in errors[0]
        if not ok:
            failures.append(
                f"{tool} {' '.join(args)}\n  exit {code}, stderr: {err.strip()[-600:]!r}\n  wanted: {why!r}"
            )
    assert not failures, "\n".join(failures)


LAUNCH_CASES = [  # (environment, what the error line says)
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 with WORLD_SIZE=2"),
    # a rank other than 0 that still runs after pretrain_gpt.PEER_WAIT_S (rank 0 saw no problem) says it itself
    (
        {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
        "rank 1: --seed -1 must be in [0, 2^32)",
    ),
]


def test_bad_launch_environment_and_refusals_on_every_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(pretrain_gpt, "PEER_WAIT_S", 0.0)  # rank 1 alone: no rank 0 to wait for
    failures = []
    for env, why in LAUNCH_CASES:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            code, err = call(pretrain_gpt.main, pretrain("--mock-data", "--seed", "-1"))
        errors = [line for line in err.splitlines() if "error:" in line]
        if code in (0, None) or "Traceback" in err or len(errors) != 1 or why not in errors[0]:
            failures.append(f"{env}: exit {code}, stderr {err.strip()[-600:]!r}, wanted {why!r}")
    assert not failures, "\n".join(failures)


def test_good_inputs_pass_the_checks(files):
    """The checks refuse only bad input: the good pair with NullTokenizer, int32 ids with the sentencepiece model."""
    from megatron_zpp.config.arguments import parse_config
    from megatron_zpp.data.inputs import check_inputs

    check_inputs(parse_config(pretrain("--data-path", files["good"]), 1))
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", files["sp"]]
    check_inputs(parse_config(pretrain("--data-path", "1", files["int32"], "2", files["good"], *sp), 1))


def test_a_real_process_exits_nonzero_without_traceback(files):
    """pretrain_gpt.py as the shell runs it (the tools' exit codes: tests/data/test_preprocess.py)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RANK", None)
    argv = [sys.executable, "pretrain_gpt.py", *TINY, "--data-path", files["short_bin"]]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "do not belong together" in errors[0], out.stderr


def test_compressed_corpora_read_like_plain(files, tmp_path):
    """gzip, zstd, bz2 and xz corpora (told by their first bytes, whatever their name) give the
    bytes the plain corpus gives, in preprocessing and tokenizer training."""
    import bz2
    import lzma

    plain = open(files["jsonl"], "rb").read() * 300  # several read batches
    packed = {
        "c.jsonl": plain,
        "c.jsonl.gz": gzip.compress(plain),
        "c.jsonl.zst": zstandard.ZstdCompressor().compress(plain[:5000])
        + zstandard.ZstdCompressor().compress(plain[5000:]),
        "c.jsonl.bz2": bz2.compress(plain),
        "c.jsonl.xz": lzma.compress(plain),
        "gzip_named_plain.jsonl": gzip.compress(plain),
    }
    outputs = {}
    for name, data in packed.items():
        prefix = str(tmp_path / name.replace(".", "_"))
        argv = pre(files, write(tmp_path / name, data))
        argv[argv.index("--output-prefix") + 1] = prefix
        assert call(preprocess_data.main, argv)[0] == 0
        outputs[name] = [open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")]
        texts = list(train_tokenizer.iter_texts([str(tmp_path / name)], ["text"]))
        assert texts == TEXTS[:5] * 300, name
    assert all(v == outputs["c.jsonl"] for v in outputs.values())


def test_failure_hint_names_a_checkpoint_only_when_one_exists(tmp_path):
    """A lost peer or a timeout says where to resume: the last checkpoint, or that none was saved."""
    from megatron_zpp.config.arguments import parse_config

    ck = str(tmp_path / "ck")
    hint = lambda *a: pretrain_gpt._resume_hint(parse_config(pretrain("--mock-data", *a), 1))  # noqa: E731
    assert hint("--save", ck) == "rerun it (no checkpoint was saved)"
    assert hint() == "rerun it (no --save: no checkpoint)"
    os.makedirs(ck)
    write(os.path.join(ck, "latest"), b"iter_0000002\n")
    assert hint("--save", ck) == f"resume from the last checkpoint with --load {ck}"
