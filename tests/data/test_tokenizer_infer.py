"""--tokenizer-type inferred from the files given, one rule for training and
tools/preprocess_data.py: a .model file is sentencepiece, a directory HF, --vocab-file with
--merge-file GPT-2 BPE, nothing NullTokenizer. A corpus preprocessed with an 8000-piece model
used to fail the run's token check against NullTokenizer's vocabulary; it now trains."""

import json

import pytest

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.data import preprocess as preprocess_data
from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.inputs import check_inputs
from megatron_zpp.data.tokenizer import infer_tokenizer_type
from megatron_zpp.validation import validate

DOCS = [f"Document {i}: " + "words and more words, " * (i % 7) + "the end." for i in range(200)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer.train(iter(DOCS), str(d / "tok"), 400, "bpe")
    return str(d / "tok.model")


def test_the_rule(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "x.model").write_text("")
    assert infer_tokenizer_type(str(tmp_path / "x.model"), None, None)[0] == "SentencePieceTokenizer"
    assert infer_tokenizer_type(str(tmp_path / "missing.model"), None, None)[0] == "SentencePieceTokenizer"
    assert infer_tokenizer_type(str(tmp_path / "hf"), None, None)[0] == "HuggingFaceTokenizer"
    assert infer_tokenizer_type(str(tmp_path / "no-such-dir"), None, None)[0] == "HuggingFaceTokenizer"
    assert infer_tokenizer_type(None, "v.json", "m.txt")[0] == "GPT2BPETokenizer"
    assert infer_tokenizer_type(None, None, None)[0] == "NullTokenizer"


def test_a_given_type_is_kept_and_an_inferred_one_says_why(sp_model):
    cfg = validate(parse_args(["--mock-data", "--tokenizer-model", sp_model]), 1)
    assert cfg.data.tokenizer_type == "SentencePieceTokenizer"
    assert cfg.data.tokenizer_type_inferred == f"--tokenizer-model {sp_model} is a file"
    cfg = validate(parse_args(["--mock-data", "--tokenizer-model", sp_model, "--tokenizer-type", "NullTokenizer"]), 1)
    assert cfg.data.tokenizer_type == "NullTokenizer" and cfg.data.tokenizer_type_inferred == ""


def test_preprocessed_corpus_trains_without_a_type(tmp_path, sp_model, capsys):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    argv = ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c"), "--append-eod"]
    assert preprocess_data.main([*argv, "--tokenizer-model", sp_model]) == 0
    assert f"--tokenizer-type SentencePieceTokenizer (inferred: --tokenizer-model {sp_model} is a file)" in (
        capsys.readouterr().err
    )
    prefix = str(tmp_path / "c_text_document")
    flags = ["--data-path", prefix, "--tokenizer-model", sp_model, "--seq-length", "32"]
    check_inputs(validate(parse_args(flags), 1))  # raised "token ... >= NullTokenizer's vocabulary" before
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--data-path", prefix, "--seq-length", "32"]
    with pytest.raises(ConfigError, match="token"):  # what the run said before the type was inferred
        check_inputs(validate(parse_args(null), 1))
