"""What the Megatron-LM fixture tests share: reading a fixture (tests/fixtures/**/*.args), the fate of
each of its flags in our parser, and the test data its paths name."""

from __future__ import annotations

import os
import shlex

import numpy as np
import pytest

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import build_parser, parse_args
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter

HERE = os.path.dirname(os.path.abspath(__file__))


def fixture_lines(name: str, **paths) -> list[list[str]]:
    """The fixture's arguments, one flag with its values per line, the {paths} filled in."""
    with open(os.path.join(HERE, "fixtures", name)) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    return [shlex.split(ln.format(**paths)) for ln in lines]


def fate_of(flag: str, value: list[str], parser) -> tuple[str, str]:
    """(fate, why) of one flag as given: 'ok' (a setting or alias), 'noop', 'refused', or 'unknown'."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        return "unknown", ""
    if not action.dest.startswith("megatron."):
        return "ok", ""
    kind, why, group = parser.megatron[action.dest]
    if kind == "valued":
        from megatron_zpp.config.megatron_flags import valued_outcome

        is_noop, why = valued_outcome(why, value[0], group)
        return ("noop" if is_noop else "refused"), why
    return kind, why


def fates(lines: list[list[str]]) -> dict[str, tuple[str, str]]:
    parser = build_parser()
    return {ln[0]: fate_of(ln[0], ln[1:], parser) for ln in lines}


def check_flag_by_flag(lines: list[list[str]], expected: dict[str, str]) -> list[list[str]]:
    """Assert each fixture flag's fate and that every refusal comes in one pass, one line each;
    return the lines that are not refused."""
    assert [ln[0] for ln in lines] == list(expected), "the fixture and the table list the same flags, in order"
    got = fates(lines)
    for flag, fate in expected.items():
        have, why = got[flag]
        if fate in ("ok", "noop"):
            assert have == fate, (flag, have, why)
        else:
            assert have == "refused" and fate in why and ("drop it" in why or "use " in why), (flag, have, why)
    refused = [flag for flag, (have, _) in got.items() if have == "refused"]
    if not refused:
        parse_args([tok for ln in lines for tok in ln])
        return lines
    with pytest.raises(ConfigError) as info:
        parse_args([tok for ln in lines for tok in ln])
    named = [ln.split(":")[0].split()[0] for ln in str(info.value).splitlines()]
    assert sorted(named) == sorted(refused)  # one line per refused flag, naming it, all in one pass
    return [ln for ln in lines if ln[0] not in refused]


def tiny_gpt2_files(directory):
    """GPT-2-style vocab.json + merges.txt of a byte-level BPE trained here (`tokenizers`), and the BPE."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    text = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"] * 20
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(directory))
    return vocab, merges, bpe


def tiny_sentencepiece_model(prefix) -> str:
    """A 300-piece BPE sentencepiece model (ids cover tiny_dataset's 250) of random words; its .model path."""
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(400)]
    text = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(300))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(prefix), vocab_size=300, model_type="bpe",
        minloglevel=2,
    )  # fmt: skip
    return f"{prefix}.model"


def tiny_dataset(prefix: str, documents: int = 64, length: int = 100, vocab: int = 250) -> str:
    """A Megatron .bin/.idx pair of `documents` token sequences below `vocab`; returns the prefix."""
    writer = IndexedDatasetWriter(prefix + ".bin", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        writer.add_document(rng.integers(0, vocab, length))
    writer.finalize(prefix + ".idx")
    return prefix
