"""--fp16 loss scaling: Megatron's dynamic rule step by step, and a training run in which the
scaled backward equals the unscaled fp32 run and an injected inf skips its step.

fp16 matmuls are unusable on this CPU, so the runs compute in fp32 with the scaling emulated
(builders.training_dtype patched): everything else --fp16 does is what a GPU run does."""

import math

import pytest
import torch

from megatron_zpp import training
from megatron_zpp.checkpoint import save_checkpoint
from megatron_zpp.config import TrainConfig
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.optim.loss_scaler import LossScaler
from megatron_zpp.training import builders
from megatron_zpp.validation import validate
from tests.old_defaults import OLD_DEFAULTS


def test_dynamic_rule_hysteresis_window_and_floor():
    s = LossScaler.from_config(TrainConfig(fp16=True, initial_loss_scale=1024, loss_scale_window=3, hysteresis=2))
    s.update(True)  # first overflow spends one hysteresis count: the scale stays
    assert s.scale == 1024
    s.update(True)  # the count is spent: halve
    assert s.scale == 512
    s.update(True)  # stays spent until a growth refills it: halve again
    assert s.scale == 256
    for _ in range(3):  # a window of clean steps doubles and refills the count
        s.update(False)
    assert s.scale == 512 and s.hysteresis_left == 2
    s.update(False), s.update(True), s.update(False), s.update(False)  # an overflow restarts the window
    assert s.scale == 512 and s.growth_tracker == 2
    floor = LossScaler.from_config(TrainConfig(fp16=True, initial_loss_scale=2, min_loss_scale=1, hysteresis=1))
    for _ in range(3):
        floor.update(True)
    assert floor.scale == 1  # never below --min-loss-scale
    static = LossScaler.from_config(TrainConfig(fp16=True, loss_scale=128))
    static.update(True), static.update(False)
    assert static.scale == 128 and not static.dynamic
    assert LossScaler.from_config(TrainConfig()) is None
    restored = LossScaler(1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


TINY = (
    OLD_DEFAULTS
    + (
        "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --vocab-size 128 "
        "--make-vocab-size-divisible-by 32 --lr 3e-3 --lr-warmup-iters 1 --global-batch-size 2 --train-iters 3 "
        "--seed 7 --device cpu --peak-tflops 1 --clip-grad 0.5"
    ).split()
)


def run_steps(extra: list[str], inject_at: int | None = None):
    """Train TINY + extra; at step `inject_at` (1-based) one gradient element becomes inf.
    Returns (run, losses, lrs, weights after each step)."""
    run = training.setup(validate(parse_args(TINY + extra), 1))
    losses, lrs, weights = [], [], []
    step = run.dp.step

    def stepped(lr, loss_scale=None, *check):
        if len(losses) + 1 == inject_at:
            run.dp.params[3].main_grad.view(-1)[0] = math.inf
        return step(lr, loss_scale, *check)

    run.dp.step = stepped
    for _ in range(run.cfg.train.train_iters):
        loss, _, lr = training.train_step(run)
        run.state.iteration += 1
        run.state.consumed_samples += run.cfg.train.global_batch_size
        losses.append(loss)
        lrs.append(lr)
        weights.append([p.detach().clone() for p in run.dp.params])
    run.train_data.close()
    return run, losses, lrs, weights


@pytest.fixture
def fp32_compute(monkeypatch):
    monkeypatch.setattr(builders, "training_dtype", lambda cfg: torch.float32)


def test_fp16_scaling_matches_fp32_and_overflow_skips(fp32_compute, tmp_path):
    _, ref_losses, ref_lrs, ref_w = run_steps([])
    # no overflow: a power-of-two scale is exact in fp32, so the run equals the unscaled one
    run, losses, lrs, w = run_steps(["--fp16", "--initial-loss-scale", "65536"])
    assert losses == ref_losses and lrs == ref_lrs
    assert all(torch.equal(a, b) for a, b in zip(w[-1], ref_w[-1]))
    assert run.state.loss_scaler.scale == 65536 and run.state.skipped_iterations == 0
    # an inf gradient at step 2 with --hysteresis 1: the step is skipped (weights unchanged), the scale
    # halves, and the LR schedule does not advance (step 3 takes the LR step 2 would have had)
    run, losses, lrs, w = run_steps(["--fp16", "--initial-loss-scale", "65536", "--hysteresis", "1"], inject_at=2)
    assert losses[:2] == ref_losses[:2]
    assert all(torch.equal(a, b) for a, b in zip(w[1], ref_w[0]))
    assert run.state.skipped_iterations == 1 and run.state.last_step_skipped is False
    assert run.state.loss_scaler.scale == 32768
    assert lrs == [ref_lrs[0], ref_lrs[1], ref_lrs[1]]
    assert run.state.skipped_samples == 2
    # the checkpoint keeps the scaler and the skipped steps
    save_checkpoint(run, str(tmp_path))
    resumed = training.setup(validate(parse_args(TINY + ["--fp16", "--load", str(tmp_path)]), 1))
    assert resumed.state.loss_scaler.state_dict() == run.state.loss_scaler.state_dict()
    assert (resumed.state.skipped_iterations, resumed.state.skipped_samples) == (1, 2)
    resumed.train_data.close()
