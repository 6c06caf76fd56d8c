"""The training loop: bf16, logging outputs, and pretrain_gpt.py end to end under torchrun
(data-parallel parity with one rank is the "dp2" layout of tests/test_parity.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_zpp import training
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.training.loop import format_eta
from megatron_zpp.validation import validate
from tests.old_defaults import OLD_DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--vocab-size 128 --make-vocab-size-divisible-by 32 --gla-chunk-size 8 --lr 3e-3 "
        "--lr-warmup-iters 2 --seed 7"
    ).split()
)


def run_training(argv: list[str], world_size: int) -> tuple[list[float], list[np.ndarray]]:
    cfg = validate(parse_args(argv), world_size)
    run = training.setup(cfg)
    history = training.train(run)
    return [h["loss"] for h in history], [
        p.detach().double().numpy().copy() for c in run.chunks for p in c.parameters()
    ]


def test_bf16_trains_with_fp32_masters():
    losses, _ = run_training(TINY + ["--bf16", "--train-iters", "12", "--global-batch-size", "4"], 1)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_lr_schedule_metrics_file_tensorboard_and_wandb(tmp_path, monkeypatch):
    metrics = tmp_path / "m.jsonl"
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = TINY + [
        "--train-iters",
        "5",
        "--lr-decay-style",
        "linear",
        "--min-lr",
        "1e-4",
        "--metrics-file",
        str(metrics),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--wandb-project",
        "zpp-test",
        "--wandb-save-dir",  # not $WANDB_DIR: W&B reads that once per process, and other tests ran W&B before
        str(tmp_path),
        "--eval-interval",
        "5",
        "--eval-iters",
        "2",
    ]
    run_training(argv, 1)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))  # offline unless the user says otherwise
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "tflops_per_rank", "mfu", "memory_gib", "data_wait_time"):
        assert isinstance(rows[0][key], float), key
    assert [r["global_batch_size"] for r in rows] == [1] * 5  # micro x DP by default
    # Megatron's warmup: the first step at --lr-warmup-init (0), lr at step 2 of 2, then linear decay over 3
    assert [r["lr"] for r in rows[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])
    assert rows[-1]["lr"] == pytest.approx(3e-3 - (3e-3 - 1e-4) * 2 / 3)
    assert "val_loss" in rows[-1]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_rampup_resumes_mid_ramp_as_the_uninterrupted_run(tmp_path):
    # 20 samples, batch 2 ramping to 4 over 8 samples: steps start at 0 2 4 6 | 8 12 16 (tests/optim for the rule)
    base = TINY[:-4] + ["--seed", "7", "--lr-warmup-samples", "4", "--lr-decay-style", "cosine"]
    argv = base + "--train-samples 20 --rampup-batch-size 2 2 8 --global-batch-size 4".split()
    ckpt = str(tmp_path / "ckpt")

    def history(extra):
        return training.train(training.setup(validate(parse_args(argv + extra), 1)))

    whole = history(["--save", ckpt, "--save-interval", "3"])
    resumed = history(["--load", ckpt, "--ckpt-step", "3"])  # 6 samples consumed, 2 more at batch 2, then 4
    assert [h["global_batch_size"] for h in whole] == [2, 2, 2, 2, 4, 4, 4]
    assert [h["consumed_samples"] for h in whole] == [2, 4, 6, 8, 12, 16, 20]
    keys = ("iteration", "global_batch_size", "consumed_samples", "loss", "grad_norm", "lr")
    assert [[h[k] for k in keys] for h in resumed] == [[h[k] for k in keys] for h in whole[3:]]  # bitwise
    # the schedule counts the samples before each step (0, 2, 4): warmup over 4 samples from 0
    assert [h["lr"] for h in whole[:3]] == pytest.approx([0.0, 3e-3 * 2 / 4, 3e-3])


def torchrun(args: list[str], nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "pretrain_gpt.py",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_pretrain_gpt_under_torchrun(tmp_path):
    # one hybrid GQA model (GLA and softmax layers): each kind's training under every layout is test_parity's
    kind = ["--attention-type", "gla", "--softmax-attention-every", "2"]
    kind += ["--group-query-attention", "--num-query-groups", "2"]
    metrics, report = tmp_path / "m.jsonl", tmp_path / "comm.json"
    out = torchrun(
        TINY
        + kind
        + (
            f"--train-iters 15 --global-batch-size 8 --log-interval 5 --metrics-file {metrics} --comm-report {report}"
        ).split()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iteration       15/      15 | consumed samples:          120 |" in out.stdout
    assert "| global batch size:     8 |" in out.stdout and "| data wait " in out.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 15 and np.mean(losses[-3:]) < np.mean(losses[:3])
    # the ETA of each log line: remaining iterations x the mean step time (the first step left out)
    lines = [line for line in out.stdout.splitlines() if "| lm loss: " in line]
    assert "iteration        1/      15 |" in lines[0] and len(lines) == 4  # after the first step too, as Megatron
    for line, it in zip(lines[1:], (5, 10, 15)):
        times = [r["step_time"] for r in records[1:it]]
        assert line.endswith(f"| ETA {format_eta((15 - it) * sum(times) / len(times))}"), line

    rep = json.loads(report.read_text())
    assert rep["world_size"] == 2 and rep["steps"] == 15
    grads = [r for r in rep["records"] if r["phase"] == "grad_allreduce"]
    assert len(grads) == 1 and grads[0]["role"] == "dp_cp" and grads[0]["link"] == "intra_node"
    # ring all-reduce of every fp32 gradient over 2 ranks: 2 (n-1)/n x 4 bytes x parameters
    cfg = validate(parse_args(TINY + kind), 2)
    from megatron_zpp.model import GPT

    n_params = sum(p.numel() for p in GPT(cfg.model, 128).parameters())
    assert grads[0]["bytes_per_rank_per_step"] == pytest.approx(2 * 1 / 2 * 4 * n_params)


def test_invalid_layout_is_one_clear_error():
    out = torchrun(TINY + ["--num-attention-heads", "3", "--global-batch-size", "3"])
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert any("--num-attention-heads 3" in e for e in errors), out.stderr
    assert any("--global-batch-size 3" in e for e in errors), out.stderr
    assert "iter" not in out.stdout
