"""Tokenizers and tools/train_tokenizer.py."""

import importlib.util
import json
import os
import re

import pytest

from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.tokenizer import build_tokenizer, pad_vocab_size

TEXT = (
    'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n'
    "The quick brown fox jumps over the lazy dog. Übergrößenträger café naïve 東京 🙂\n"
)


def corpus(tmp_path, n=60):
    path = tmp_path / "c.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": TEXT * (1 + i % 3) + f"line {i}\n", "other": i}) + "\n")
    return path


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_tokenizer_cli_and_sentencepiece_tokenizer(tmp_path, model_type):
    prefix = str(tmp_path / "tok")
    rc = train_tokenizer.main(
        [
            "--input",
            str(corpus(tmp_path)),
            "--json-keys",
            "text",
            "--model-prefix",
            prefix,
            "--vocab-size",
            "500",
            "--model-type",
            model_type,
        ]
    )
    assert rc == 0 and os.path.isfile(prefix + ".model") and os.path.isfile(prefix + ".vocab")
    tok = build_tokenizer("SentencePieceTokenizer", prefix + ".model", None, 128, 2)
    assert tok.eod == 2 and tok.bos == 1 and tok.pad == 3
    assert tok.padded_vocab_size % 256 == 0 and tok.padded_vocab_size >= tok.vocab_size
    unseen = "zebra 𝔘 ∮ quartz\n\tindent  two  spaces"
    for text in (TEXT, unseen):  # lossless: whitespace kept, unseen characters via byte fallback
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert 0 not in ids  # never <unk>
    assert tok.tokenize_batch([TEXT, unseen]) == [tok.tokenize(TEXT), tok.tokenize(unseen)]


def test_train_from_plain_text_and_hf_dataset(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text(TEXT * 50)
    assert (
        train_tokenizer.main(["--input", str(txt), "--model-prefix", str(tmp_path / "t1"), "--vocab-size", "400"]) == 0
    )
    import datasets

    ds = datasets.Dataset.from_dict({"text": [TEXT * (1 + i % 3) for i in range(40)]})
    ds.save_to_disk(str(tmp_path / "hf"))
    assert (
        train_tokenizer.main(
            [
                "--input",
                str(tmp_path / "hf"),
                "--hf-dataset",
                "--model-prefix",
                str(tmp_path / "t2"),
                "--vocab-size",
                "400",
            ]
        )
        == 0
    )
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "t2.model"), None, 1, 1)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_null_tokenizer_and_padding():
    tok = build_tokenizer("NullTokenizer", None, 1000, 128, 4)
    assert tok.vocab_size == 1000 and tok.eod == 999 and tok.padded_vocab_size == 1024
    assert tok.tokenize("5 6  7") == [5, 6, 7] and tok.detokenize([5, 6, 7]) == "5 6 7"
    assert pad_vocab_size(50257, 128, 1) == 50304 and pad_vocab_size(50257, 128, 8) == 51200
    assert pad_vocab_size(512, 128, 2) == 512


def test_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        build_tokenizer("TikTokenizer", None, 10, 1, 1)
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", None, None, 1, 1)
    with pytest.raises(FileNotFoundError, match="no such sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "nope.model"), None, 1, 1)
    (tmp_path / "hf").mkdir()
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(ImportError, match="pip install transformers"):
            build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"), None, 1, 1)
    with pytest.raises(FileNotFoundError, match="local tokenizer directory"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing"), None, 1, 1)


@pytest.mark.parametrize("asked", [500, 5000])
def test_train_tokenizer_reports_the_vocabulary_it_wrote(tmp_path, capsys, asked):
    """The line names the pieces really written (the .vocab file's entries: one per piece), which is
    fewer than --vocab-size when the corpus has no more, and the size training pads it to."""
    prefix = str(tmp_path / "tok")
    assert (
        train_tokenizer.main(["--input", str(corpus(tmp_path)), "--model-prefix", prefix, "--vocab-size", str(asked)])
        == 0
    )
    # one "piece<TAB>score<NEWLINE>" entry per piece (a piece may itself be a newline: count the scores)
    pieces = len(re.findall(r"\t-?[0-9.]+(?:e-?[0-9]+)?\n", open(prefix + ".vocab", encoding="utf-8").read()))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"vocab {pieces:,}" in line
    assert ("was asked: the corpus gave no more pieces" in line) == (pieces != asked)
    assert pieces < asked or asked == 500  # 5000 is more than this corpus holds (500: 498 here)
    assert f"pads it to {-(-pieces // 128) * 128:,} at --make-vocab-size-divisible-by 128" in line


def test_gpt_sentencepiece_tokenizer_ends_documents_with_eos(tmp_path):
    """Megatron's GPTSentencePieceTokenizer: EOD is the model's eos, even where an <EOD> piece exists
    (our SentencePieceTokenizer takes that piece); the pieces are the same."""
    import sentencepiece as spm

    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"{TEXT} {i}" for i in range(200)))
    prefix = str(tmp_path / "eod")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=60, user_defined_symbols=["<EOD>"], minloglevel=2
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    ours = build_tokenizer("SentencePieceTokenizer", prefix + ".model", None, 128, 1)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", prefix + ".model", None, 128, 1)
    assert ours.eod == sp.piece_to_id("<EOD>") != sp.eos_id() == gpt.eod
    assert gpt.tokenize(TEXT) == ours.tokenize(TEXT) and gpt.padded_vocab_size == ours.padded_vocab_size
