"""--step-batch-size-schedule against Megatron's StepBatchsizeNumMicroBatchesCalculator and its
update_train_iters, written out here step by step (NVIDIA/Megatron-LM d98e8a64dd)."""

import pytest

from megatron_zpp.config import ConfigError
from megatron_zpp.config.arguments import parse_args
from megatron_zpp.validation import validate

SCHEDULE = "0:16 2.4K:32 4K:48"  # tokens; at --seq-length 16: samples 0, 150, 250


def megatron_batch(consumed: int) -> int:
    batch = 16
    for threshold, bs in [(0, 16), (2400 // 16, 32), (4000 // 16, 48)]:
        if consumed >= threshold:
            batch = bs
    return batch


def megatron_iterations(train_samples: int) -> int:
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += megatron_batch(consumed)
        iterations += 1
    return iterations


def config(*extra: str):
    argv = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "4"]
    argv += ["--step-batch-size-schedule", SCHEDULE, *extra]
    return validate(parse_args(argv), 2)


@pytest.mark.parametrize("train_samples", [1, 16, 150, 151, 250, 1000, 1001])
def test_step_schedule_batches_and_iterations_as_megatron(train_samples):
    t = config("--train-samples", str(train_samples)).train
    assert t.global_batch_size == 48  # the schedule's last batch, as Megatron
    assert t.train_iters == megatron_iterations(train_samples)
    consumed = 0
    for step in range(t.train_iters + 3):
        assert t.global_batch_at(consumed) == megatron_batch(consumed), step
        assert t.samples_after(step) == consumed
        assert t.samples_after(2, consumed) == consumed + megatron_batch(consumed) + megatron_batch(
            consumed + megatron_batch(consumed)
        )
        consumed += megatron_batch(consumed)


def test_step_schedule_refusals_in_one_pass():
    with pytest.raises(ConfigError) as info:
        config("--global-batch-size", "32", "--micro-batch-size", "5", "--train-iters", "3")
    lines = str(info.value).splitlines()
    assert any("ends at batch 48 but --global-batch-size is 32" in ln for ln in lines)
    assert any("batches [16, 32, 48] are not multiples of --micro-batch-size x DP = 10" in ln for ln in lines)
    with pytest.raises(ConfigError, match="'0:16 x:3': 'x:3' is not THRESHOLD:BATCH"):
        validate(parse_args(["--mock-data", "--step-batch-size-schedule", "0:16 x:3"]), 1)
    with pytest.raises(ConfigError, match="first threshold must be 0"):
        validate(parse_args(["--mock-data", "--step-batch-size-schedule", "1K:16"]), 1)
