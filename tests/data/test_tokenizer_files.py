"""GPT2BPETokenizer (--vocab-file, --merge-file) and HuggingFaceTokenizer (--tokenizer-model DIR) on
tiny tokenizers built here with the `tokenizers` package: ids equal those of the `tokenizers` object
itself (the independent reference), text round-trips, EOD is <|endoftext|>."""

import json

import pytest

from megatron_zpp.data.tokenizer import build_tokenizer

TEXT = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "café 東京 🙂"] * 20
EOD = "<|endoftext|>"


def byte_level_bpe():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=320, min_frequency=1, special_tokens=[EOD])
    return bpe


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    bpe = byte_level_bpe()
    vocab, merges = bpe.save_model(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", None, None, 128, 2, vocab_file=vocab, merge_file=merges)
    assert tok.eod == bpe.token_to_id(EOD) and tok.vocab_size == bpe.get_vocab_size()
    assert tok.padded_vocab_size % 256 == 0
    for text in [*TEXT[:3], "unseen zebra ∮ words"]:
        ids = tok.tokenize(text)
        assert ids == bpe.encode(text).ids
        assert tok.detokenize(ids) == text  # byte-level: lossless
    with open(vocab) as f:
        assert len(json.load(f)) == tok.vocab_size


def test_gpt2_bpe_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", None, vocab_file=str(tmp_path / "no.json"), merge_file="m.txt")
    bpe = byte_level_bpe()
    vocab, merges = bpe.save_model(str(tmp_path))
    with open(vocab) as f:
        entries = {k: v for k, v in json.load(f).items() if k != EOD}
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=EOD):
        build_tokenizer("GPT2BPETokenizer", None, vocab_file=str(no_eod), merge_file=merges)


def test_huggingface_tokenizer_directory(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bpe = byte_level_bpe()
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOD).save_pretrained(str(tmp_path / "hf"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"), None, 128, 1)
    assert tok.eod == bpe.token_to_id(EOD) and tok.vocab_size == bpe.get_vocab_size()
    for text in TEXT[:3]:
        ids = tok.tokenize(text)
        assert ids == bpe.encode(text).ids and tok.detokenize(ids) == text


def test_preprocess_data_with_gpt2_bpe(tmp_path):
    """Megatron's preprocessing command line (--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file):
    the documents' ids, each ended by EOD, are those of the `tokenizers` object."""
    from megatron_zpp.data.indexed_dataset import IndexedDataset
    from tests.data.test_preprocess import preprocess_data

    bpe = byte_level_bpe()
    vocab, merges = bpe.save_model(str(tmp_path))
    docs = TEXT[:3]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    argv = f"--input {tmp_path}/in.jsonl --output-prefix {tmp_path}/out --tokenizer-type GPT2BPETokenizer "
    argv += f"--vocab-file {vocab} --merge-file {merges} --append-eod --quiet"
    assert preprocess_data.main(argv.split()) == 0
    data = IndexedDataset(str(tmp_path / "out_text_document"))
    for i, text in enumerate(docs):
        assert data[i].tolist() == bpe.encode(text).ids + [bpe.token_to_id(EOD)]
