"""Tokenizers behind one small interface: vocab_size, padded_vocab_size, eod/pad/bos, tokenize, detokenize."""

from __future__ import annotations

import os

from ..config import TOKENIZER_TYPES


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by * TP so every TP shard is equal."""
    multiple = max(1, make_vocab_size_divisible_by) * max(1, tp_size)
    return -(-vocab_size // multiple) * multiple


class Tokenizer:
    vocab_size: int
    eod: int
    pad: int | None = None
    bos: int | None = None
    padded_vocab_size: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError


class NullTokenizer(Tokenizer):
    """Text is space-separated ids. The last id of the vocabulary is the end-of-document token."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# --tokenizer-type values read by SentencePieceTokenizer; Megatron's GPT and Llama-2 variants' EOD is always eos
# (megatron-core builds all three with its sentencepiece library; its legacy _Llama2Tokenizer's eod was eos too)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
EOD_IS_EOS_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model`. EOD is the model's `</s>` (eos) piece, or an `<EOD>` piece if it has one
    (`eod_is_eos`: always eos, as Megatron's GPTSentencePieceTokenizer)."""

    def __init__(self, model_file: str, eod_is_eos: bool = False):
        import sentencepiece as spm

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model {model_file}: no such sentencepiece model file")
        self.model_file = model_file
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        eod_piece = self.sp.piece_to_id("<EOD>")
        if not eod_is_eos and eod_piece != self.sp.unk_id() and self.sp.id_to_piece(eod_piece) == "<EOD>":
            self.eod = eod_piece
        elif self.sp.eos_id() >= 0:
            self.eod = self.sp.eos_id()
        else:
            raise ValueError(
                f"{model_file}: has neither an eos piece nor <EOD>; retrain it with tools/train_tokenizer.py"
            )
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """One C++ call for many texts; one thread by default since callers run one process per core."""
        return self.sp.encode(texts, num_threads=num_threads)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A tokenizer saved in a local directory (`save_pretrained`); never downloads."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: HuggingFaceTokenizer needs a local tokenizer directory")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("HuggingFaceTokenizer needs the `transformers` package: pip install transformers") from e
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        eod = self.tok.eos_token_id
        if eod is None:
            raise ValueError(f"{path}: the tokenizer has no eos token to use as end-of-document")
        self.eod = eod
        self.pad = self.tok.pad_token_id
        self.bos = self.tok.bos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from a vocab.json and a merges.txt (Megatron's GPT2BPETokenizer): GPT-2's
    pre-tokenizing regex over bytes, and the end-of-document token `<|endoftext|>`. Read with the
    `tokenizers` package; never downloads."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{flag} {path}: no such file (GPT2BPETokenizer needs vocab.json and merges.txt)"
                )
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError as e:
            raise ImportError("GPT2BPETokenizer needs the `tokenizers` package: pip install tokenizers") from e
        self.tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        eod = self.tok.token_to_id(self.EOD)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: has no {self.EOD} token to end documents with")
        self.vocab_size, self.eod = self.tok.get_vocab_size(), eod

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def infer_tokenizer_type(
    tokenizer_model: str | None, vocab_file: str | None, merge_file: str | None
) -> tuple[str, str]:
    """(--tokenizer-type, why) when it is not given, from the files that are: --vocab-file and
    --merge-file mean GPT2BPETokenizer; a --tokenizer-model directory (or a path that does not
    exist and does not end in .model: HF loads directories only) HuggingFaceTokenizer; any
    other --tokenizer-model (a .model file) SentencePieceTokenizer; nothing NullTokenizer.
    Training (validation.derive) and tools/preprocess_data.py both use this one rule."""
    if vocab_file and merge_file:
        return "GPT2BPETokenizer", "--vocab-file and --merge-file given"
    if tokenizer_model:
        if os.path.isdir(tokenizer_model) or not (
            os.path.exists(tokenizer_model) or tokenizer_model.endswith(".model")
        ):
            return "HuggingFaceTokenizer", f"--tokenizer-model {tokenizer_model} is a directory"
        return "SentencePieceTokenizer", f"--tokenizer-model {tokenizer_model} is a file"
    return "NullTokenizer", "no --tokenizer-model, --vocab-file or --merge-file"


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    tp_size: int = 1,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Tokenizer:
    """Build the tokenizer named by --tokenizer-type and set its Megatron-padded vocabulary size."""
    if tokenizer_type == "GPT2BPETokenizer":
        tok = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        tok = NullTokenizer(vocab_size)
    elif tokenizer_type in (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        if tokenizer_type == "HuggingFaceTokenizer":
            tok = HuggingFaceTokenizer(tokenizer_model)
        else:
            tok = SentencePieceTokenizer(tokenizer_model, eod_is_eos=tokenizer_type in EOD_IS_EOS_TYPES)
    else:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    tok.padded_vocab_size = pad_vocab_size(tok.vocab_size, make_vocab_size_divisible_by, tp_size)
    return tok
