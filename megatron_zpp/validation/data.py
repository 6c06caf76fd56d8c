"""The data: its sources and --split, and the paths only a run reads (data, tokenizer files,
checkpoint directories)."""

from __future__ import annotations

from ..config import Config
from .common import failed


def check_data(cfg: Config, world_size: int) -> list[str]:
    d = cfg.data
    return failed(
        [
            (d.num_workers >= 0, f"--num-workers must be >= 0 (got {d.num_workers})"),
            (not (d.mock_data and d.data_path), "give either --data-path or --mock-data, not both"),
        ]
    ) + _check_split_weights(cfg)


def _check_split_weights(cfg: Config) -> list[str]:
    """--split read as Megatron reads it (data.builder.parse_split); a --split of a --data-path must
    give the training set a share (validation and test may have none)."""
    from ..data.builder import parse_split

    d = cfg.data
    try:
        weights = parse_split(d.split)
    except ValueError as e:
        return [str(e)]
    if d.mock_data or weights[0] > 0:
        return []
    return [f"--split {d.split!r} gives the training set no documents: its first number must be > 0"]


def check_run_paths(cfg: Config) -> list[str]:
    """What only a run needs: the data, the tokenizer's files and the checkpoint directories
    (validate(run=False) skips these: the planning tools read none of them)."""
    d, t = cfg.data, cfg.train
    return failed(
        [
            (bool(d.mock_data or d.data_path), "give --data-path PREFIX [...] or --mock-data"),
            (
                d.tokenizer_type in ("NullTokenizer", "GPT2BPETokenizer") or d.tokenizer_model is not None,
                f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model",
            ),
            (
                d.tokenizer_type != "GPT2BPETokenizer" or bool(d.vocab_file and d.merge_file),
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)",
            ),
            (
                d.tokenizer_type == "GPT2BPETokenizer" or not (d.vocab_file or d.merge_file),
                "--vocab-file/--merge-file are read by --tokenizer-type GPT2BPETokenizer only: add it or drop them",
            ),
            (not (t.save_interval and t.save is None), "--save-interval needs --save DIR (where to write checkpoints)"),
            (
                t.ckpt_step is None or t.load is not None,
                "--ckpt-step needs --load DIR (which checkpoints to choose from)",
            ),
            (not (t.exit_signal_handler and t.save is None), "--exit-signal-handler needs --save DIR (where to save)"),
        ]
    )
