"""Progress bars of the long tools (megatron_zpp/progress.py) and the ETA of the training log line."""

import contextlib
import io
import os

import numpy as np
import torch

from megatron_zpp.config.arguments import parse_args
from megatron_zpp.data import preprocess as preprocess_data
from megatron_zpp.data import tokenizer_training as train_tokenizer
from megatron_zpp.data.blended import build_blending_indices
from megatron_zpp.data.indexed_dataset import IndexedDatasetWriter
from megatron_zpp.progress import progress
from megatron_zpp.training.loop import StepClock, format_eta
from megatron_zpp.validation import validate
from tools import convert_checkpoint, merge_datasets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_off_a_terminal_or_off_rank_0(monkeypatch):
    items = [1, 2, 3]
    monkeypatch.delenv("RANK", raising=False)
    assert progress(items, "x", file=io.StringIO()) is items  # a pipe or a log file: the iterable itself
    monkeypatch.setenv("RANK", "1")
    tty = FakeTTY()
    assert progress(items, "x", file=tty) is items
    bar = progress(None, "x", 10, file=tty)  # a manual bar that does nothing
    bar.update(5)
    bar.close()
    assert tty.getvalue() == ""


def test_bar_with_count_and_rate_on_a_terminal(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    tty = FakeTTY()
    assert list(progress(range(7), "merging", unit=" pairs", file=tty)) == list(range(7))
    text = tty.getvalue()
    assert "merging" in text and "7/7" in text and "pairs/s" in text
    tty = FakeTTY()
    bar = progress(None, "copying", 3 << 20, "B", file=tty)
    bar.update(3 << 20)
    bar.close()
    assert "copying" in tty.getvalue() and "3.15M/3.15M" in tty.getvalue() and "B/s" in tty.getvalue()


def test_tools_draw_their_bars(tmp_path, monkeypatch):
    """Each tool's bar, drawn on rank 0's stderr replaced by a terminal (in the test's body: pytest
    puts its own capture back on sys.stderr after the fixtures)."""
    monkeypatch.delenv("RANK", raising=False)
    tty = FakeTTY()
    with contextlib.redirect_stderr(tty):
        _run_tools(tmp_path)
    text = tty.getvalue()
    for desc in (
        "merging",
        "tokenizing",
        "reading text",
        "blending index",
        "HF export",
        "HF import",
        "consolidating",
        "resharding",
    ):
        assert desc in text, f"no {desc!r} bar in {text!r}"


def _run_tools(tmp_path):
    prefixes = []
    for i in range(2):
        w = IndexedDatasetWriter(str(tmp_path / f"p{i}.bin"), np.uint16)
        w.add_document(list(range(1, 100)))
        w.finalize(str(tmp_path / f"p{i}.idx"))
        prefixes.append(str(tmp_path / f"p{i}"))
    assert merge_datasets.main(["--input", *prefixes, "--output-prefix", str(tmp_path / "m")]) == 0
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i} of some text\n" for i in range(200)))
    args = ["--input", str(corpus), "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "300"]
    assert train_tokenizer.main(args) == 0
    (tmp_path / "c.jsonl").write_text('{"text": "1 2 3"}\n' * 50)
    args = ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "pre")]
    assert preprocess_data.main(args + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]) == 0
    build_blending_indices([0.3, 0.7], 1000)
    llama = "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear"  # exported as Llama
    argv = f"--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 {llama}".split()
    cfg = validate(parse_args(argv), 1)
    from megatron_zpp.model import GPT

    state = {k: v.detach() for k, v in GPT(cfg.model, 128).named_parameters()}
    convert_checkpoint.from_hf_state(convert_checkpoint.to_hf_state(state, cfg), cfg)
    from megatron_zpp.checkpoint.consolidate import consolidate
    from megatron_zpp.checkpoint.save import save_weights

    save_weights(str(tmp_path / "ckpt"), cfg, state)
    assert set(consolidate(str(tmp_path / "ckpt"))[0]) == set(state)
    from megatron_zpp.checkpoint.files import find_checkpoint
    from megatron_zpp.checkpoint.reshard import SavedCheckpoint, rank_state_for

    saved = SavedCheckpoint(*find_checkpoint(str(tmp_path / "ckpt")))
    rank_state_for(saved, cfg, 128, 0, torch.float32)


def test_eta_is_the_mean_step_time_times_the_remaining_steps():
    clock = StepClock()
    clock.add(30.0)  # the first step's warm-up is left out once there are others
    assert clock.eta(10) == 300.0
    clock.add(1.0)
    clock.add(3.0)
    assert clock.eta(4) == 8.0 and clock.eta(0) == 0.0
    assert format_eta(3725.4) == "1:02:05" and format_eta(2 * 86400 + 61) == "2d 0:01:01"
