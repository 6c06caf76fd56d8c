"""The run's input files, checked before anything is built (pretrain_gpt.py calls check_inputs
right after the configuration is validated, before any process group or model exists):

- every --data-path prefix has both files of its `.bin/.idx` pair, readable, whose headers and
  sizes agree and every entry of the index is consistent (IndexedDataset.verify), with
  tokens in it; the blend's weights parse;
- the tokenizer model exists and is of its --tokenizer-type (a sentencepiece `.model` file, a
  local HF tokenizer directory) and loads;
- an explicit --vocab-size agrees with a tokenizer that has its own vocabulary, and every token
  id of each `.bin` fits the tokenizer's true (unpadded) vocabulary (data tokenized with another
  tokenizer, or NullTokenizer's --vocab-size too small, would index past the embedding or into
  its padding rows): one vectorised pass over the memory map on every start (token_range.py).

Each problem is one line naming the flag and what to do; ConfigError lists them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os

import numpy as np

from ..config import Config, ConfigError, ModelConfig
from .indexed_dataset import IndexedDataset, IndexedDatasetError, bin_path, idx_path
from .token_range import scan_range
from .tokenizer import SENTENCEPIECE_TYPES, build_tokenizer

# what a tokenizer's save_pretrained may write; a directory with none of them holds no tokenizer
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
_TOKENIZER_ERRORS = (OSError, ValueError, RuntimeError, ImportError, TypeError, KeyError)


def check_inputs(cfg: Config) -> None:
    """Raise ConfigError listing every problem with the input files of `cfg` (see the module doc)."""
    try:
        tokenizer, errors = load_tokenizer(cfg), []
    except ConfigError as e:
        tokenizer, errors = None, [str(e)]
    if tokenizer is not None:
        errors += _check_vocab_flag(cfg, tokenizer.vocab_size)
    if not cfg.data.mock_data and cfg.data.data_path:
        vocab = tokenizer.vocab_size if tokenizer else None
        errors += check_data_path(cfg.data.data_path, vocab)
    if errors:
        raise ConfigError("\n".join(errors))


def load_tokenizer(cfg: Config, tp_size: int = 1):
    """The tokenizer of `cfg`; a missing model, one of the wrong kind or one that does not load
    is a ConfigError naming --tokenizer-model."""
    d, m = cfg.data, cfg.model
    files = {"vocab_file": d.vocab_file, "merge_file": d.merge_file}  # GPT2BPETokenizer's
    return checked_tokenizer(
        d.tokenizer_type, d.tokenizer_model, m.vocab_size, m.make_vocab_size_divisible_by, tp_size, **files
    )


def checked_tokenizer(
    kind: str, model: str | None, vocab_size: int | None, divisible_by: int = 128, tp_size: int = 1, **files
):
    """build_tokenizer, with every way it can fail on its input a one-line ConfigError (the data
    tools use it too)."""
    problem = _tokenizer_model_problem(kind, model)
    if problem:
        raise ConfigError(problem)
    try:
        return build_tokenizer(kind, model, vocab_size, divisible_by, tp_size, **files)
    except _TOKENIZER_ERRORS as e:
        text = " ".join(str(e).split()) or type(e).__name__
        if text.startswith("--") or not model:
            raise ConfigError(text) from None
        raise ConfigError(f"--tokenizer-model {model}: cannot be loaded as a {kind} ({text})") from None


def _tokenizer_model_problem(kind: str, path: str | None) -> str | None:
    """Why `path` cannot be a model of tokenizer `kind` (None when it may be): missing, unreadable,
    a file where a directory is needed or the other way round."""
    kind = "SentencePieceTokenizer" if kind in SENTENCEPIECE_TYPES else kind  # the GPT variant reads the same file
    if kind not in ("SentencePieceTokenizer", "HuggingFaceTokenizer") or not path:
        return None  # NullTokenizer needs no file; other kinds check their own files
    flag = f"--tokenizer-model {path}"
    if not os.path.exists(path):
        return f"{flag}: no such {'file' if kind == 'SentencePieceTokenizer' else 'directory'}"
    if kind == "SentencePieceTokenizer" and os.path.isdir(path):
        return (
            f"{flag}: is a directory; SentencePieceTokenizer takes one .model file "
            "(for a directory saved by HF save_pretrained use --tokenizer-type HuggingFaceTokenizer)"
        )
    if kind == "HuggingFaceTokenizer" and not os.path.isdir(path):
        return (
            f"{flag}: is a file; HuggingFaceTokenizer takes a local directory saved by save_pretrained "
            "(for a sentencepiece .model use --tokenizer-type SentencePieceTokenizer)"
        )
    if not os.access(path, os.R_OK):
        return f"{flag}: not readable (permission denied)"
    if kind == "HuggingFaceTokenizer" and not any(os.path.isfile(os.path.join(path, n)) for n in HF_TOKENIZER_FILES):
        return (
            f"{flag}: holds no tokenizer files ({', '.join(HF_TOKENIZER_FILES[:2])}, ...): "
            "give the directory a tokenizer's save_pretrained wrote"
        )
    return None


def _check_vocab_flag(cfg: Config, tokenizer_vocab: int) -> list[str]:
    """An explicit --vocab-size is NullTokenizer's; the other tokenizers bring their own vocabulary,
    so a --vocab-size that differs from it would be silently ignored: refuse it instead."""
    given, default = cfg.model.vocab_size, _default_of(ModelConfig, "vocab_size")
    d = cfg.data
    if d.tokenizer_type == "NullTokenizer" or given in (None, default) or given == tokenizer_vocab:
        return []
    how = "larger" if given > tokenizer_vocab else "smaller"
    return [
        f"--vocab-size {given} is {how} than the vocabulary of --tokenizer-model {d.tokenizer_model} "
        f"({tokenizer_vocab} tokens); with --tokenizer-type {d.tokenizer_type} the model's vocabulary is the "
        "tokenizer's (padded by --make-vocab-size-divisible-by): drop --vocab-size"
    ]


def _default_of(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


def check_data_path(data_path: list[str], vocab_size: int | None) -> list[str]:
    """One line per problem of the --data-path blend and its pairs."""
    from .blended import parse_data_path  # here: blended imports torch, the data tools import this module

    try:
        prefixes, _ = parse_data_path(data_path)
    except ValueError as e:
        return [str(e)]
    errors = []
    for prefix in prefixes:
        problem = _pair_problem(prefix)
        if problem is None:
            problem = _content_problem(prefix, vocab_size)
        if problem:
            errors.append(problem)
    return errors


def _pair_problem(prefix: str) -> str | None:
    """Why PREFIX.bin/.idx cannot be opened (None when both files are there and readable)."""
    flag = f"--data-path {prefix}"
    if prefix.endswith((".bin", ".idx")):
        return f"{flag}: give the prefix of the pair without .bin/.idx: {prefix[:-4]}"
    for path in (idx_path(prefix), bin_path(prefix)):
        if os.path.isdir(path):
            return f"{flag}: {path} is a directory, not a file"
        if not os.path.isfile(path):
            if os.path.isdir(prefix):
                return f"{flag}: is a directory; give the prefix of a pair in it{_nearest_pair(prefix + os.sep)}"
            compressed = [path + ext for ext in (".gz", ".zst", ".bz2", ".xz") if os.path.isfile(path + ext)]
            if compressed:
                return f"{flag}: {path} is missing but {compressed[0]} exists: decompress it (pairs are memory-mapped)"
            return f"{flag}: {path} is missing{_nearest_pair(prefix)}"
        if not os.access(path, os.R_OK):
            return f"{flag}: {path} is not readable (permission denied)"
    return None


def _nearest_pair(prefix: str) -> str:
    """' (did you mean P?)' for the closest prefix of a pair next to `prefix`, else ''."""
    folder = os.path.dirname(prefix) or "."
    if not os.path.isdir(folder):
        return f" (no directory {folder})"
    found = [p[:-4] for p in glob.glob(os.path.join(glob.escape(folder), "*.idx"))[:1000]]
    close = difflib.get_close_matches(prefix.rstrip(os.sep), found, n=1, cutoff=0.0)
    return f" (did you mean {close[0]}?)" if close else ""


def _content_problem(prefix: str, vocab_size: int | None) -> str | None:
    """Why the pair's contents cannot be trained on: malformed, empty, or ids past the vocabulary."""
    flag = f"--data-path {prefix}"
    try:
        ds = IndexedDataset(prefix)
        ds.verify()  # every entry, blocked: 12 bytes a sequence against the .bin's scan below
    except IndexedDatasetError as e:
        return f"{flag}: {e}"
    except OSError as e:
        return f"{flag}: cannot read ({e.strerror or e})"
    if ds.dtype.kind == "f":
        return f"{flag}: {idx_path(prefix)} says the tokens are {ds.dtype.name}, not integer token ids"
    if ds.num_tokens == 0:
        return f"{flag}: the pair holds no tokens ({ds.num_documents} documents, all empty)"
    low, high = scan_range(np.frombuffer(ds._bin, ds.dtype, ds.num_tokens))
    if low < 0:
        return f"{flag}: negative token id {low} in {bin_path(prefix)}"
    if vocab_size is not None and high >= vocab_size:
        return (
            f"{flag}: token id {high} in {bin_path(prefix)} is past the tokenizer's vocabulary of {vocab_size}; "
            "the data was tokenized with another tokenizer (give its --tokenizer-type/--tokenizer-model) "
            "or --vocab-size is too small"
        )
    return None
